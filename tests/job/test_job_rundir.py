"""The run directory (job/rundir.py): one live run per directory (a second is refused, naming the holder; a dead
holder's lock is taken over), which run resume=auto continues and why it passes others over, the W&B run id kept
across restarts, the waiting batches kept with their checkpoint, and the logs of a run in an object store. Real
processes and files, no Ray."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treepo_ray import config as config_io
from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.learner.checkpoint import COMPLETE_MARKER
from treepo_ray.job.rundir import (
    LOCK,
    LogMirror,
    RunDirError,
    RunLock,
    RunLocked,
    RunRecord,
    _process_start,
    config_changes,
    load_pending,
    lock_holder,
    prune_run,
    resolve_run,
    save_pending,
    stale_reason,
    write_config,
)


def holder_process():
    """A live process of this host that is not this one (the holder of a lock)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def lock_files(run: Path) -> dict[str, dict]:
    """The run directory's lock files and what each says."""
    return {p.name: json.loads(p.read_text()) for p in sorted(run.glob("run.lock*"))}


def test_a_second_run_is_refused_naming_the_holder(tmp_path):
    run = str(tmp_path / "run")
    other = holder_process()
    try:
        # The single run.lock of the version before generations still counts (a run of it may be alive).
        held = {"host": socket.gethostname(), "pid": other.pid, "run": "treepo-first", "token": "t",
                "started": "2026-11-30 10:00:00", "heartbeat": time.time()}
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / LOCK).write_text(json.dumps(held))
        with pytest.raises(RunLocked, match=rf"in use by run 'treepo-first' \(host {socket.gethostname()}, pid "
                                            rf"{other.pid}, since 2026-11-30 10:00:00\)"):
            RunLock(run, "treepo-second", 300).acquire()
    finally:
        other.kill()
        other.wait()
    # Its process is gone (a driver killed by SIGKILL): the lock is taken over, the old file deleted.
    lock = RunLock(run, "treepo-second", 300).acquire()
    assert list(lock_files(tmp_path / "run")) == ["run.lock.00000001"]
    assert lock_holder(run)[1]["run"] == "treepo-second"
    with pytest.raises(RunLocked, match="in use by run 'treepo-second'"):
        RunLock(run, "treepo-third", 300).acquire()  # the same host, a live holder (this process)
    lock.release()
    assert lock_files(tmp_path / "run")["run.lock.00000001"]["released"]
    # A released lock is taken without a word, by the next generation.
    third = RunLock(run, "treepo-third", 300).acquire()
    assert list(lock_files(tmp_path / "run")) == ["run.lock.00000002"] and third.path.endswith("run.lock.00000002")
    third.release()


def test_a_live_holder_on_this_host_is_never_taken_over_however_old_its_heartbeat(tmp_path, capsys):
    run = tmp_path / "run"
    other = holder_process()
    try:
        mine = RunLock(str(run), "probe", 300).info  # what this host writes about a process of its own
        paused = {**mine, "pid": other.pid, "pid_started": _process_start(other.pid), "run": "paused",
                  "heartbeat": time.time() - 86400}
        run.mkdir()
        (run / "run.lock.00000003").write_text(json.dumps(paused))
        with pytest.raises(RunLocked, match="in use by run 'paused'"):
            RunLock(str(run), "second", stale_s=60).acquire()
        assert stale_reason(paused, 60) is None
        # The same pid started at another time is another process: its holder has exited.
        reused = {**paused, "pid_started": "1"}
        assert stale_reason(reused, 60) == f"its process {other.pid} on this host has exited"
        (run / "run.lock.00000003").write_text(json.dumps(reused))
        lock = RunLock(str(run), "second", stale_s=60).acquire()
        assert "taking over the lock" in capsys.readouterr().out and lock.path.endswith("run.lock.00000004")
        lock.release()
    finally:
        other.kill()
        other.wait()


