"""Checkpoints: the folders of a run (naming, newest, pruning; no model) and writing and reading one on a real
tiny model (a round trip resumes identically, through a file path and through an object-store URI; a failed write,
or a process killed in the middle of one, leaves the previous checkpoint usable). Multi-rank checkpoints are
covered by test_learner_fsdp.py and test_learner_deepspeed.py."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

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
from treepo_ray.learner.checkpoint import COMPLETE_MARKER, LEGACY_MARKER, step_of, unreadable_reason
from learner_testlib import params, samples


def _fake_checkpoint(run_dir, step, complete=True, marker=COMPLETE_MARKER):
    """A checkpoint folder with the files a restore reads, by name (their contents are not read here)."""
    path = Path(checkpoint_dir(run_dir, step))
    path.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "optimizer.pt"):
        (path / name).write_bytes(b"")
    (path / "learner_state.json").write_text('{"world_size": 1, "optimizer_format": "full"}')
    if complete:
        (path / marker).write_text("{}")
    return path


def _hf_checkpoint(run_dir, name, complete=True):
    """A Hugging Face Trainer checkpoint: its own trainer_state.json, no learner_state.json."""
    path = Path(run_dir) / name
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"")
    if complete:
        (path / "trainer_state.json").write_text('{"global_step": 500}')
    return path


def test_latest_and_prune(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    paths = [_fake_checkpoint(tmp_path, s) for s in (2, 10, 7)]
    incomplete = _fake_checkpoint(tmp_path, 11, complete=False)  # no marker: never counted
    stale = tmp_path / ".checkpoint-00000012.tmp"
    stale.mkdir()
    assert paths[1].name == "checkpoint-00000010"
    assert latest_checkpoint(tmp_path) == str(paths[1])
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 7, 10]
    removed = prune_checkpoints(tmp_path, keep=2)
    # A folder without its marker is a write that was cut off (an object store's only trace of one): pruned too.
    assert set(removed) == {str(paths[0]), str(stale), str(incomplete)}
    assert [s for s, _ in list_checkpoints(tmp_path)] == [7, 10]
    assert not incomplete.exists() and not stale.exists()
    with pytest.raises(ValueError, match="keep"):
        prune_checkpoints(tmp_path, keep=0)


def test_other_tools_checkpoints_are_never_listed_resumed_or_pruned(tmp_path):
    """A run directory that also holds the Hugging Face Trainer's checkpoints (their marker is trainer_state.json,
    this project's marker before 12/2026): only this project's folders count, old ones included."""
    hf = [_hf_checkpoint(tmp_path, "checkpoint-500"), _hf_checkpoint(tmp_path, "checkpoint-900", complete=False),
          _hf_checkpoint(tmp_path, "checkpoint-00000700")]  # even under a name of this project's form
    old = _fake_checkpoint(tmp_path, 2, marker=LEGACY_MARKER)  # written before the marker was renamed
    new = _fake_checkpoint(tmp_path, 3)
    assert list_checkpoints(tmp_path) == [(2, str(old)), (3, str(new))]
    assert latest_checkpoint(tmp_path) == str(new)
    assert prune_checkpoints(tmp_path, keep=1) == [str(old)]
    assert all(p.is_dir() for p in hf) and (hf[0] / "trainer_state.json").is_file()
    prune_checkpoints(tmp_path, keep=1)  # and again: nothing of theirs is "unfinished" to this project
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-00000003", "checkpoint-00000700",
                                                          "checkpoint-500", "checkpoint-900"]


def test_a_checkpoint_that_cannot_be_read_falls_back_to_the_one_before(tmp_path, capsys):
    first, second, third = (_fake_checkpoint(tmp_path, s) for s in (1, 2, 3))
    (third / "model.safetensors").unlink()
    (second / COMPLETE_MARKER).write_text("{cut off")
    assert unreadable_reason(third) == "model.safetensors missing"
    assert unreadable_reason(second).startswith("JSONDecodeError")
    assert latest_checkpoint(tmp_path) == str(first)
    out = capsys.readouterr().out.splitlines()
    assert out == [f"checkpoint {third} cannot be read (model.safetensors missing): falling back to the one before it",
                   f"checkpoint {second} cannot be read ({unreadable_reason(second)}): falling back to the one "
                   "before it"]
    assert latest_checkpoint(tmp_path, before=1) is None and step_of(third) == 3
    (first / "learner_state.json").unlink()
    assert latest_checkpoint(tmp_path) is None


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
    assert b.optimizer_steps == 1
    assert torch.equal(torch.rand(3), draw_a)  # torch RNG restored
    metrics_b = b.train_step(samples())
    assert metrics_b["loss"] == metrics_a["loss"] and metrics_b["grad_norm"] == metrics_a["grad_norm"]
    for k, v in params(b).items():
        torch.testing.assert_close(v, dict(a.model.named_parameters())[k].detach(), atol=0, rtol=0)
    # The folder is a Hugging Face model directory (weights + tokenizer) a generator can load by path, beside the
    # full optimizer state, the learner state and one RNG file per rank.
    path = Path(path)
    files = {p.name for p in path.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "optimizer.pt", "rng_rank0.json"} <= files
    json.loads((path / "rng_rank0.json").read_text())  # RNG states as JSON: nothing in a checkpoint is pickled
    state = json.loads((path / "learner_state.json").read_text())
    assert {k: state[k] for k in ("optimizer_steps", "world_size", "optimizer_format")} == \
        {"optimizer_steps": 1, "world_size": 1, "optimizer_format": "full"}
    assert state["learner_config"]["weight_decay"] == 0.01
    AutoModelForCausalLM.from_pretrained(path)
    assert COMPLETE_MARKER in files and LEGACY_MARKER not in files
    # A checkpoint written before the marker was renamed (trainer_state.json beside learner_state.json) resumes.
    (path / COMPLETE_MARKER).rename(path / LEGACY_MARKER)
    assert latest_checkpoint(tmp_path) == str(path)
    assert Learner(tiny, cfg).load_checkpoint(path) == {"step": 1, "dataset_pos": 40}


@pytest.mark.slow
def test_failed_save_keeps_previous_checkpoint(tiny, tmp_path):
    learner = Learner(tiny, LearnerConfig(lr=1e-3))
    final = tmp_path / "checkpoint-00000005"
    learner.save_checkpoint(final, {"step": 5})  # a Path is accepted as well as a string
    learner.train_step(samples())
    # Simulate a write failure: the temporary folder's name is taken by a file.
    (tmp_path / ".checkpoint-00000005.tmp").write_text("in the way")
    with pytest.raises(RuntimeError, match="could not write checkpoint .*previous checkpoint is untouched"):
        learner.save_checkpoint(final, {"step": 6})
    assert json.loads((final / COMPLETE_MARKER).read_text()) == {"step": 5}
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


@pytest.mark.slow
def test_a_checkpoint_through_an_object_store_uri_commits_with_its_marker_last(tiny, tmp_path, monkeypatch):
    """file:// goes through pyarrow.fs like s3:// and gs:// (upload file by file, marker last, no rename)."""
    (tmp_path / "local").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "local"))  # where staging and download folders go
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=2)
    a = Learner(tiny, cfg)
    a.train_step(samples())
    run = f"file://{tmp_path}/bucket/run"
    where = a.save_checkpoint(checkpoint_dir(run, 1), {"step": 1})
    assert where == f"{run}/checkpoint-00000001" and latest_checkpoint(run) == where
    assert (tmp_path / "bucket/run/checkpoint-00000001" / COMPLETE_MARKER).is_file()
    assert not list((tmp_path / "local").iterdir())  # the local staging folder is gone
    draw = torch.rand(2)
    b = Learner(tiny, cfg)
    assert b.load_checkpoint(where) == {"step": 1} and b.optimizer_steps == 1
    assert not list((tmp_path / "local").iterdir())  # and so is the downloaded copy
    assert torch.equal(torch.rand(2), draw)
    for k, v in params(b).items():
        torch.testing.assert_close(v, dict(a.model.named_parameters())[k].detach(), atol=0, rtol=0)
    # A write cut off before its marker (here: the marker removed) is no checkpoint, and pruning removes it.
    a.save_checkpoint(checkpoint_dir(run, 2), {"step": 2})
    (tmp_path / "bucket/run/checkpoint-00000002" / COMPLETE_MARKER).unlink()
    assert latest_checkpoint(run) == where
    prune_checkpoints(run, keep=1)
    assert sorted(p.name for p in (tmp_path / "bucket/run").iterdir()) == ["checkpoint-00000001"]


