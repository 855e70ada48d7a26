"""Randomly initialised models of real families' shapes, built offline: for checks that need a real vocabulary,
width and depth (jobs/gpu_check.sh, memory figures) but no trained weights, and no download.

The tokenizer is the tiny model's byte-level Qwen2 tokenizer (engines/tiny.py) filled up with never-merged filler
tokens to the family's tokenizer size, so the embedding is padded exactly as the real model's is (Qwen2.5: 151,665
tokens in 152,064 rows). The result is an ordinary Hugging Face model directory that vLLM and the learner load by
path; weights are saved in bfloat16, as the real checkpoints are.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Tokenizer

from treepo_ray.engines.tiny import EOS, PAD, _byte_symbols

# Shapes from each model's published config.json; `tokenizer_vocab` is len(tokenizer) of its published tokenizer.
SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", tokenizer_vocab=151665, vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-7b": dict(model_type="qwen2", tokenizer_vocab=151665, vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       tie_word_embeddings=False, rope_theta=1e6),
    "qwen3-0.6b": dict(model_type="qwen3", tokenizer_vocab=151669, vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, tie_word_embeddings=True, rope_theta=1e6),
    "llama-3.2-1b": dict(model_type="llama", tokenizer_vocab=128256, vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, tie_word_embeddings=True, rope_theta=5e5),
}


def build_filler_tokenizer(size: int) -> Qwen2Tokenizer:
    """A byte-level Qwen2 tokenizer with exactly `size` tokens: EOS, padding, the 256 bytes, then filler tokens
    (distinct strings of byte symbols, so every id decodes; no merges produce them, so text encodes to bytes)."""
    symbols = _byte_symbols()
    vocab = {EOS: 0, PAD: 1} | {sym: i + 2 for i, sym in enumerate(symbols)}
    n = 0
    while len(vocab) < size:
        digits, k = [], n
        while True:  # n written in base 256 with byte symbols, at least two of them (single bytes are taken)
            digits.append(symbols[k % 256])
            k //= 256
            if k == 0 and len(digits) >= 2:
                break
        vocab.setdefault("".join(digits), len(vocab))
        n += 1
    if len(vocab) != size:
        raise ValueError(f"a tokenizer needs at least {len(vocab)} tokens, got size = {size}")
    return Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=EOS, pad_token=PAD, unk_token=EOS)


def build_random_model(path: str | Path, shape: str, seed: int = 0, max_positions: int = 32768,
                       **overrides) -> Path:
    """Write a randomly initialised model of SHAPES[shape] (fields overridden by `overrides`, e.g. fewer layers)
    and its filler tokenizer to `path`; return the path."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(SHAPES)}")
    fields = SHAPES[shape] | overrides
    tokenizer = build_filler_tokenizer(fields.pop("tokenizer_vocab"))
    if fields["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size = {fields['vocab_size']} is below the tokenizer's {len(tokenizer)} tokens")
    config = AutoConfig.for_model(
        fields.pop("model_type"), **fields, max_position_embeddings=max_positions, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(torch.bfloat16)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
