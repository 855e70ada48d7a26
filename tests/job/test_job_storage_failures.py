"""Run storage failing under a real run (job/trainer.py, through runtime/train.py on a local Ray with the tiny model):
log lines and checkpoints that cannot be written are said, counted and tried again at the next step while training
goes on; once run storage has failed for trainer.storage_retry_s with no checkpoint written, the run stops with one
line; and a resumed run whose newest checkpoint the learner cannot read resumes from the one before it. The failures
are real: a log file that cannot be opened, a checkpoint's staging folder that cannot be created, a weights file
that is not one."""

import json
import re
from pathlib import Path

import pytest

from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.job.faults import RunStopped
from treepo_ray.learner import list_checkpoints
from treepo_ray.runtime.train import run as train_run

pytestmark = pytest.mark.slow

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "treepo-ray"  # the synthetic task's files, written once


def config(tiny: str, run: Path, *extra: str):
    """A seconds-long run (as tests/runtime/runtime_testlib.py's `small`): 4 prompts x 4 paths of 2 x 8 tokens."""
    return load_config(DEFAULT_CONFIG, [
        f"model.path={tiny}", f"model.cache_dir={CACHE}", f"trainer.run_dir={run}", "trainer.eval_size=4",
        "rollout.treepo.width=4", "rollout.treepo.init_divergence_min=2", "rollout.treepo.init_divergence_max=4",
        "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8", "rollout.treepo.max_response_len=0",
        "rollout.treepo.max_total_len=0", "algo.dynamic_sampling=false", "trainer.prompts_per_step=4",
        "learner.lr=1e-3", "log.trees_per_step=1", "log.wandb=false", "log.ray_metrics=false", *extra])


def logged_steps(run: Path) -> list[int]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if "critic/score/mean" in r]


def block_checkpoint(run: Path, step: int) -> None:
    """A file where the checkpoint of `step` is staged: its write fails (the learner cannot create the folder)."""
    (run / f".checkpoint-{step:08d}.tmp").write_text("in the way")


def test_storage_failures_are_tried_again_and_a_run_that_cannot_checkpoint_stops(ray_local, tiny, tmp_path, capsys):
    run = tmp_path / "run"

    def observe(batch, metrics):  # called before the trainer logs the step
        step = batch.step + 1
        if step == 3:  # metrics.jsonl cannot be opened while step 3 is logged and its checkpoint tried
            (run / "metrics.jsonl").rename(run / "metrics.away")
            (run / "metrics.jsonl").mkdir()
        if step == 4:  # the logs can be written again; the checkpoint of step 4 cannot
            (run / "metrics.jsonl").rmdir()
            (run / "metrics.away").rename(run / "metrics.jsonl")
            block_checkpoint(run, 4)

    summary = train_run(config(tiny, run, "trainer.steps=5", "trainer.save_every=2"), observe)
    # Step 3: its log line (1) and the checkpoint tried after it (2; the lines kept go first, and could not); step 4:
    # the checkpoint (3). Step 5 is not a multiple of save_every but the checkpoint is tried again, and is written.
    assert summary["completed"] and summary["faults"]["fault/storage_errors"] == 3
    assert [s for s, _ in list_checkpoints(run)] == [2, 5]
    assert logged_steps(run) == [1, 2, 3, 4, 5]  # the lines kept were written, in order
    err = capsys.readouterr().err
    assert "metrics.jsonl not written: [Errno 21] Is a directory" in err and "tried again at the next step" in err

    # Resumed, the newest checkpoint's weights cannot be read: the learner falls back to the checkpoint before it.
    (run / "checkpoint-00000005" / "model.safetensors").write_bytes(b"not a safetensors file")
    for step in (4, 5, 6, 7):
        block_checkpoint(run, step)
    with pytest.raises(RunStopped) as stopped:
        train_run(config(tiny, run, "trainer.steps=7", "trainer.save_every=2", "trainer.resume=auto",
                         "trainer.storage_retry_s=2"))
    err = capsys.readouterr().err
    assert "checkpoint-00000005 cannot be read (" in err and "resuming from checkpoint-00000002, the checkpoint " \
        "before it" in err
    # Steps 3.. trained again from step 2, and every checkpoint after it failed: the trainer went on and tried again,
    # until trainer.storage_retry_s had passed since the first failure (step 4), then stopped, in one line, at the
    # checkpoint it was trying (at step 7, the last, it tries again in place until then).
    redone = logged_steps(run)[5:]
    assert redone[:2] == [3, 4] and redone == list(range(3, redone[-1] + 1))
    assert re.fullmatch(rf"run storage has failed for [23]s with no checkpoint written \(trainer.storage_retry_s = "
                        rf"2\): checkpoint checkpoint-{redone[-1]:08d} not written: could not write checkpoint "
                        r".*File exists.*; the previous checkpoint is untouched", str(stopped.value))
    assert [s for s, _ in list_checkpoints(run)] == [2, 5]  # the damaged one is left for the next save to replace
