"""A tiny causal LM and a character-level tokenizer, built offline and deterministically from a seed.

The result is an ordinary Hugging Face model directory (config, safetensors weights, tokenizer files), loadable by
path like any other; any local HF model directory can be used in its place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer

EOS, PAD = "<|endoftext|>", "<|pad|>"


@dataclass
class TinyModelConfig:
    """Shape of the tiny Qwen2 model."""

    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 384
    """Width of the MLP."""
    num_layers: int = 2
    """Decoder layers."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    max_positions: int = 1024
    """Longest sequence the rotary embedding is configured for."""
    seed: int = 0
    """Seed of the random initial weights."""


def _byte_symbols() -> list[str]:
    """The 256 symbols of byte-level BPE (GPT-2's reversible byte-to-unicode map), in byte order."""
    printable = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_tokenizer() -> Qwen2Tokenizer:
    """A Qwen2 byte-level BPE tokenizer with no merges: one token per byte, plus EOS and padding.

    Being a real Qwen2 tokenizer, it round-trips through save_pretrained/AutoTokenizer (and vLLM) unchanged.
    """
    vocab = {EOS: 0, PAD: 1} | {sym: i + 2 for i, sym in enumerate(_byte_symbols())}
    return Qwen2Tokenizer(vocab=vocab, merges=[], eos_token=EOS, pad_token=PAD, unk_token=EOS)


def build_tiny_model(path: str | Path, cfg: TinyModelConfig = TinyModelConfig()) -> Path:
    """Write a randomly initialised tiny Qwen2 model and its tokenizer to `path`; return the path."""
    path = Path(path)
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen2ForCausalLM(config).float()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
