"""The policy loss that trains (algo/losses.py: tree_policy_loss): clipped surrogate, dual-clip, aggregation, KL
estimators, entropy, gradients and figures, by hand on padded [B, T] batches (`padded_loss` gives each response token
the weights learner/packing.py gives a trajectory of its own), and against the per-sequence PPO formula."""

import math

import pytest
import torch

from treepo_ray.algo import LossConfig, kl_penalty, tree_policy_loss

LOG2 = math.log(2.0)
TOKEN_MEANS = ("pg_clipfrac", "pg_clipfrac_below", "pg_clipfrac_above", "pg_clipfrac_lower", "ppo_kl")


def padded_loss(logp, old, adv, mask, cfg: LossConfig, ref_logprobs=None, entropy=None):
    """tree_policy_loss over the response tokens of a padded batch ([B, T]; advantages [B] or [B, T]), each row a
    trajectory of its own, with the token-mean or seq-mean normaliser c of each token; the loss and its figures
    (token means divided out, as the learner reports them)."""
    B, T = logp.shape
    adv = adv[:, None].expand(B, T) if adv.dim() == 1 else adv
    mask = mask.to(logp.dtype)
    tokens = mask.sum(-1, keepdim=True).clamp(min=1.0)
    rows = (mask.sum(-1) > 0).sum().clamp(min=1)
    c = (torch.ones(B, T) / mask.sum().clamp(min=1.0) if cfg.aggregation == "token-mean"
         else (1.0 / (tokens * rows)).expand(B, T)).to(logp.dtype)
    keep = mask.bool()
    w = torch.stack([torch.where(adv > 0, c * adv, 0.0), torch.where(adv < 0, c * adv, 0.0), c,
                     torch.ones(B, T, dtype=logp.dtype), (adv > 0).to(logp.dtype), (adv < 0).to(logp.dtype)],
                    dim=-1)[keep]
    pick = lambda x: None if x is None else x[keep]  # noqa: E731
    loss, sums = tree_policy_loss(logp[keep], old[keep], w, cfg, ref_logprobs=pick(ref_logprobs), entropy=pick(entropy))
    n = max(float(sums["count"]), 1.0)
    figures = {k: float(v) / n if k in TOKEN_MEANS else float(v) for k, v in sums.items() if k != "count"}
    return loss, figures


def one_token(ratio: float, adv: float, cfg: LossConfig):
    """Loss, metrics and d loss / d logprob for a single response token with the given ratio and advantage."""
    logp = torch.tensor([[math.log(ratio)]], requires_grad=True)
    loss, m = padded_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), cfg)
    loss.backward()
    return loss.item(), m, logp.grad.item()


@pytest.mark.parametrize(
    "ratio, adv, loss, grad, side",
    [
        (1.1, 1.0, -1.1, -1.1, None),  # inside the range: -A * ratio, d/dlogp = -A * ratio
        (0.9, -1.0, 0.9, 0.9, None),
        (1.25, 1.0, -1.25, -1.25, None),  # inside thanks to clip-higher (1 + 0.28)
        (1.5, 1.0, -1.28, 0.0, "high"),  # A > 0 above 1 + clip_high: clipped, no gradient
        (1.5, -1.0, 1.5, 1.5, None),  # A < 0 above the range: the unclipped term is larger, kept
        (0.5, -1.0, 0.8, 0.0, "low"),  # A < 0 below 1 - clip_low: clipped
        (0.5, 1.0, -0.5, -0.5, None),  # A > 0 below the range: unclipped, kept
        (0.5, -2.0, 1.6, 0.0, "low"),
    ],
)
def test_clipped_surrogate_by_hand(ratio, adv, loss, grad, side):
    got, m, g = one_token(ratio, adv, LossConfig())
    assert got == pytest.approx(loss, rel=1e-6)
    assert g == pytest.approx(grad, rel=1e-5, abs=1e-7)
    assert m["pg_clipfrac_below"] == (side == "low")
    assert m["pg_clipfrac_above"] == (side == "high")
    assert m["pg_clipfrac"] == (side is not None)
    assert m["pg_loss"] == pytest.approx(loss, rel=1e-6) and m["loss"] == pytest.approx(loss, rel=1e-6)


def test_symmetric_clip_clips_where_clip_higher_does_not():
    assert one_token(1.25, 1.0, LossConfig(clip_high=0.2))[0] == pytest.approx(-1.2)


