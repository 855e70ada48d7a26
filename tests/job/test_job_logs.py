"""Where a run's numbers go (job/logs.py): metrics.jsonl, the sinks, trees.jsonl and the training curve (no Ray)."""

import json

from treepo_ray.job.logs import LogConfig, RunLogger, read_metrics


def test_logger_writes_metrics_and_a_curve(tmp_path):
    seen = []
    log = RunLogger(tmp_path, LogConfig(wandb=False), {}, name="t", sinks=[lambda step, v: seen.append((step, v))])
    for step in range(3):
        line = log.log(step, {"critic/score/mean": 0.1 * step, "eval/accuracy": 0.5, "skip": "text",
                              "bad": float("nan")})
        assert line.startswith(f"step {step}: reward=")
    # Every sink gets each step's finite numbers (how the job adds Ray dashboard gauges).
    assert seen == [(step, {"critic/score/mean": 0.1 * step, "eval/accuracy": 0.5}) for step in range(3)]
    log.save_trees(2, [{"query_id": "q2", "trajectories": [1]}])
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
    assert [json.loads(line) for line in (tmp_path / "trees.jsonl").read_text().splitlines()] == [
        {"step": 2, "query_id": "q2", "trajectories": [1]}]


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
