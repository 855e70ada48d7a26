"""The strategy choice and the one-process strategy's step, on a plain torch module (no model, no process group;
FSDP2 and DeepSpeed are driven end to end by test_learner_fsdp.py and test_learner_deepspeed.py)."""

import math

import pytest
import torch

from treepo_ray.learner import LearnerConfig
from treepo_ray.learner.strategy import Strategy, make_strategy


def test_one_process_is_the_plain_strategy_whatever_the_config_says():
    for name in ("fsdp2", "deepspeed", "none"):
        strategy = make_strategy(LearnerConfig(strategy=name))
        assert type(strategy) is Strategy and (strategy.rank, strategy.world_size) == (0, 1)
        assert strategy.all_reduce([1.0, 2.0]) == [1.0, 2.0] and strategy.first_error("boom") == "boom"


def test_bad_ranks_and_strategies_are_refused(monkeypatch):
    with pytest.raises(ValueError, match=r"rank = 2 must lie in \[0, world_size = 2\)"):
        make_strategy(LearnerConfig(), rank=2, world_size=2)
    with pytest.raises(ValueError, match="strategy = 'none' cannot train with world_size = 2"):
        make_strategy(LearnerConfig(strategy="none"), rank=0, world_size=2)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="needs master_port"):
        make_strategy(LearnerConfig(), rank=0, world_size=2)


def _wrapped(grad_clip: float, optimizer=torch.optim.AdamW) -> tuple[Strategy, torch.nn.Linear]:
    strategy = make_strategy(LearnerConfig(grad_clip=grad_clip))
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    strategy.wrap(layer, optimizer(layer.parameters(), lr=1.0))
    return strategy, layer


def test_step_reports_the_unclipped_norm_clips_and_steps():
    strategy, layer = _wrapped(grad_clip=0.5, optimizer=torch.optim.SGD)  # plain SGD, lr 1: the step is -grad
    assert strategy.grad_norm() == 0.0  # no gradient yet
    before = [p.detach().clone() for p in layer.parameters()]
    (layer(torch.ones(1, 3)).sum() * 10).backward()
    want = math.sqrt(sum(float((p.grad ** 2).sum()) for p in layer.parameters()))
    assert strategy.grad_norm() == pytest.approx(want) and want > 0.5
    norm, ok = strategy.step(loss=1.0)
    assert ok and norm == pytest.approx(want)
    assert all(p.grad is None for p in layer.parameters())
    moved = math.sqrt(sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(layer.parameters(), before)))
    assert moved == pytest.approx(0.5, rel=1e-5)  # the gradient was clipped to norm 0.5 before the step


def test_step_with_a_non_finite_loss_or_gradient_is_skipped():
    for loss, scale in ((float("nan"), 1.0), (1.0, float("inf"))):
        strategy, layer = _wrapped(grad_clip=1.0)
        before = [p.detach().clone() for p in layer.parameters()]
        (layer(torch.ones(1, 3)).sum() * scale).backward()
        _, ok = strategy.step(loss)
        assert not ok and not strategy.optimizer.state  # AdamW never stepped
        assert all(torch.equal(p, b) for p, b in zip(layer.parameters(), before))
        assert all(p.grad is None for p in layer.parameters())


def test_autocast_only_below_float32_and_export_copies_to_float32_cpu():
    assert not torch.is_autocast_enabled("cpu")
    with make_strategy(LearnerConfig(dtype="float32")).autocast():
        assert not torch.is_autocast_enabled("cpu")
    with make_strategy(LearnerConfig(dtype="bfloat16")).autocast():
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    strategy, layer = _wrapped(grad_clip=1.0)
    weights = strategy.export_weights()
    assert weights.keys() == {"weight", "bias"} and all(w.dtype == torch.float32 for w in weights.values())
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert not torch.equal(weights["weight"], layer.weight)  # a copy, not a view
