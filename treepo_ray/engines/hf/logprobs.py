"""Teacher-forced token log-probs of a causal LM (HFEngine.score): what given tokens would have scored as a sample.

CATPO grafts continuations that were sampled under the critique prompt, but trains them as continuations of the
original prefix (healing/critique.py). Their log-probs are therefore recomputed here, in one forward pass over
prefix + tokens, under the same convention as an engine's sampled log-probs: at the sampling temperature, full
softmax over the tokenizer's vocabulary (logits of padded embedding rows dropped), no top-k/top-p.
"""

from __future__ import annotations

import torch


def teacher_forced_logprobs(model: torch.nn.Module, prefix_ids: list[int], token_ids: list[int],
                            vocab_size: int | None = None, temperature: float = 1.0) -> list[float]:
    """log p(token_ids[i] | prefix_ids + token_ids[:i]) under `model` (an HF causal LM) at `temperature`, for
    every i.

    `vocab_size`: the tokenizer's size when the model's embedding is padded beyond it (None = all logits).
    """
    if not prefix_ids:
        raise ValueError("prefix_ids is empty; the first token needs a context")
    if not token_ids:
        return []
    ids = list(prefix_ids) + list(token_ids)
    limit = vocab_size if vocab_size is not None else model.config.vocab_size
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < limit), None)
    if bad is not None:
        raise ValueError(f"token id {ids[bad]} at position {bad} is outside the vocabulary (size {limit})")
    device = next(model.parameters()).device
    with torch.inference_mode():
        x = torch.tensor([ids], dtype=torch.long, device=device)
        logits = model(input_ids=x, use_cache=False).logits[0, len(prefix_ids) - 1:-1, :limit].float() / temperature
        logp = logits.log_softmax(dim=-1)
        target = torch.tensor(token_ids, dtype=torch.long, device=device)
        return logp.gather(-1, target[:, None])[:, 0].tolist()