def test_a_holder_on_another_host_is_stale_only_when_its_heartbeat_is(tmp_path):
    now = time.time()
    away = {"host": "another-host", "machine": "another-host/boot/pid:[1]", "pid": 1, "heartbeat": now - 100}
    assert stale_reason(away, 300, now) is None
    assert "last heartbeat was 400s ago" in stale_reason({**away, "heartbeat": now - 400}, 300, now)
    lock = RunLock(str(tmp_path / "run"), "r", stale_s=1.0).acquire()  # its thread renews the heartbeat
    try:
        first = lock_holder(lock.run_dir)[1]["heartbeat"]
        assert wait_until(lambda: lock_holder(lock.run_dir)[1]["heartbeat"] > first)  # renewed: a beat happened
        # Taken over by another run (this one looked dead): a generation above ours. The next beat notices, says by
        # whom, and never writes into the other run's file.
        thief = {**away, "run": "thief", "token": "x", "heartbeat": time.time()}
        (tmp_path / "run" / "run.lock.00000002").write_text(json.dumps(thief))
        assert wait_until(lambda: lock.lost)
        assert "taken over by run 'thief'" in lock.lost
    finally:
        lock.release()
    files = lock_files(tmp_path / "run")
    assert files["run.lock.00000002"] == thief  # not ours: left alone
    assert "released" not in files["run.lock.00000001"]  # nor is ours marked released: it was not ours any more


def test_a_holder_that_cannot_renew_its_heartbeat_gives_the_lock_up_before_others_may_take_it(tmp_path):
    lock = RunLock(str(tmp_path / "run"), "r", stale_s=1.0).acquire()
    try:
        Path(lock.path).unlink()
        Path(lock.path).mkdir()  # its file cannot be replaced any more: every beat fails (a real OSError)
        assert wait_until(lambda: lock.lost)
        assert lock.lost.startswith(f"the lock of {tmp_path / 'run'} could not be renewed for ")
        assert "another run may take it over" in lock.lost
    finally:
        lock.release()


def test_a_store_without_an_atomic_create_is_refused(tmp_path):
    with pytest.raises(RunDirError, match=r"mock:// storage has no atomic create-if-absent"):
        RunLock("mock://bucket/run", "r", 300).acquire()


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_identity_settings_break_a_resume_and_the_rest_may_change():
    a = config_io.to_dict(load_config(DEFAULT_CONFIG))
    b = config_io.to_dict(load_config(DEFAULT_CONFIG, ["algo.name=grpo", "learner.lr=1e-3", "trainer.steps=80",
                                                        "runtime.num_engines=2"]))
    breaking, other = config_changes(a, b)
    assert any(line.startswith("algo.name: 'treepo' -> 'grpo'") for line in breaking)
    assert any(line.startswith("learner.loss.") for line in breaking)  # grpo's loss preset
    assert {line.split(":")[0] for line in other} >= {"learner.lr", "trainer.steps", "runtime.num_engines"}


def fake_checkpoint(run: Path, step: int) -> Path:
    """The files a checkpoint's restore reads, by name (their contents are not read here)."""
    folder = run / f"checkpoint-{step:08d}"
    folder.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "optimizer.pt"):
        (folder / name).write_bytes(b"")
    (folder / "learner_state.json").write_text('{"world_size": 1, "optimizer_format": "full"}')
    (folder / COMPLETE_MARKER).write_text("{}")
    return folder


def fake_run(root: Path, name: str, overrides=(), checkpoint=True) -> str:
    run = root / name
    run.mkdir(parents=True)
    write_config(str(run), config_io.to_dict(load_config(DEFAULT_CONFIG, list(overrides))), None, 0)
    if checkpoint:
        fake_checkpoint(run, 4)
    return str(run)


