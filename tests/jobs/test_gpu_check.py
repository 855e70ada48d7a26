"""jobs/gpu_check.sh here, where there is no GPU: it says so and exits with its own status; it cannot pass by not
running a leg (only every leg run and passed is exit 0; legs this hardware cannot run give a status of their own); it
refuses an NVIDIA driver too old for vLLM's CUDA 13 wheel; and its legs, rehearsed on the CPU with tiny shapes (the
hf engine standing in for vLLM, gloo for NCCL), run to the end, so that a GPU's minutes go to what only a GPU can
show."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "jobs" / "gpu_check.sh"
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "jobs" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_check)


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.slow  # a subprocess that imports torch: seconds
def test_without_a_gpu_it_says_so_and_exits_3(tmp_path):
    done = _run("--out", str(tmp_path))
    assert done.returncode == gpu_check.NO_GPU == 3
    assert "no GPU on this machine" in done.stderr and "nothing ran" in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpus"] == 0 and summary["legs"] == {} and summary["exit_status"] == 3


def test_bad_arguments_exit_2(tmp_path):
    assert _run(str(tmp_path / "no-model"), "--out", str(tmp_path)).returncode == 2
    assert _run("--legs", "vllm_generate,nope", "--out", str(tmp_path)).returncode == 2


def test_only_every_leg_run_and_passed_is_a_pass():
    passed = {"status": "passed"}
    no_second_gpu = {"status": "not_run", "hardware": True, "reason": "needs 2 GPUs"}
    out_of_time = {"status": "not_run", "reason": "the 570 s budget ran out"}
    failed = {"status": "failed", "reason": "x"}
    assert gpu_check.exit_status({"a": passed, "b": passed}) == 0
    assert gpu_check.exit_status({"a": passed, "b": no_second_gpu}) == gpu_check.NOT_ALL_RUN == 4
    assert gpu_check.exit_status({"a": passed, "b": out_of_time}) == 1
    assert gpu_check.exit_status({"a": failed, "b": no_second_gpu}) == 1
    assert len({0, 1, 2, gpu_check.NO_GPU, gpu_check.NOT_ALL_RUN}) == 5  # each outcome its own status


def test_a_leg_this_hardware_cannot_run_ends_not_run(tmp_path):
    def leg_needs_more(context):
        raise gpu_check.CannotRunHere("needs 3 GPUs")

    (tmp_path / "legs").mkdir()
    gpu_check.leg_needs_more = leg_needs_more
    try:
        assert gpu_check.run_leg("needs_more", {"out": str(tmp_path)}) == 1
    finally:
        del gpu_check.leg_needs_more
    result = json.loads((tmp_path / "legs" / "needs_more.json").read_text())
    assert result == {"status": "not_run", "hardware": True, "reason": "needs 3 GPUs"}


def test_a_driver_older_than_vllms_cuda_13_wheel_is_refused():
    assert "older than the 580" in gpu_check.driver_problem("550.54.15")
    assert gpu_check.driver_problem("580.65.06") is None and gpu_check.driver_problem(None) is None


def test_the_deep_tree_has_the_papers_depth():
    tree = gpu_check.paper_depth_tree(prompt_len=4, segment_len=3, vocab=50)
    tree.validate("deep tree", 50)
    assert len(tree.trajectories) == 16 and {len(tree.path(leaf)) for leaf in tree.trajectories} == {14}


@pytest.mark.slow
def test_legs_rehearsed_on_cpu_run_to_the_end(tmp_path):
    legs = "learner_step,learner_memory,learner_deep_tree,weights_cuda_graphs,weights_broadcast,treepo_e2e"
    done = _run("--rehearse-on-cpu", "--legs", legs, "--out", str(tmp_path), timeout=1200)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0, (done.stdout[-3000:], summary)
    assert "every leg ran and passed" in done.stdout
    figures = {name: leg["figures"] for name, leg in summary["legs"].items()}
    assert figures["learner_step"]["ranks"] == 2
    assert figures["learner_memory"]["shape"]["sequences"] == 4
    assert figures["learner_deep_tree"]["depth"] == 14 and figures["learner_deep_tree"]["paths"] == 16
    for leg in ("weights_cuda_graphs", "weights_broadcast"):  # every weight path, the engine following new weights
        for load in figures[leg]["loads"]:
            assert load["bytes"] > 0 and load["logprob_gap_new"] < 1e-4 < load["logprob_gap_old"]
    assert figures["treepo_e2e"]["steps"] == 2 and figures["treepo_e2e"]["weights_bytes"] > 0