WRITER = """
import sys, time
from treepo_ray.learner import Learner, LearnerConfig, checkpoint_dir
from treepo_ray.learner import checkpoint as ckpt
learner = Learner(sys.argv[1], LearnerConfig(lr=1e-3))
learner.save_checkpoint(checkpoint_dir(sys.argv[2], 1), {"step": 1})
module, name = (ckpt.torch, "save") if sys.argv[3] == "optimizer" else (ckpt.storage, "commit")
step = getattr(module, name)
def stalled(*args, **kwargs):  # checkpoint 2 is being written when the process is killed
    if name == "save":
        step(*args, **kwargs)
    print("writing", flush=True)
    time.sleep(600)
setattr(module, name, stalled)
learner.save_checkpoint(checkpoint_dir(sys.argv[2], 2), {"step": 2})
"""


@pytest.mark.slow
@pytest.mark.parametrize("uri", [False, True], ids=["path", "uri"])
def test_a_process_killed_in_the_middle_of_a_checkpoint_write_leaves_the_previous_one_usable(tiny, tmp_path, uri):
    run = f"file://{tmp_path}/run" if uri else str(tmp_path / "run")
    (tmp_path / "local").mkdir()  # the killed writer's local staging folder stays here, not in /tmp
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "TMPDIR": str(tmp_path / "local")}
    # A file path: killed while the optimizer state is written (weights done; RNG files and marker not yet). An
    # object store: killed after every file is uploaded but before the marker that commits them.
    where = "marker" if uri else "optimizer"
    proc = subprocess.Popen([sys.executable, "-c", WRITER, tiny, run, where], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert [s for s, _ in list_checkpoints(run)] == [1]
    assert Learner(tiny, LearnerConfig(lr=1e-3)).load_checkpoint(latest_checkpoint(run)) == {"step": 1}
    # The cut-off write is cleaned up by the next pruning (the staging folder, or the folder without its marker).
    left = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert left == ["checkpoint-00000001", "checkpoint-00000002"] if uri else \
        [".checkpoint-00000002.tmp", "checkpoint-00000001"]
    if uri:
        assert (tmp_path / "run/checkpoint-00000002/model.safetensors").is_file()  # uploaded, never committed
    prune_checkpoints(run, keep=1)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-00000001"]
