"""The training job end to end on a real local Ray with a real (random) tiny model: the asynchronous loop and its
staleness bound, DAPO refills, stop + resume from a checkpoint, the run directory's outputs, `viz` and the notebook.
"""

import json
from pathlib import Path

import pytest
import ray
from transformers import AutoTokenizer

from treepo_ray.learner import list_checkpoints
from treepo_ray.runtime.config import DEFAULT_CONFIG, load_config
from treepo_ray.runtime.pipeline import Pipeline, PromptStream
from treepo_ray.runtime.train import load_task, main as train_main
from treepo_ray.runtime.viz import main as viz_main

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "treepo-ray"  # synthetic task files, written once
NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "run_report.ipynb"


def small(tiny, *extra):
    """A seconds-long run: 4 prompts x 4 paths of at most 2 x 8 tokens, one optimizer step per training step."""
    return ["model.path=" + tiny, f"model.cache_dir={CACHE}", "trainer.eval_size=8",
            "rollout.treepo.width=4", "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8",
            "rollout.sequential.group_size=4", "rollout.sequential.max_depth=2", "rollout.sequential.segment_len=8",
            "algo.dynamic_sampling=false",
            "trainer.prompts_per_step=4", "learner.lr=1e-3", "log.trees_per_step=1", "log.wandb=false", *extra]


def test_pipeline_overlaps_within_the_staleness_bound_and_dapo_refills(ray_local, tiny):
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    cfg = load_config(DEFAULT_CONFIG, small(tiny, "runtime.max_staleness=1"))
    records, _ = load_task(cfg, tokenizer)
    pipe = Pipeline(cfg, tiny, tokenizer)
    rows = []
    try:
        done = pipe.train(0, 4, PromptStream(records, 0), lambda batch, m: rows.append((batch, m)) or True)
        assert done == 4
        # Batch 0 is grown with the initial weights, batch 1 while the learner trains on batch 0 (so one version
        # behind), and no batch is ever more than max_staleness = 1 versions behind the learner.
        versions = [b.version for b, _ in rows]
        assert versions[:2] == [0, 0] and versions == sorted(versions)
        assert [m["perf/staleness"] for _, m in rows][:2] == [0, 1]
        assert all(0 <= m["perf/staleness"] <= 1 for _, m in rows)
        assert all(m["train/samples"] == 16 and m["train/skipped"] == 0 for _, m in rows)
        assert all(m["tree/forward_tokens"] > 0 and 0 < m["tree/forward_per_unique"] for _, m in rows)
        assert [b.data_position for b, _ in rows] == [4, 8, 12, 16]
        assert {s["version"] for s in pipe.pool.stats()} == {versions[-1]}  # the weights that grew the last batch
    finally:
        pipe.shutdown()

    # DAPO: sequential sampling, synchronous, over-sample 2x and refill until the batch holds mixed groups only.
    cfg = load_config(DEFAULT_CONFIG, small(
        tiny, "algo.name=dapo", "algo.dynamic_sampling=true", "algo.oversample=2", "algo.max_extra_rounds=1",
        "runtime.max_staleness=0"))
    pipe = Pipeline(cfg, tiny, tokenizer)
    try:
        stream = PromptStream(records, 0)
        batch = pipe.make_batch(0, stream, num_trees_logged=2)
        m = batch.metrics
        assert m["rollout/kept_prompts"] <= 4 and batch.num_samples == 4 * m["rollout/kept_prompts"]
        rounds = int(m["rollout/rounds"])
        assert stream.position == batch.data_position and 8 <= stream.position <= 8 + 8 * (rounds - 1)
        assert all(len(set(t["reward"][n] for n in t["trajectories"])) == 2 for t in batch.trees)
    finally:
        pipe.shutdown()


def test_train_stops_resumes_and_leaves_a_complete_run_directory(ray_local, tiny, tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = small(tiny, f"trainer.run_dir={run}", "trainer.steps=4", "trainer.save_every=1",
                 "trainer.keep_checkpoints=1", "log.wandb=true")
    assert train_main(args + ["trainer.stop_after=2"]) == 1  # stopped early on purpose: not completed
    (step, ckpt), = list_checkpoints(run)  # older ones pruned to keep_checkpoints=1
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert step == 2 and state["step"] == 2 and state["data_position"] == 8
    assert (ckpt / "config.json").is_file() and (ckpt / "optimizer.pt").is_file()

    assert train_main(args + ["trainer.resume=auto"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["completed"] and summary["algorithm"] == "treepo"
    assert 0.0 <= summary["base_accuracy"] <= 1.0 and 0.0 <= summary["final_accuracy"] <= 1.0
    assert summary["trajectories"] == 4 * 16 and summary["trajectories_per_s"] > 0
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