def test_resume_auto_takes_the_newest_compatible_run_and_says_why_it_passes_others(tmp_path, capsys):
    fake_run(tmp_path, "treepo-20261130-090000")
    fake_run(tmp_path, "treepo-20261130-100000", ["trainer.seed=7"])  # another experiment
    fake_run(tmp_path, "treepo-20261130-110000", checkpoint=False)
    fake_run(tmp_path, "grpo-20261130-120000", ["algo.name=grpo"])
    cfg = load_config(DEFAULT_CONFIG, [f"trainer.storage_path={tmp_path}", "trainer.resume=auto", "trainer.steps=80"])
    run_dir, ckpt = resolve_run(cfg)
    assert run_dir == str(tmp_path / "treepo-20261130-090000") and ckpt == f"{run_dir}/checkpoint-00000004"
    out = capsys.readouterr().out
    assert "treepo-20261130-110000: it has no complete checkpoint" in out
    assert "treepo-20261130-100000: its config differs in trainer.seed: 7 -> 0" in out
    # An explicit run directory of another config is an error that names the difference.
    explicit = load_config(DEFAULT_CONFIG, [f"trainer.run_dir={tmp_path}/treepo-20261130-100000",
                                            "trainer.resume=auto"])
    with pytest.raises(RunDirError, match="trainer.seed: 7 -> 0"):
        resolve_run(explicit)
    # Nothing to continue: a new run under storage_path, with an absolute path whatever the working directory.
    fresh, ckpt = resolve_run(load_config(DEFAULT_CONFIG, [f"trainer.storage_path={tmp_path}/other",
                                                           "trainer.resume=auto"]))
    assert ckpt is None and fresh.startswith(f"{tmp_path}/other/treepo-")


def test_resume_auto_passes_over_a_held_run_and_a_checkpoint_that_cannot_be_read(tmp_path, capsys):
    older = fake_run(tmp_path, "treepo-20261130-090000")
    fake_checkpoint(Path(older), 6)
    (Path(older) / "checkpoint-00000006" / "optimizer.pt").unlink()  # lost after it was written
    held = fake_run(tmp_path, "treepo-20261130-100000")
    lock = RunLock(held, "treepo-20261130-100000", 300).acquire()
    try:
        cfg = load_config(DEFAULT_CONFIG, [f"trainer.storage_path={tmp_path}", "trainer.resume=auto"])
        assert resolve_run(cfg) == (older, f"{older}/checkpoint-00000004")
    finally:
        lock.release()
    out = capsys.readouterr().out
    assert f"not resuming {held}: run 'treepo-20261130-100000' holds it (host {socket.gethostname()}" in out
    assert (f"checkpoint {older}/checkpoint-00000006 cannot be read (optimizer.pt missing): falling back to the one "
            "before it") in out


def test_relative_storage_paths_resolve_on_the_driver(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir, _ = resolve_run(load_config(DEFAULT_CONFIG, ["trainer.storage_path=shared/runs"]))
    assert os.path.isabs(run_dir) and run_dir.startswith(f"{tmp_path}/shared/runs/treepo-")


def test_the_wandb_id_and_the_waiting_batches_outlive_the_driver(tmp_path):
    run = str(tmp_path / "run")
    first = RunRecord.load_or_create(run)
    assert RunRecord.load_or_create(run) == first and len(first.wandb_id) == 12
    batches = [{"step": 5, "version": 4, "kept": [{"query_id": "q#1"}]}]
    assert save_pending(run, 4, batches) == "pending-00000004.json.gz"
    assert load_pending(run, "pending-00000004.json.gz") == batches
    save_pending(run, 2, batches)  # of a checkpoint that gets pruned
    for step in (2, 4):
        fake_checkpoint(tmp_path / "run", step)
    prune_run(run, keep=1)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["checkpoint-00000004", "pending-00000004.json.gz",
                                                                    "run.json"]


def test_logs_of_a_run_in_an_object_store_go_up_with_each_checkpoint_and_come_back_on_resume(tmp_path):
    run = f"file://{tmp_path}/bucket/treepo-1"  # through pyarrow.fs, as s3:// and gs:// are
    logs = LogMirror(run, str(tmp_path / "cache"))
    assert logs.local == tmp_path / "cache" / "runs" / "treepo-1"
    (logs.local / "metrics.jsonl").write_text('{"step": 1}\n')
    logs.upload()
    assert (tmp_path / "bucket/treepo-1/metrics.jsonl").read_text() == '{"step": 1}\n'
    again = LogMirror(run, str(tmp_path / "other-node-cache"))  # a driver restarted elsewhere
    again.download()
    assert (again.local / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert LogMirror(str(tmp_path / "local-run"), str(tmp_path / "cache")).local == tmp_path / "local-run"
