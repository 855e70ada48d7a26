"""The training job end to end (runtime/train.py, `treepo-ray train`) on a real local Ray with a real (random) tiny
model: stop + resume from a checkpoint, the run directory's outputs, `viz` and the notebook; a driver killed by
SIGKILL and resumed continues the same step, data position and W&B run, training first the batch that was waiting
for the learner."""

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from treepo_ray.job.config import load_config
from treepo_ray.job.rundir import lock_holder
from treepo_ray.job.viz import main as viz_main
from treepo_ray.learner import list_checkpoints
from treepo_ray.learner.checkpoint import COMPLETE_MARKER
from treepo_ray.job.trainer import format_summary
from treepo_ray.runtime.cluster import gauge_name
from treepo_ray.runtime.train import main as train_main
from runtime_testlib import small, wandb_logged_keys

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster" / "grafana" / "treepo_ray_dashboard.json"
# verl's names of the figures both projects have (verl: trainer/ppo/metric_utils.py), and the tree figures.
VERL_METRICS = {"critic/score/mean", "critic/advantages/mean", "response_length/mean", "response_length/clip_ratio",
                "actor/pg_loss", "actor/entropy", "actor/ppo_kl", "actor/pg_clipfrac", "actor/grad_norm",
                "timing_s/gen", "timing_s/update_actor", "val-core/synthetic_chain/acc/mean@3"}  # 3 = eval_samples
TREE_METRICS = {"tree/shared_prefix_share", "tree/depth_max", "tree/nodes", "tree/forward_per_unique"}

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "run_report.ipynb"

pytestmark = pytest.mark.slow


def test_train_stops_resumes_and_leaves_a_complete_run_directory(ray_local, tiny, tmp_path, monkeypatch):
    run = tmp_path / "runs" / "run"
    args = small(tiny, f"trainer.run_dir={run}", "trainer.steps=4", "trainer.save_every=1",
                 "trainer.keep_checkpoints=1", "trainer.eval_samples=3", "log.wandb=true")
    assert train_main(args + ["trainer.stop_after=2"]) == 1  # stopped early on purpose: not completed
    (step, ckpt), = list_checkpoints(run)  # older ones pruned to keep_checkpoints=1
    ckpt = Path(ckpt)
    state = json.loads((ckpt / COMPLETE_MARKER).read_text())
    # "pending": the batch already grown for step 3 (max_staleness 1), when it was waiting in the queue
    assert set(state) - {"pending"} == {"step", "data_position", "elapsed_s", "trajectories", "base_eval", "seed"}
    assert step == 2 and state["step"] == 2 and state["data_position"] == 8
    assert state["trajectories"] == 2 * 16 and "eval/accuracy" in state["base_eval"]
    assert (ckpt / "config.json").is_file() and (ckpt / "optimizer.pt").is_file()

    assert train_main(args + ["trainer.resume=auto"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["completed"] and summary["algorithm"] == "treepo"
    assert 0.0 <= summary["base_accuracy"] <= 1.0 and 0.0 <= summary["final_accuracy"] <= 1.0
    assert summary["trajectories"] == 4 * 16 and summary["trajectories_per_s"] > 0
    assert summary["tree_counters"]["branches"] > 0  # growth/* totals of the resumed invocation's steps
    # The console line gives the steps' own time (both invocations'), not the job's start-up and base evaluation
    assert f"4 steps in {summary['train_time_s']:.0f}s of training" in format_summary(summary).splitlines()[0]
    assert [s for s, _ in list_checkpoints(run)] == [4]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "critic/score/mean" in r] == [1, 2, 3, 4]
    # The resumed run grew step 3 from the prompts right after the checkpoint's data position (8, 9, ...).
    trees = [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]
    assert [int(t["query_id"].split("#")[1]) for t in trees if t["step"] == 3] == [8]
    assert (run / "training_curve.png").stat().st_size > 1000
    assert any((run / "wandb").glob("offline-run-*"))
    # verl's metric names, the same in metrics.jsonl and W&B (offline files), and in the Grafana dashboard's queries
    logged = set().union(*rows)
    assert VERL_METRICS | TREE_METRICS <= logged, (VERL_METRICS | TREE_METRICS) - logged
    assert VERL_METRICS | TREE_METRICS <= wandb_logged_keys(run)
    queried = set(re.findall(r"\b(ray_treepo_\w+)\{", DASHBOARD.read_text()))
    assert queried <= {"ray_" + gauge_name(k) for k in logged}, queried - {"ray_" + gauge_name(k) for k in logged}
    # each attempt's resolved config is kept (the stopped one and the resumed one) and loads again as a config
    attempts = sorted(p.name for p in (run / "configs").iterdir())
    assert attempts == ["attempt-1.yaml", "attempt-2.yaml"]
    assert "resumed from" in (run / "configs" / "attempt-2.yaml").read_text().splitlines()[0]
    assert load_config(run / "config.yaml").trainer.resume == "auto"
    # Both invocations logged to one W&B run: the id kept in run.json.
    wandb_id = json.loads((run / "run.json").read_text())["wandb_id"]
    runs = list((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and {p.name.rsplit("-", 1)[1] for p in runs} == {wandb_id}
    assert summary["wandb_run_id"] == wandb_id and lock_holder(str(run))[1]["released"]

    assert viz_main([str(run)]) == 0 and "<svg" in (run / "trees.html").read_text()

    import nbformat
    from nbclient import NotebookClient

    # As a user opens it: Jupyter started in notebooks/, no TREEPO_RUN_DIR; it finds the newest run in ../runs/
    monkeypatch.delenv("TREEPO_RUN_DIR", raising=False)
    (tmp_path / "runs" / "older").mkdir()
    os.utime(tmp_path / "runs" / "older", (0, 0))
    (tmp_path / "notebooks").mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path / "notebooks")}}).execute()
    outputs = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert f"{run}: " in outputs and "logged steps" in outputs and "first trajectory" in outputs


