"""The hf engine's sampler alone: inverse-CDF sampling under temperature / top-k / top-p, and seeded uniforms."""

from __future__ import annotations

import pytest
import torch

from treepo_ray.engines.hf.sampler import sample, uniforms


def test_sample_inverse_cdf_with_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 6))
    temp = torch.ones(6)
    u = torch.tensor([0.1, 0.6, 0.9, 0.7, 0.9, 0.99])
    tokens, lps = sample(logits, temp, torch.zeros(6, dtype=torch.long), torch.ones(6), u)
    assert tokens.tolist() == [0, 1, 2, 1, 2, 2]  # cdf 0.5, 0.8, 1.0
    assert lps.tolist() == pytest.approx(torch.log(torch.tensor([0.5, 0.3, 0.2, 0.3, 0.2, 0.2])).tolist())
    # top-k 2: [0.625, 0.375]; top-p 0.6 keeps tokens whose preceding mass is < 0.6: the same two.
    for k, p in ((2, 1.0), (0, 0.6)):
        tokens, _ = sample(logits, temp, torch.full((6,), k), torch.full((6,), p), u)
        assert tokens.tolist() == [0, 0, 1, 1, 1, 1]
    # top-p 0.5: only the first token (the mass before the second one is 0.5, not < 0.5); temperature 0: argmax.
    tokens, _ = sample(logits, temp, torch.zeros(6, dtype=torch.long), torch.full((6,), 0.5), u)
    assert tokens.tolist() == [0] * 6
    tokens, lps = sample(logits, torch.zeros(6), torch.zeros(6, dtype=torch.long), torch.ones(6), u)
    assert tokens.tolist() == [0] * 6 and lps.tolist() == pytest.approx([torch.log(torch.tensor(0.5)).item()] * 6)


def test_logprobs_are_at_each_rows_sampling_temperature():
    """What the learner computes at learner.temperature (its behaviour log-probs): log softmax(logits / T), before
    top-k/top-p; greedy rows (T = 0) report temperature 1."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 3))
    temp = torch.tensor([2.0, 0.5, 0.0])
    u = torch.tensor([0.1, 0.1, 0.1])
    tokens, lps = sample(logits, temp, torch.full((3,), 2), torch.ones(3), u)
    want = [torch.log_softmax(logits[i] / t, -1)[tokens[i]].item() for i, t in enumerate([2.0, 0.5, 1.0])]
    assert lps.tolist() == pytest.approx(want)


def test_uniforms_are_a_function_of_seed_and_counter():
    a = uniforms([1, 2, 1], [0, 0, 1])
    assert a.tolist() == uniforms([1, 2, 1], [0, 0, 1]).tolist()
    assert len(set(a.tolist())) == 3 and all(0 <= x < 1 for x in a)
    u = uniforms(list(range(20000)), [0] * 20000)
    assert abs(u.mean() - 0.5) < 0.01 and abs((u < 0.1).mean() - 0.1) < 0.01
    # Pinned values: the same seeds must keep giving the same tokens across versions (seeds wrap to 64 bits).
    assert uniforms([0, 123, 2**63 + 5], [0, 5, 7]).tolist() == [0.9458807832621713, 0.2192006990429517,
                                                                  0.3374364481368878]
