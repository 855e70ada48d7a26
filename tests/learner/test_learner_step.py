"""The training step on a real tiny Qwen2 model: log-probs, direction of updates, gradient accumulation, NaN
skipping, weight export and checkpoints (single process; the 2-rank FSDP2 run is in test_learner_fsdp.py)."""

import dataclasses
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.algo.losses import LossConfig
from treepo_ray.engines.tiny import build_tiny_model
from treepo_ray.learner import Learner, LearnerConfig, TrainSample, latest_checkpoint


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _samples():
    # Varied lengths so that padding and per-sample response offsets matter.
    return [
        TrainSample([5, 6, 7], [8, 9, 10, 11], advantages=1.0),
        TrainSample([12], [13, 14], advantages=-1.0, weight=0.5),
        TrainSample([20, 21, 22, 23, 24], [25], advantages=0.5),
        TrainSample([30, 31], [32, 33, 34, 35, 36, 37], advantages=[1.0, -1.0, 0.5, 0.0, 2.0, -0.5]),
        TrainSample([40, 41, 42], [43, 44, 45], advantages=-0.75, weight=2.0),
    ]


def _params(learner):
    return {k: v.detach().clone() for k, v in learner.model.named_parameters()}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compute_logprobs_matches_manual_log_softmax(model_path, temperature):
    learner = Learner(model_path, LearnerConfig(micro_batch_size=2, temperature=temperature))
    got = learner.compute_logprobs(_samples())
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    for s, lp in zip(_samples(), got):
        ids = torch.tensor([s.prompt_ids + s.response_ids])  # one unpadded sequence at a time
        with torch.no_grad():
            log_p = (hf(input_ids=ids).logits[0] / temperature).log_softmax(-1)
        p = len(s.prompt_ids)
        want = [log_p[p - 1 + j, tok].item() for j, tok in enumerate(s.response_ids)]
        assert lp == pytest.approx(want, abs=1e-5)


def test_positive_advantage_raises_and_negative_lowers_logprob(model_path):
    learner = Learner(model_path, LearnerConfig(lr=1e-3, micro_batch_size=2))
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
def test_micro_batching_gives_the_one_batch_gradient(model_path, aggregation):
    whole, f_whole = _grads(model_path, aggregation, micro_batch_size=8)
    micro, f_micro = _grads(model_path, aggregation, micro_batch_size=2)
    for k in whole:
        torch.testing.assert_close(micro[k], whole[k], atol=1e-6, rtol=1e-5)
    assert f_micro["loss"] == pytest.approx(f_whole["loss"], abs=1e-6)
    assert f_micro["clip_frac"] == pytest.approx(f_whole["clip_frac"], abs=1e-6)
    assert f_whole["clip_frac"] > 0