def test_ray_metrics_carry_run_and_algorithm_tags(ray_local):
    """Each metric is a Ray gauge tagged run and algorithm, as Prometheus scrapes it from the node's exporter."""
    import time
    import urllib.request

    import ray

    from treepo_ray.runtime.cluster import ray_gauges

    # Recorded in an actor, a process of this Ray's own: the test process has joined one Ray per test module, and its
    # metrics exporter can be left sending to an earlier one's agent ("Failed to export metrics" in its core log).
    @ray.remote
    class Recorder:
        def __init__(self):
            self.sink = ray_gauges("treepo-20260101-000000", "treepo")

        def record(self, values: dict) -> None:
            self.sink(1, values)

    recorder = Recorder.remote()
    port = ray.nodes()[0]["MetricsExportPort"]
    deadline, lines = time.monotonic() + 60, []
    while not lines and time.monotonic() < deadline:
        ray.get(recorder.record.remote({"critic/score/mean": 0.75}))
        time.sleep(1.0)
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        lines = [line for line in text.splitlines()  # this run's series (the module's other run has its own)
                 if line.startswith("ray_treepo_critic_score_mean{") and 'run="treepo-20260101-000000"' in line]
    ray.kill(recorder)
    assert lines and 'algorithm="treepo"' in lines[0] and lines[0].endswith(" 0.75"), lines
def train_process(args: list[str], log: Path) -> subprocess.Popen:
    """`treepo-ray train ARGS` in a process of its own (its own local Ray and W&B service: this process's, which
    WANDB_SERVICE would hand down, outlives the killed driver and keeps its run open), output to `log`."""
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    return subprocess.Popen([sys.executable, "-m", "treepo_ray.cli", "train", *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """Whatever is left of a train process's own processes (its Ray shares the driver's fate anyway)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def test_a_driver_killed_by_sigkill_resumes_the_same_step_data_position_and_wandb_run(tiny, tmp_path):
    run = tmp_path / "run"
    # Steps slower than growth (one sample per micro-batch), max_staleness 1: the next batch is usually grown and
    # waiting for the learner when a checkpoint is taken.
    args = small(tiny, f"trainer.run_dir={run}", "trainer.steps=10", "trainer.save_every=1", "trainer.keep_checkpoints=2",
                 "runtime.max_staleness=1", "learner.packing=none", "learner.micro_batch_size=1", "log.wandb=true", "log.ray_metrics=false")
    first = train_process(args, tmp_path / "first.log")
    killed_at = None
    try:
        deadline = time.monotonic() + 300
        while killed_at is None and first.poll() is None and time.monotonic() < deadline:
            for marker in sorted(run.glob(f"checkpoint-*/{COMPLETE_MARKER}")):
                state = json.loads(marker.read_text())
                if state["step"] >= 2 and state.get("pending"):
                    os.kill(first.pid, signal.SIGKILL)  # the driver, at once, with a batch waiting in its queue
                    killed_at = state
                    break
            time.sleep(0.05)
        first.wait(timeout=60)
    finally:
        kill_group(first)
    assert killed_at is not None, (tmp_path / "first.log").read_text()[-3000:]
    step, position = killed_at["step"], killed_at["data_position"]
    pending = json.loads(__import__("gzip").decompress((run / killed_at["pending"]).read_bytes()))

    second = train_process(args + ["trainer.resume=auto"], tmp_path / "second.log")
    try:
        assert second.wait(timeout=600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    finally:
        kill_group(second)
    out = (tmp_path / "second.log").read_text()
    assert f"its process {first.pid} on this host has exited" in out  # the dead driver's lock taken over
    assert (f"resuming {run} from checkpoint-{step:08d}: step {step}, data position {position}, then the "
            f"{len(pending)} batches grown before it stopped") in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 10
    # The same W&B run: both drivers logged under the id kept in run.json.
    wandb_id = json.loads((run / "run.json").read_text())["wandb_id"]
    assert summary["wandb_run_id"] == wandb_id
    assert {p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")} == {wandb_id}
    # The waiting batch was trained first, as it was grown (its trees, its weights version), not grown again; the
    # steps after it took the prompts that follow it.
    trees = [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]
    resumed = [t for t in trees if t["step"] == step + 1][-len(pending[0]["trees"]):]
    assert [t["tokens"] for t in resumed] == [t["tokens"] for t in pending[0]["trees"]]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"actor/optimizer_steps"' in line]
    assert rows[-(10 - step)]["step"] == step + 1 and rows[-(10 - step)]["perf/staleness"] == step - pending[0]["version"]
    after = [int(t["query_id"].split("#")[1]) for t in trees if t["step"] == step + 1 + len(pending)][-1:]
    assert after == [pending[-1]["data_position"]]
