"""Where a run's numbers go (job/logs.py): metrics.jsonl, the sinks, trees.jsonl and the training curve (no Ray)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from treepo_ray.job.logs import LogConfig, RunLogger, read_metrics


def test_logger_writes_metrics_and_a_curve(tmp_path):
    seen = []
    log = RunLogger(tmp_path, LogConfig(wandb=False), {}, name="t", sinks=[lambda step, v: seen.append((step, v))])
    for step in range(3):
        line = log.log(step, {"critic/score/mean": 0.1 * step, "eval/accuracy": 0.5, "skip": "text",
                              "bad": float("nan")})
        assert line.startswith(f"step {step}: reward=") and "no_reward" not in line
    # Every sink gets each step's finite numbers (how the job adds Ray dashboard gauges).
    assert seen == [(step, {"critic/score/mean": 0.1 * step, "eval/accuracy": 0.5}) for step in range(3)]
    tree = {"query_id": "q2", "parent": [-1, 0], "trajectories": [1], "reward": [None, 1.0], "finish": ["", "eos"],
            "texts": ["", "4 + 5 = 9"], "prompt_text": "4 + 5?"}
    log.save_trees(2, [tree])
    curve = log.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "bad" not in rows[0] and "skip" not in rows[0]
    assert curve is not None and curve.stat().st_size > 1000
    # A resumed run appends; a step logged again keeps its newest values.
    again = RunLogger(tmp_path, LogConfig(wandb=False), {}, name="t", resume_step=2)
    again.log(2, {"critic/score/mean": 9.0})
    again.close()
    assert read_metrics(tmp_path)[-1]["critic/score/mean"] == 9.0
    assert read_metrics(tmp_path)[-1]["eval/accuracy"] == 0.5  # merged with the step's earlier row
    assert [json.loads(line) for line in (tmp_path / "trees.jsonl").read_text().splitlines()] == [{"step": 2, **tree}]
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == [
        {"step": 2, "query_id": "q2", "trained": True, "prompt": "4 + 5?",
         "answers": [{"text": "4 + 5 = 9", "reward": 1.0, "finish": "eos"}]}]


def test_trajectories_without_a_reward_show_on_the_console_by_cause(tmp_path):
    log = RunLogger(tmp_path, LogConfig(wandb=False), {}, name="t")
    line = log.log(1, {"critic/score/mean": 0.0, "verify/failed": 3.0, "reward/errors": 2.0, "reward/timeouts": 1.0,
                       "reward/nonfinite": 0.0})
    assert line.endswith("no_reward=3 reward_errors=2 reward_timeouts=1")
    log.close()


def test_tensorboard_sink_writes_the_same_names(tmp_path):
    """log.tensorboard: every step's metrics as TensorBoard scalars, read back with TensorBoard's own reader."""
    import pytest

    pytest.importorskip("tensorboard", reason="the tensorboard extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = RunLogger(tmp_path, LogConfig(wandb=False, tensorboard=True), {}, name="t")
    for step in (1, 2):
        log.log(step, {"critic/score/mean": 0.25 * step, "actor/pg_loss": -0.1})
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"critic/score/mean", "actor/pg_loss"}
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5)]


def test_a_fresh_start_says_it_replaces_the_logs_of_an_earlier_one(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    RunLogger(tmp_path, LogConfig(wandb=False), {}, name="t").close()
    assert f"a fresh start in {tmp_path}: the metrics.jsonl of an earlier start there are replaced" in \
        capsys.readouterr().out
    assert not (tmp_path / "metrics.jsonl").exists()


def test_lines_that_cannot_be_written_are_kept_and_written_in_order_once_they_can(tmp_path):
    log = RunLogger(tmp_path, LogConfig(wandb=False), {}, name="t")
    log.log(1, {"a": 1.0})
    (tmp_path / "metrics.jsonl").rename(tmp_path / "moved")
    (tmp_path / "metrics.jsonl").mkdir()  # the file cannot be opened: a real OSError (IsADirectoryError)
    log.log(2, {"a": 2.0})
    assert log.write_error.startswith("metrics.jsonl not written: [Errno 21] Is a directory")
    with pytest.raises(OSError, match="metrics.jsonl not written"):
        log.flush()
    (tmp_path / "metrics.jsonl").rmdir()
    (tmp_path / "moved").rename(tmp_path / "metrics.jsonl")
    log.log(3, {"a": 3.0})
    log.flush()
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]


PAST_THE_LIMIT = """
import json, resource, signal, sys
from pathlib import Path
from treepo_ray.job.logs import LogConfig, RunLogger, read_metrics
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
run = Path(sys.argv[1])
log = RunLogger(run, LogConfig(wandb=False), {}, name="t")
log.log(1, {"a": 1.0})
resource.setrlimit(resource.RLIMIT_FSIZE, ((run / "metrics.jsonl").stat().st_size + 100, resource.RLIM_INFINITY))
log.log(2, {f"key{i}": float(i) for i in range(100)})  # about 1.5 kB: its first 100 bytes go through
cut = (run / "metrics.jsonl").read_text()
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
log.log(3, {"a": 3.0})
print(json.dumps({"cut": cut, "error": log.write_error, "steps": [r["step"] for r in read_metrics(run)]}))
"""


def test_a_write_cut_off_by_a_full_disk_leaves_no_half_line(tmp_path):
    done = subprocess.run([sys.executable, "-c", PAST_THE_LIMIT, str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["cut"] == '{"step": 1, "a": 1.0}\n'  # cut back to the whole line before it
    assert "File too large" in out["error"] and out["steps"] == [1, 2, 3]
