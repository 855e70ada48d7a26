"""What the HF engine tests share: building their tiny models, and the Hugging Face model's own log-probs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from treepo_ray.engines.tiny import TinyModelConfig, build_tiny_model

SMALL = TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                        max_positions=256, seed=1)


def build(path: Path, padded_vocab: int | None = None, seed: int = 3) -> Path:
    """The SMALL tiny Qwen2 with its weights re-drawn larger: the default init (std 0.02, tied embedding) only ever
    repeats its last token. `padded_vocab`: pad the embedding to that many rows, with large padding rows whose
    logits would win almost every draw if the engine did not drop them."""
    build_tiny_model(path, SMALL)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if padded_vocab is not None:
        model.resize_token_embeddings(padded_vocab, mean_resizing=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        if padded_vocab is not None:
            emb = model.get_input_embeddings().weight
            emb[258:] = torch.randn(emb[258:].shape, generator=gen) * 20.0
    model.save_pretrained(path)
    return path


def hf_model(path: Path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of the HF model's own forward over the whole sequence: row i scores token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
