"""The training step on a real tiny Qwen2 model: log-probs, direction of updates, gradient accumulation, packing,
the off-policy modes, NaN skipping and weight export (single process; checkpoints are in test_learner_checkpoint.py,
the 2-rank FSDP2 run in test_learner_fsdp.py)."""

import dataclasses
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.algo.losses import LossConfig
from treepo_ray.learner import Learner, LearnerConfig, TrainSample
from treepo_ray.learner.strategy import Strategy
from learner_testlib import params, random_train_trees, samples as _samples

pytestmark = pytest.mark.slow


def test_one_process_trains_the_plain_model_whatever_the_strategy(tiny):
    for strategy in ("fsdp2", "deepspeed", "none"):
        learner = Learner(tiny, LearnerConfig(strategy=strategy))
        assert type(learner.strategy) is Strategy and learner.optimizer is learner.strategy.optimizer
        assert type(learner.optimizer) is torch.optim.AdamW and learner.strategy.train_module is learner.model


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("packing", ["tree", "none"])
def test_compute_logprobs_matches_manual_log_softmax(tiny, temperature, packing):
    learner = Learner(tiny, LearnerConfig(micro_batch_size=2, micro_batch_tokens=12, temperature=temperature,
                                          packing=packing))
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
    assert metrics["skipped"] == 0 and metrics["steps"] == 1 and learner.optimizer_steps == 1
    assert metrics["tokens"] == 7 and metrics["unique_tokens"] == 12 and metrics["lr"] == 1e-3
    # One epoch of one mini-batch: no recompute pass; ratio 1, so pg_loss = -(token-mean advantage) = -(4 - 3) / 7.
    assert metrics["recomputed"] == 0
    assert metrics["pg_loss"] == pytest.approx(-1 / 7, abs=1e-6)
    assert metrics["pg_clipfrac"] == 0 and metrics["ppo_kl"] == pytest.approx(0, abs=1e-9)
    assert metrics["entropy"] > 0 and metrics["grad_norm"] > 0


def _grads(model_path, aggregation, micro_batch_size=8, gradient_checkpointing=False, packing="none",
           micro_batch_tokens=4096):
    cfg = LearnerConfig(micro_batch_size=micro_batch_size, gradient_checkpointing=gradient_checkpointing,
                        packing=packing, micro_batch_tokens=micro_batch_tokens, off_policy="behaviour",
                        loss=LossConfig(aggregation=aggregation, entropy_coef=0.01))
    learner = Learner(model_path, cfg)
    samples = _samples()
    old = learner.compute_logprobs(samples)
    # Off-policy behaviour log-probs (shifted), so that ratios differ from 1 and clipping is in play.
    samples = [dataclasses.replace(s, old_logprobs=[x + 0.3 * (-1) ** j for j, x in enumerate(lp)])
               for s, lp in zip(samples, old)]
    figures = learner.backward(samples)
    return {k: p.grad.clone() for k, p in learner.model.named_parameters()}, figures


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean"])
def test_micro_batching_and_packing_give_the_one_batch_gradient(tiny, aggregation):
    whole, f_whole = _grads(tiny, aggregation, micro_batch_size=8)
    for kwargs in (dict(micro_batch_size=2), dict(packing="tree", micro_batch_tokens=9)):
        micro, f_micro = _grads(tiny, aggregation, **kwargs)
        for k in whole:
            torch.testing.assert_close(micro[k], whole[k], atol=1e-6, rtol=1e-5)
        assert f_micro["loss"] == pytest.approx(f_whole["loss"], abs=1e-6)
        assert f_micro["pg_clipfrac"] == pytest.approx(f_whole["pg_clipfrac"], abs=1e-6)
    assert f_whole["pg_clipfrac"] > 0


def test_aggregations_differ_and_checkpointing_changes_nothing(tiny):
    token, _ = _grads(tiny, "token-mean")
    seq, _ = _grads(tiny, "seq-mean")
    assert not torch.allclose(token["model.embed_tokens.weight"], seq["model.embed_tokens.weight"], atol=1e-4)
    ckpt, _ = _grads(tiny, "token-mean", micro_batch_size=2, gradient_checkpointing=True)
    for k in token:
        torch.testing.assert_close(ckpt[k], token[k], atol=1e-6, rtol=1e-5)
    packed_ckpt, _ = _grads(tiny, "token-mean", gradient_checkpointing=True, packing="tree", micro_batch_tokens=9)
    for k in token:
        torch.testing.assert_close(packed_ckpt[k], token[k], atol=1e-6, rtol=1e-5)


def test_packed_and_unpacked_steps_train_alike(tiny):
    """A CATPO step (per-node loss, tree weights, KL and entropy) packed with subtree splitting, and unpacked."""
    trees = random_train_trees(np.random.default_rng(3), "catpo", n=3, vocab=200)
    weights = []
    for packing in ("tree", "none"):
        cfg = LearnerConfig(lr=1e-3, packing=packing, micro_batch_tokens=16, micro_batch_size=3,
                            loss=LossConfig(aggregation="node-mean", kl_coef=0.05, entropy_coef=0.01))
        learner = Learner(tiny, cfg)
        metrics = learner.train_step(trees)
        weights.append((params(learner), metrics))
    (packed, m_packed), (unpacked, m_unpacked) = weights
    for k in packed:
        torch.testing.assert_close(packed[k], unpacked[k], atol=1e-6, rtol=0)
    for key in ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm", "tokens", "unique_tokens"):
        assert m_packed[key] == pytest.approx(m_unpacked[key], rel=1e-5, abs=1e-7), key
    assert m_packed["forward_tokens"] < m_unpacked["forward_tokens"]


