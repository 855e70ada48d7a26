#!/usr/bin/env bash
# The GPU check: each GPU path the CPU tests cannot show (vLLM engine generate + log-probs vs HF, weight updates by
# every path, an NCCL learner step, the learner's peak memory at a paper-like shape, a short TreePO run end to end,
# tensor-parallel vLLM with two GPUs), one process per leg, at most 10 minutes on one GPU. See jobs/gpu_check.py.
#
#   bash jobs/gpu_check.sh [MODEL_DIR] [--out DIR] [--legs a,b]   (no MODEL_DIR: random models of real shapes)
#
# Writes DIR/summary.json (default runs/gpu_check). Exit status: 0 every leg passed (two-GPU legs may be skipped on
# one GPU); 1 a leg failed or was skipped for another reason; 2 bad arguments; 3 no GPU here (nothing ran).
# PYTHON: the interpreter with the project and its [vllm] extra (pip install -e ".[vllm]"); default .venv/bin/python
# if it exists, else python3. Never the CPU build's .venv-vllm: the check is about the GPU build.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" RAY_USAGE_STATS_ENABLED=0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0}"  # Ray on 127.0.0.1 only
exec "$PYTHON" "$ROOT/jobs/gpu_check.py" "$@"