@pytest.mark.parametrize(
    "ratio, adv, loss, capped",
    [
        (5.0, -1.0, 3.0, True),  # c |A| = 3 caps -A * ratio = 5
        (5.0, -2.0, 6.0, True),
        (2.0, -1.0, 2.0, False),  # below the cap
        (5.0, 1.0, -1.28, False),  # positive advantages are untouched
    ],
)
def test_dual_clip_cap(ratio, adv, loss, capped):
    got, m, g = one_token(ratio, adv, LossConfig(dual_clip=3.0))
    assert got == pytest.approx(loss, rel=1e-6)
    assert m["pg_clipfrac_lower"] == capped
    if capped:
        assert g == 0.0
    # without dual-clip the negative-advantage loss grows with the ratio
    assert one_token(5.0, -1.0, LossConfig())[0] == pytest.approx(5.0, rel=1e-6)


def test_aggregation_on_unequal_lengths():
    # ratio 1 everywhere, so pg = -A per token; row 0 has 3 tokens with A = 1, row 1 one token with A = 3, row 2 none
    logp = torch.zeros(3, 3)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 3.0, 9.0])
    tok, _ = padded_loss(logp, logp, adv, mask, LossConfig(aggregation="token-mean"))
    seq, _ = padded_loss(logp, logp, adv, mask, LossConfig(aggregation="seq-mean"))
    assert tok.item() == pytest.approx(-(3 * 1 + 1 * 3) / 4)
    assert seq.item() == pytest.approx(-(1 + 3) / 2)  # the mean over the rows that have tokens
    # per-token advantages [B, T] give the same as broadcasting [B]
    tok2, _ = padded_loss(logp, logp, adv[:, None].expand(3, 3), mask, LossConfig())
    assert tok2.item() == pytest.approx(tok.item())


def test_kl_estimators_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5]))
    # log r = ref - logp = [-log 2, log 2]
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor([LOG2, -LOG2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.5 * LOG2**2, 0.5 * LOG2**2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor([0.5 - 1 + LOG2, 2 - 1 - LOG2]))
    assert torch.all(kl_penalty(logp, logp, "k3") == 0)
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(logp, ref, "k4")


def test_kl_and_entropy_terms_enter_the_loss():
    logp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    ent = torch.tensor([[1.0, 3.0]], requires_grad=True)
    mask = torch.ones(1, 2)
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, m = padded_loss(logp, logp.detach(), torch.tensor([0.0]), mask, cfg, ref_logprobs=ref, entropy=ent)
    assert m["kl_loss"] == pytest.approx(0.0, abs=1e-7)  # k1: (log 2 - log 2) / 2
    assert m["entropy"] == pytest.approx(2.0)
    assert m["loss"] == pytest.approx(m["pg_loss"] + 0.1 * m["kl_loss"] - 0.01 * m["entropy"])
    loss.backward()
    # d/dlogp of 0.1 * mean(logp - ref) = 0.05 per token; the entropy bonus lowers the loss as entropy grows
    torch.testing.assert_close(logp.grad, torch.tensor([[0.05, 0.05]]))
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.005, -0.005]]))
    # a reference without kl_coef is still reported, but not optimised
    _, m = padded_loss(logp, logp.detach(), torch.tensor([0.0]), mask, LossConfig(), ref_logprobs=ref)
    assert m["kl_loss"] == pytest.approx((0.5 - 1 + LOG2 + 2 - 1 - LOG2) / 2)
    assert m["loss"] == pytest.approx(0.0, abs=1e-7)


def test_ppo_kl_old_vs_new_as_verl():
    old = torch.zeros(1, 2)
    new = torch.tensor([[LOG2, 0.0]])  # ratios 2 and 1
    _, m = padded_loss(new, old, torch.tensor([1.0]), torch.tensor([[1.0, 1.0]]), LossConfig(clip_high=2.0))
    assert m["ppo_kl"] == pytest.approx((0 - LOG2 + 0) / 2, rel=1e-6)  # verl: mean of old - new log-probs
    _, m = padded_loss(old, old, torch.tensor([1.0]), torch.ones(1, 2), LossConfig())
    assert m["ppo_kl"] == 0.0 and m["pg_clipfrac"] == 0.0