def _stale_batch(model_path):
    """Trees whose behaviour log-probs come from the base weights, and a learner one step ahead of them."""
    trees = random_train_trees(np.random.default_rng(5), "treepo", n=2, vocab=200)
    base = Learner(model_path, LearnerConfig())
    for tree, lps in zip(trees, base.compute_logprobs(trees)):
        tree.logprobs = [[float(x) for x in lp] for lp in lps]
    return trees


@pytest.mark.parametrize("cap_mode", ["mask", "truncate"])
def test_a_stale_batch_trains_differently_under_decoupled_than_under_recompute(tiny, cap_mode):
    trees = _stale_batch(tiny)
    results = {}
    for off_policy in ("recompute", "decoupled"):
        learner = Learner(tiny, LearnerConfig(lr=1e-2, off_policy=off_policy, behaviour_cap=1.05,
                                              behaviour_cap_mode=cap_mode))
        learner.train_step(trees)  # the learner moves one version ahead of the rollouts
        metrics = learner.train_step(trees)
        results[off_policy] = (params(learner), metrics)
    (w_re, m_re), (w_de, m_de) = results["recompute"], results["decoupled"]
    # Both see the gap (figures are logged whatever the mode), only decoupled corrects for it.
    for m in (m_re, m_de):
        assert m["rollout_kl"] > 0 and m["is_weight_max"] > 1.05 and 0 < m["is_weight_capped"] < 1
        assert m["is_weight_mean"] != pytest.approx(1.0, abs=1e-4)
    assert m_re["pg_loss"] != pytest.approx(m_de["pg_loss"], rel=1e-3)
    assert any(not torch.allclose(w_re[k], w_de[k], atol=1e-7) for k in w_re)


def test_decoupled_on_a_fresh_batch_is_recompute(tiny):
    trees = _stale_batch(tiny)  # behaviour log-probs are the learner's own: every weight is 1
    results = []
    for off_policy in ("recompute", "decoupled", "behaviour"):
        learner = Learner(tiny, LearnerConfig(lr=1e-3, off_policy=off_policy))
        metrics = learner.train_step(trees)
        assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and metrics["rollout_kl"] < 1e-8
        results.append(params(learner))
    for other in results[1:]:
        for k in results[0]:
            torch.testing.assert_close(other[k], results[0][k], atol=1e-6, rtol=0)


def test_recompute_pass_runs_only_when_the_step_cannot_give_old_logprobs(tiny):
    trees = _stale_batch(tiny)
    for kwargs, recomputed in ((dict(), 0), (dict(mini_batches=2), 1), (dict(off_policy="behaviour",
                                                                             mini_batches=2), 0)):
        metrics = Learner(tiny, LearnerConfig(lr=1e-4, **kwargs)).train_step(trees)
        assert metrics["recomputed"] == recomputed, kwargs


@pytest.mark.parametrize("bad", ["advantage", "old_logprobs"])
def test_non_finite_step_is_skipped(tiny, bad):
    learner = Learner(tiny, LearnerConfig(lr=1e-3, off_policy="behaviour"))
    samples = [dataclasses.replace(s, old_logprobs=s.old_logprobs or [-1.0] * len(s.response_ids))
               for s in _samples()]
    if bad == "advantage":
        samples[1] = dataclasses.replace(samples[1], advantages=float("nan"))
    else:
        samples[2] = dataclasses.replace(samples[2], old_logprobs=[float("-inf")])
    before = params(learner)
    metrics = learner.train_step(samples)
    assert metrics["skipped"] == 1 and metrics["steps"] == 0 and learner.optimizer_steps == 0
    for k, v in params(learner).items():
        assert torch.equal(v, before[k]), k
    assert not learner.optimizer.state  # AdamW never stepped
    # The next, clean step trains normally.
    clean = [dataclasses.replace(s, old_logprobs=[-1.0] * len(s.response_ids)) for s in _samples()]
    assert learner.train_step(clean)["skipped"] == 0 and learner.optimizer_steps == 1


def test_mini_batches_and_epochs_each_take_a_step(tiny):
    learner = Learner(tiny, LearnerConfig(lr=1e-4, mini_batches=2, ppo_epochs=2, micro_batch_size=2))
    metrics = learner.train_step(_samples())
    assert metrics["steps"] == 4 and learner.optimizer_steps == 4 and metrics["recomputed"] == 1
    # Later mini-batches are off-policy by then: the ratio moved away from 1.
    assert abs(metrics["ppo_kl"]) > 1e-6  # k1, mean of old - new: either sign


def test_kl_to_reference_model(tiny):
    learner = Learner(tiny, LearnerConfig(lr=1e-3, loss=LossConfig(kl_coef=0.1)))
    assert learner.ref_model is not None
    first = learner.train_step(_samples())
    assert first["kl_loss"] == pytest.approx(0.0, abs=1e-9)  # policy still equals the reference
    second = learner.train_step(_samples())
    assert second["kl_loss"] > 0
    assert second["loss"] == pytest.approx(second["pg_loss"] + 0.1 * second["kl_loss"], abs=1e-6)


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
    with pytest.raises(ValueError, match=r"batch\[1\]\.response_ids\[0\] = 100000 is outside the vocabulary"):
        learner.train_step([_samples()[0], TrainSample([1], [100000], 1.0)])
    with pytest.raises(ValueError, match=r"off_policy = 'behaviour' needs the behaviour log-probs, but batch\[0\]"):
        Learner(tiny, LearnerConfig(off_policy="behaviour")).train_step(_samples())
    with pytest.raises(ValueError, match="node-mean' needs per-node advantages"):
        Learner(tiny, LearnerConfig(loss=LossConfig(aggregation="node-mean"))).train_step(_samples())
    assert math.isfinite(learner.train_step(_samples())["loss"])
