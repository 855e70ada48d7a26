"""The hf engine's sampler alone: inverse-CDF sampling under temperature / top-k / top-p, and seeded uniforms."""

from __future__ import annotations

import pytest
import torch

from treepo_ray.engines.hf.sampler import _SMALL, kind_of, sample, uniforms


def test_sample_inverse_cdf_with_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 6))
    temp = torch.ones(6)
    u = torch.tensor([0.1, 0.6, 0.9, 0.7, 0.9, 0.99])
    tokens, lps, _ = sample(logits, temp, torch.zeros(6, dtype=torch.long), torch.ones(6), u)
    assert tokens.tolist() == [0, 1, 2, 1, 2, 2]  # cdf 0.5, 0.8, 1.0
    assert lps.tolist() == pytest.approx(torch.log(torch.tensor([0.5, 0.3, 0.2, 0.3, 0.2, 0.2])).tolist())
    # top-k 2: [0.625, 0.375]; top-p 0.6 keeps tokens whose preceding mass is < 0.6: the same two.
    for k, p in ((2, 1.0), (0, 0.6)):
        tokens, _, _ = sample(logits, temp, torch.full((6,), k), torch.full((6,), p), u)
        assert tokens.tolist() == [0, 0, 1, 1, 1, 1]
    # top-p 0.5: only the first token (the mass before the second one is 0.5, not < 0.5); temperature 0: argmax.
    tokens, _, _ = sample(logits, temp, torch.zeros(6, dtype=torch.long), torch.full((6,), 0.5), u)
    assert tokens.tolist() == [0] * 6
    tokens, lps, _ = sample(logits, torch.zeros(6), torch.zeros(6, dtype=torch.long), torch.ones(6), u)
    assert tokens.tolist() == [0] * 6 and lps.tolist() == pytest.approx([torch.log(torch.tensor(0.5)).item()] * 6)


def test_logprobs_are_at_each_rows_sampling_temperature():
    """What the learner computes at learner.temperature (its behaviour log-probs): log softmax(logits / T), before
    top-k/top-p; greedy rows (T = 0) report temperature 1."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]] * 3))
    temp = torch.tensor([2.0, 0.5, 0.0])
    u = torch.tensor([0.1, 0.1, 0.1])
    tokens, lps, _ = sample(logits, temp, torch.full((3,), 2), torch.ones(3), u)
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


def test_fast_paths_draw_exactly_what_the_general_path_draws():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=gen) * 3
    u = torch.rand(64, generator=gen)
    none_k, no_p = torch.zeros(64, dtype=torch.long), torch.ones(64)
    for kind, temp in (("unit", torch.ones(64)), ("plain", torch.rand(64, generator=gen) + 0.3),
                       ("greedy", torch.zeros(64))):
        general = sample(logits, temp, none_k, no_p, u)
        fast = sample(logits, temp if kind == "plain" else None, None, None, u, kind)
        assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
    assert (kind_of(0.0, 5, 0.5), kind_of(1.0, 0, 1.0), kind_of(0.7, 0, 1.0), kind_of(1.0, 0, 0.9)) == (
        "greedy", "unit", "plain", "mixed")


def test_uniforms_small_batches_take_python_ints_to_the_same_bits():
    seeds = [0, 1, 2**63 + 5, -3, 123456789] * 10
    counters = list(range(len(seeds)))
    whole = uniforms(seeds, counters)  # 50 draws: the numpy path
    assert len(whole) > _SMALL
    for i in range(0, len(seeds), 7):  # 7 draws at a time: the Python path
        assert uniforms(seeds[i : i + 7], counters[i : i + 7]).tolist() == whole[i : i + 7].tolist()


def test_entropy_is_that_of_the_distribution_at_the_rows_temperature():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 40, generator=gen) * 2
    logits[0, 3:] = float("-inf")  # a row with tokens of probability 0 (entr(0) = 0, not NaN)
    temp = torch.tensor([1.0, 0.5, 2.0, 0.0, 1.0])
    u = torch.rand(5, generator=gen)
    _, _, ent = sample(logits, temp, torch.zeros(5, dtype=torch.long), torch.ones(5), u, entropy=True)
    t = torch.where(temp > 0, temp, torch.ones(5))  # greedy rows: temperature 1, like their log-probs
    p = torch.softmax(logits / t[:, None], dim=-1)
    want = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
    assert torch.allclose(ent, want, atol=1e-5)
    assert sample(logits, temp, torch.zeros(5, dtype=torch.long), torch.ones(5), u)[2] is None
