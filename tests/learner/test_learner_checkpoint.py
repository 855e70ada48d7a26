"""Checkpoints: the folders of a run (naming, newest, pruning; no model) and writing and reading one on a real
tiny model (a round trip resumes identically, a failed write leaves the previous checkpoint intact). Multi-rank
checkpoints are covered by test_learner_fsdp.py and test_learner_deepspeed.py."""

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.learner import (
    Learner,
    LearnerConfig,
    checkpoint_dir,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
)
from learner_testlib import params, samples


def _fake_checkpoint(run_dir, step, complete=True):
    path = checkpoint_dir(run_dir, step)
    path.mkdir(parents=True)
    if complete:
        (path / "trainer_state.json").write_text("{}")
    return path


def test_latest_and_prune(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    paths = [_fake_checkpoint(tmp_path, s) for s in (2, 10, 7)]
    incomplete = _fake_checkpoint(tmp_path, 11, complete=False)  # no marker: never counted
    stale = tmp_path / ".checkpoint-00000012.tmp"
    stale.mkdir()
    assert paths[1].name == "checkpoint-00000010"
    assert latest_checkpoint(tmp_path) == paths[1]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 7, 10]
    removed = prune_checkpoints(tmp_path, keep=2)
    assert set(removed) == {paths[0], stale}
    assert [s for s, _ in list_checkpoints(tmp_path)] == [7, 10]
    assert incomplete.exists() and not stale.exists()
    with pytest.raises(ValueError, match="keep"):
        prune_checkpoints(tmp_path, keep=0)


@pytest.mark.slow
def test_checkpoint_round_trip_resumes_identically(tiny, tmp_path):
    cfg = LearnerConfig(lr=1e-3, weight_decay=0.01, micro_batch_size=2)
    a = Learner(tiny, cfg)
    a.train_step(samples())
    path = a.save_checkpoint(tmp_path / "checkpoint-00000001", {"step": 1, "dataset_pos": 40})
    draw_a = torch.rand(3)
    metrics_a = a.train_step(samples())

    b = Learner(tiny, cfg)
    assert b.load_checkpoint(latest_checkpoint(tmp_path)) == {"step": 1, "dataset_pos": 40}
    assert b.version == 1
    assert torch.equal(torch.rand(3), draw_a)  # torch RNG restored
    metrics_b = b.train_step(samples())
    assert metrics_b["loss"] == metrics_a["loss"] and metrics_b["grad_norm"] == metrics_a["grad_norm"]
    for k, v in params(b).items():
        torch.testing.assert_close(v, dict(a.model.named_parameters())[k].detach(), atol=0, rtol=0)
    # The folder is a Hugging Face model directory (weights + tokenizer) a generator can load by path, beside the
    # full optimizer state, the learner state and one RNG file per rank.
    files = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "rng_rank0.pt"} <= files
    state = json.loads((path / "learner_state.json").read_text())
    assert {k: state[k] for k in ("version", "world_size", "optimizer_format")} == \
        {"version": 1, "world_size": 1, "optimizer_format": "full"}
    assert state["learner_config"]["weight_decay"] == 0.01
    AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.slow
def test_failed_save_keeps_previous_checkpoint(tiny, tmp_path):
    learner = Learner(tiny, LearnerConfig(lr=1e-3))
    final = tmp_path / "checkpoint-00000005"
    learner.save_checkpoint(final, {"step": 5})
    learner.train_step(samples())
    # Simulate a write failure: the temporary folder's name is taken by a file.
    (tmp_path / ".checkpoint-00000005.tmp").write_text("in the way")
    with pytest.raises(RuntimeError, match="could not write checkpoint .*previous checkpoint is untouched"):
        learner.save_checkpoint(final, {"step": 6})
    assert json.loads((final / "trainer_state.json").read_text()) == {"step": 5}
    assert Learner(tiny, LearnerConfig(lr=1e-3)).load_checkpoint(final) == {"step": 5}
    with pytest.raises(ValueError, match="not JSON-serialisable"):
        learner.save_checkpoint(final, {"step": object()})
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        learner.load_checkpoint(tmp_path)


@pytest.mark.slow
def test_load_refuses_optimizer_state_of_another_strategy(tiny, tmp_path):
    learner = Learner(tiny, LearnerConfig())
    learner.save_checkpoint(tmp_path / "full", {"step": 0})
    # Relabelled as DeepSpeed's per-rank partitions from two ranks: one process cannot resume from it.
    shutil.copytree(tmp_path / "full", tmp_path / "partitioned")
    state_file = tmp_path / "partitioned" / "learner_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps(state | {"optimizer_format": "deepspeed", "world_size": 2}))
    with pytest.raises(ValueError, match=r"holds 'deepspeed' optimizer state from world size 2; this learner "
                                         r"\(strategy 'fsdp2', world size 1\) needs 'full'$"):
        learner.load_checkpoint(tmp_path / "partitioned")
