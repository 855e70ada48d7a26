"""The training step on a real tiny Qwen2 model: log-probs, direction of updates, gradient accumulation, NaN
skipping and weight export (single process; checkpoints are in test_learner_checkpoint.py, the 2-rank FSDP2 run in
test_learner_fsdp.py)."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.algo.losses import LossConfig
from treepo_ray.learner import Learner, LearnerConfig, TrainSample
from treepo_ray.learner.strategy import Strategy
from learner_testlib import params, samples as _samples

pytestmark = pytest.mark.slow


def test_one_process_trains_the_plain_model_whatever_the_strategy(tiny):
    for strategy in ("fsdp2", "deepspeed", "none"):
        learner = Learner(tiny, LearnerConfig(strategy=strategy))
        assert type(learner.strategy) is Strategy and learner.optimizer is learner.strategy.optimizer
        assert type(learner.optimizer) is torch.optim.AdamW and learner.strategy.train_module is learner.model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_logprobs_matches_manual_log_softmax(tiny, temperature):
    learner = Learner(tiny, LearnerConfig(micro_batch_size=2, temperature=temperature))
    got = learner.compute_logprobs(_samples())
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    for s, lp in zip(_samples(), got):
        ids = torch.tensor([s.prompt_ids + s.response_ids])  # one unpadded sequence at a time
        with torch.no_grad():
            log_p = (hf(input_ids=ids).logits[0] / temperature).log_softmax(-1)
        p = len(s.prompt_ids)
        want = [log_p[p - 1 + j, tok].item() for j, tok in enumerate(s.response_ids)]
        assert lp == pytest.approx(want, abs=1e-5)


def test_positive_advantage_raises_and_negative_lowers_logprob(tiny):
    learner = Learner(tiny, LearnerConfig(lr=1e-3, micro_batch_size=2))
    up = TrainSample([5, 6, 7], [8, 9, 10, 11], advantages=1.0)
    down = TrainSample([40, 41], [50, 51, 52], advantages=-1.0)
    before = [sum(lp) for lp in learner.compute_logprobs([up, down])]
    metrics = learner.train_step([up, down])
    after = [sum(lp) for lp in learner.compute_logprobs([up, down])]
    assert after[0] > before[0] + 0.05
    assert after[1] < before[1] - 0.05
    assert metrics["skipped"] == 0 and metrics["steps"] == 1 and learner.version == 1
    assert metrics["tokens"] == 7 and metrics["lr"] == 1e-3
    # On-policy first step (old log-probs recomputed): ratio 1, so pg_loss = -(token-mean advantage) = -(4 - 3) / 7.
    assert metrics["pg_loss"] == pytest.approx(-1 / 7, abs=1e-6)
    assert metrics["clip_frac"] == 0 and metrics["approx_kl"] == pytest.approx(0, abs=1e-9)
    assert metrics["entropy"] > 0 and metrics["grad_norm"] > 0


def _grads(model_path, aggregation, micro_batch_size, gradient_checkpointing=False):
    cfg = LearnerConfig(micro_batch_size=micro_batch_size, gradient_checkpointing=gradient_checkpointing,
                        loss=LossConfig(aggregation=aggregation, entropy_coef=0.01))
    learner = Learner(model_path, cfg)
    samples = _samples()
    old = learner.compute_logprobs(samples)
    # Off-policy old log-probs (shifted), so that ratios differ from 1 and clipping is in play.
    samples = [dataclasses.replace(s, old_logprobs=[x + 0.3 * (-1) ** j for j, x in enumerate(lp)])
               for s, lp in zip(samples, old)]
    figures = learner.backward(samples)
    return {k: p.grad.clone() for k, p in learner.model.named_parameters()}, figures


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
def test_micro_batching_gives_the_one_batch_gradient(tiny, aggregation):
    whole, f_whole = _grads(tiny, aggregation, micro_batch_size=8)
    micro, f_micro = _grads(tiny, aggregation, micro_batch_size=2)
    for k in whole:
        torch.testing.assert_close(micro[k], whole[k], atol=1e-6, rtol=1e-5)
    assert f_micro["loss"] == pytest.approx(f_whole["loss"], abs=1e-6)
    assert f_micro["clip_frac"] == pytest.approx(f_whole["clip_frac"], abs=1e-6)
    assert f_whole["clip_frac"] > 0


def test_aggregations_differ_and_checkpointing_changes_nothing(tiny):
    token, _ = _grads(tiny, "token-mean", micro_batch_size=8)
    seq, _ = _grads(tiny, "seq-mean", micro_batch_size=8)
    assert not torch.allclose(token["model.embed_tokens.weight"], seq["model.embed_tokens.weight"], atol=1e-4)
    ckpt, _ = _grads(tiny, "token-mean", micro_batch_size=2, gradient_checkpointing=True)
    for k in token:
        torch.testing.assert_close(ckpt[k], token[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad", ["advantage", "old_logprobs"])
def test_non_finite_step_is_skipped(tiny, bad):
    learner = Learner(tiny, LearnerConfig(lr=1e-3))
    samples = _samples()
    if bad == "advantage":
        samples[1] = dataclasses.replace(samples[1], advantages=float("nan"))
    else:
        samples[2] = dataclasses.replace(samples[2], old_logprobs=[float("-inf")])
    before = params(learner)
    metrics = learner.train_step(samples)
    assert metrics["skipped"] == 1 and metrics["steps"] == 0 and learner.version == 0
    for k, v in params(learner).items():
        assert torch.equal(v, before[k]), k
    assert not learner.optimizer.state  # AdamW never stepped
    # The next, clean step trains normally.
    assert learner.train_step(_samples())["skipped"] == 0 and learner.version == 1


def test_mini_batches_and_epochs_each_take_a_step(tiny):
    learner = Learner(tiny, LearnerConfig(lr=1e-4, mini_batches=2, ppo_epochs=2, micro_batch_size=2))
    metrics = learner.train_step(_samples())
    assert metrics["steps"] == 4 and learner.version == 4
    # Later mini-batches are off-policy by then: the ratio moved away from 1.
    assert metrics["approx_kl"] > 0


def test_kl_to_reference_model(tiny):
    learner = Learner(tiny, LearnerConfig(lr=1e-3, loss=LossConfig(kl_coef=0.1)))
    assert learner.ref_model is not None
    first = learner.train_step(_samples())
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # policy still equals the reference
    second = learner.train_step(_samples())
    assert second["kl"] > 0
    assert second["loss"] == pytest.approx(second["pg_loss"] + 0.1 * second["kl"], abs=1e-6)


def test_export_weights_load_strictly_into_fresh_model(tiny):
    learner = Learner(tiny, LearnerConfig(lr=1e-3))
    learner.train_step(_samples())
    weights = learner.export_weights()
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in weights.values())
    fresh = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    fresh.load_state_dict(weights, strict=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, learner.model(input_ids=ids).logits)
    snapshot = {k: v.clone() for k, v in weights.items()}
    learner.train_step(_samples())  # the exported dict is a copy: training on leaves it alone
    assert all(torch.equal(weights[k], snapshot[k]) for k in weights)


def test_bad_input_is_named(tiny):
    learner = Learner(tiny, LearnerConfig())
    with pytest.raises(ValueError, match=r"samples\[1\]\.response_ids\[0\] = 100000 is outside the vocabulary"):
        learner.train_step([_samples()[0], TrainSample([1], [100000], 1.0)])
    with pytest.raises(ValueError, match="old_logprobs is None"):
        learner.backward(_samples())