def test_gradient_direction_and_step():
    torch.manual_seed(0)
    old = -torch.rand(2, 5)
    logp = (old + 0.05 * torch.randn(2, 5)).requires_grad_()
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])
    adv = torch.tensor([1.0, -1.0])
    loss, _ = padded_loss(logp, old, adv, mask, LossConfig())
    loss.backward()
    assert torch.all(logp.grad[0] < 0)  # raising a positive-advantage token's log-prob lowers the loss
    assert torch.all(logp.grad[1, :3] > 0)
    assert torch.all(logp.grad[1, 3:] == 0)  # padding gets no gradient
    with torch.no_grad():
        stepped = logp.clone()
        stepped[0, 2] += 0.01  # raise one positive-advantage token
        assert padded_loss(stepped, old, adv, mask, LossConfig())[0] < loss
        stepped = logp - 0.01 * logp.grad
        assert padded_loss(stepped, old, adv, mask, LossConfig())[0] < loss


def test_clip_fractions_add_up():
    torch.manual_seed(1)
    old = -torch.rand(8, 16)
    logp = old + 0.5 * torch.randn(8, 16)
    adv = torch.randn(8, 16)
    mask = (torch.rand(8, 16) > 0.3).float()
    _, m = padded_loss(logp, old, adv, mask, LossConfig())
    assert 0 < m["pg_clipfrac_below"] and 0 < m["pg_clipfrac_above"]
    assert m["pg_clipfrac"] == pytest.approx(m["pg_clipfrac_below"] + m["pg_clipfrac_above"])
    assert set(m) >= {"pg_loss", "pg_clipfrac", "pg_clipfrac_below", "pg_clipfrac_above", "ppo_kl", "kl_loss",
                      "entropy", "loss"}
    assert all(isinstance(v, float) for v in m.values())


def test_bad_input_and_config():
    x, w = torch.zeros(3), torch.zeros(3, 6)
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        tree_policy_loss(x, torch.zeros(4), w, LossConfig())
    with pytest.raises(ValueError, match=r"weights \[N, 6\]"):
        tree_policy_loss(x, x, torch.zeros(3, 5), LossConfig())
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        tree_policy_loss(x, x, w, LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        tree_policy_loss(x, x, w, LossConfig(entropy_coef=0.01))
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=1.0)
    with pytest.raises(ValueError, match="aggregation"):
        LossConfig(aggregation="sum")
    with pytest.raises(ValueError, match="kl_estimator"):
        LossConfig(kl_estimator="k5")
    with pytest.raises(ValueError, match="clip_low"):
        LossConfig(clip_low=1.0)


def per_sequence_reference(logp, old, adv, mask, cfg: LossConfig, ref, ent):
    """PPO's objective written out per sequence (the paper formulas, module docstring of algo/losses.py): the
    independent check of the weighted-sum form."""
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
    pg = torch.where((adv < 0) & (pg > -adv * cfg.dual_clip), -adv * cfg.dual_clip, pg)
    kl = kl_penalty(logp, ref, cfg.kl_estimator)

    def agg(x):
        if cfg.aggregation == "token-mean":
            return (x * mask).sum() / mask.sum()
        return ((x * mask).sum(-1) / mask.sum(-1)).mean()

    return agg(pg) + cfg.kl_coef * agg(kl) - cfg.entropy_coef * agg(ent)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
def test_tree_form_equals_the_per_sequence_definition(aggregation):
    """tree_policy_loss with per-token weights (pos/neg = c * A, weight = c) gives the per-sequence formula's value
    and gradient, for random ratios spanning both clip ranges and the dual clip."""
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)  # exact comparisons: float32 rounding would dominate the differences
    try:
        B, T = 4, 6
        mask = (torch.rand(B, T) > 0.3).double()
        mask[:, 0] = 1.0
        adv, old, ref, ent = torch.randn(B, T), -torch.rand(B, T) * 3, -torch.rand(B, T) * 3, torch.rand(B, T)
        logp = (old + torch.randn(B, T)).requires_grad_()
        cfg = LossConfig(aggregation=aggregation, dual_clip=1.5, kl_coef=0.1, entropy_coef=0.02)
        want = per_sequence_reference(logp, old, adv, mask, cfg, ref, ent)
        (g_want,) = torch.autograd.grad(want, logp)
        got, figs = padded_loss(logp, old, adv, mask, cfg, ref_logprobs=ref, entropy=ent)
        (g_got,) = torch.autograd.grad(got, logp)
    finally:
        torch.set_default_dtype(torch.float32)
    assert got.item() == pytest.approx(want.item(), rel=1e-12)
    torch.testing.assert_close(g_got, g_want, rtol=1e-12, atol=1e-14)
    assert figs["pg_clipfrac_below"] > 0 and figs["pg_clipfrac_above"] > 0 and figs["pg_clipfrac_lower"] > 0
