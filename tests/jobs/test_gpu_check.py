"""jobs/gpu_check.sh here, where there is no GPU: it says so and exits with its own status; its verdict counts only
missing hardware as a harmless skip; and its legs, rehearsed on the CPU with tiny shapes (the hf engine standing in
for vLLM, gloo for NCCL), run to the end, so that a GPU's minutes go to what only a GPU can show."""

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
    assert "no GPU on this machine" in done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["gpus"] == 0 and summary["legs"] == {} and summary["exit_status"] == 3


def test_bad_arguments_exit_2(tmp_path):
    assert _run(str(tmp_path / "no-model"), "--out", str(tmp_path)).returncode == 2
    assert _run("--legs", "vllm_generate,nope", "--out", str(tmp_path)).returncode == 2


def test_only_missing_hardware_is_a_harmless_skip():
    passed = {"status": "passed"}
    no_second_gpu = {"status": "skipped", "hardware": True, "reason": "needs 2 GPUs"}
    out_of_time = {"status": "skipped", "reason": "the 570 s budget ran out"}
    assert gpu_check.exit_status({"a": passed, "b": no_second_gpu}) == 0
    assert gpu_check.exit_status({"a": passed, "b": out_of_time}) == 1
    assert gpu_check.exit_status({"a": passed, "b": {"status": "failed", "reason": "x"}}) == 1


@pytest.mark.slow
def test_legs_rehearsed_on_cpu_run_to_the_end(tmp_path):
    legs = "learner_step,learner_memory,weights,treepo_e2e"
    done = _run("--rehearse-on-cpu", "--legs", legs, "--out", str(tmp_path), timeout=900)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0, (done.stdout[-3000:], summary)
    figures = {name: leg["figures"] for name, leg in summary["legs"].items()}
    assert figures["learner_step"]["ranks"] == 2
    assert figures["learner_memory"]["shape"]["sequences"] == 4
    for path in ("object_store", "broadcast"):  # every weight path, the engine following the new weights
        sync = figures["weights"][path]
        assert sync["bytes"] > 0 and sync["logprob_gap_new"] < 1e-4 < sync["logprob_gap_old"]
    assert figures["treepo_e2e"]["steps"] == 2 and figures["treepo_e2e"]["weights_bytes"] > 0
