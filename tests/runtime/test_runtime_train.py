"""The training job end to end (runtime/train.py, `treepo-ray train`) on a real local Ray with a real (random) tiny
model: stop + resume from a checkpoint, the run directory's outputs, `viz` and the notebook."""

import json
from pathlib import Path

import pytest

from treepo_ray.job.viz import main as viz_main
from treepo_ray.learner import list_checkpoints
from treepo_ray.runtime.train import main as train_main
from runtime_testlib import small

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "run_report.ipynb"

pytestmark = pytest.mark.slow


def test_train_stops_resumes_and_leaves_a_complete_run_directory(ray_local, tiny, tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = small(tiny, f"trainer.run_dir={run}", "trainer.steps=4", "trainer.save_every=1",
                 "trainer.keep_checkpoints=1", "log.wandb=true")
    assert train_main(args + ["trainer.stop_after=2"]) == 1  # stopped early on purpose: not completed
    (step, ckpt), = list_checkpoints(run)  # older ones pruned to keep_checkpoints=1
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert set(state) == {"step", "data_position", "elapsed_s", "trajectories", "base_eval", "seed"}  # as always
    assert step == 2 and state["step"] == 2 and state["data_position"] == 8
    assert state["trajectories"] == 2 * 16 and "eval/accuracy" in state["base_eval"]
    assert (ckpt / "config.json").is_file() and (ckpt / "optimizer.pt").is_file()

    assert train_main(args + ["trainer.resume=auto"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["completed"] and summary["algorithm"] == "treepo"
    assert 0.0 <= summary["base_accuracy"] <= 1.0 and 0.0 <= summary["final_accuracy"] <= 1.0
    assert summary["trajectories"] == 4 * 16 and summary["trajectories_per_s"] > 0
    assert summary["tree_counters"]["branches"] > 0  # growth/* totals of the resumed invocation's steps
    assert [s for s, _ in list_checkpoints(run)] == [4]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "rollout/reward" in r] == [1, 2, 3, 4]
    # The resumed run grew step 3 from the prompts right after the checkpoint's data position (8, 9, ...).
    trees = [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]
    assert [int(t["query_id"].split("#")[1]) for t in trees if t["step"] == 3] == [8]
    assert (run / "training_curve.png").stat().st_size > 1000
    assert any((run / "wandb").glob("offline-run-*"))

    assert viz_main([str(run)]) == 0 and "<svg" in (run / "trees.html").read_text()

    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("TREEPO_RUN_DIR", str(run))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "logged steps" in outputs and "first trajectory" in outputs