def test_aggregations_differ_and_checkpointing_changes_nothing(model_path):
    token, _ = _grads(model_path, "token-mean", micro_batch_size=8)
    seq, _ = _grads(model_path, "seq-mean", micro_batch_size=8)
    assert not torch.allclose(token["model.embed_tokens.weight"], seq["model.embed_tokens.weight"], atol=1e-4)
    ckpt, _ = _grads(model_path, "token-mean", micro_batch_size=2, gradient_checkpointing=True)
    for k in token:
        torch.testing.assert_close(ckpt[k], token[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("bad", ["advantage", "old_logprobs"])
def test_non_finite_step_is_skipped(model_path, bad):
    learner = Learner(model_path, LearnerConfig(lr=1e-3))
    samples = _samples()
    if bad == "advantage":
        samples[1] = dataclasses.replace(samples[1], advantages=float("nan"))
    else:
        samples[2] = dataclasses.replace(samples[2], old_logprobs=[float("-inf")])
    before = _params(learner)
    metrics = learner.train_step(samples)
    assert metrics["skipped"] == 1 and metrics["steps"] == 0 and learner.version == 0
    for k, v in _params(learner).items():
        assert torch.equal(v, before[k]), k
    assert not learner.optimizer.state  # AdamW never stepped
    # The next, clean step trains normally.
    assert learner.train_step(_samples())["skipped"] == 0 and learner.version == 1


def test_mini_batches_and_epochs_each_take_a_step(model_path):
    learner = Learner(model_path, LearnerConfig(lr=1e-4, mini_batches=2, ppo_epochs=2, micro_batch_size=2))
    metrics = learner.train_step(_samples())
    assert metrics["steps"] == 4 and learner.version == 4
    # Later mini-batches are off-policy by then: the ratio moved away from 1.
    assert metrics["approx_kl"] > 0


def test_kl_to_reference_model(model_path):
    learner = Learner(model_path, LearnerConfig(lr=1e-3, loss=LossConfig(kl_coef=0.1)))
    assert learner.ref_model is not None
    first = learner.train_step(_samples())
    assert first["kl"] == pytest.approx(0.0, abs=1e-9)  # policy still equals the reference
    second = learner.train_step(_samples())
    assert second["kl"] > 0
    assert second["loss"] == pytest.approx(second["pg_loss"] + 0.1 * second["kl"], abs=1e-6)


def test_export_weights_load_strictly_into_fresh_model(model_path):
    learner = Learner(model_path, LearnerConfig(lr=1e-3))
    learner.train_step(_samples())
    weights = learner.export_weights()
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in weights.values())
    fresh = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    fresh.load_state_dict(weights, strict=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids).logits, learner.model(input_ids=ids).logits)
    snapshot = {k: v.clone() for k, v in weights.items()}
    learner.train_step(_samples())  # the exported dict is a copy: training on leaves it alone
    assert all(torch.equal(weights[k], snapshot[k]) for k in weights)


def test_checkpoint_round_trip_resumes_identically(model_path, tmp_path):
    cfg = LearnerConfig(lr=1e-3, weight_decay=0.01, micro_batch_size=2)
    a = Learner(model_path, cfg)
    a.train_step(_samples())
    path = a.save_checkpoint(tmp_path / "checkpoint-00000001", {"step": 1, "dataset_pos": 40})
    draw_a = torch.rand(3)
    metrics_a = a.train_step(_samples())

    b = Learner(model_path, cfg)
    assert b.load_checkpoint(latest_checkpoint(tmp_path)) == {"step": 1, "dataset_pos": 40}
    assert b.version == 1
    assert torch.equal(torch.rand(3), draw_a)  # torch RNG restored
    metrics_b = b.train_step(_samples())
    assert metrics_b["loss"] == metrics_a["loss"] and metrics_b["grad_norm"] == metrics_a["grad_norm"]
    for k, v in _params(b).items():
        torch.testing.assert_close(v, dict(a.model.named_parameters())[k].detach(), atol=0, rtol=0)
    # The folder is a Hugging Face model directory (weights + tokenizer) a generator can load by path.
    assert json.loads((path / "learner_state.json").read_text())["version"] == 1
    assert (path / "tokenizer.json").is_file()
    AutoModelForCausalLM.from_pretrained(path)


def test_failed_save_keeps_previous_checkpoint(model_path, tmp_path):
    learner = Learner(model_path, LearnerConfig(lr=1e-3))
    final = tmp_path / "checkpoint-00000005"
    learner.save_checkpoint(final, {"step": 5})
    learner.train_step(_samples())
    # Simulate a write failure: the temporary folder's name is taken by a file.
    (tmp_path / ".checkpoint-00000005.tmp").write_text("in the way")
    with pytest.raises(RuntimeError, match="could not write checkpoint .*previous checkpoint is untouched"):
        learner.save_checkpoint(final, {"step": 6})
    assert json.loads((final / "trainer_state.json").read_text()) == {"step": 5}
    assert Learner(model_path, LearnerConfig(lr=1e-3)).load_checkpoint(final) == {"step": 5}
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        learner.save_checkpoint(final, {"step": object()})
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        learner.load_checkpoint(tmp_path)


def test_bad_input_is_named(model_path):
    learner = Learner(model_path, LearnerConfig())
    with pytest.raises(ValueError, match=r"samples\[1\]\.response_ids\[0\] = 100000 is outside the vocabulary"):
        learner.train_step([_samples()[0], TrainSample([1], [100000], 1.0)])
    with pytest.raises(ValueError, match="old_logprobs is None"):
        learner.backward(_samples())
