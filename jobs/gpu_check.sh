#!/usr/bin/env bash
# The GPU check: each GPU path the CPU tests cannot show (vLLM engine generate + log-probs vs HF, weight reloads into
# an engine running CUDA graphs, NCCL broadcast, an NCCL learner step, the learner's peak memory under FSDP2 mixed
# precision extrapolated to the paper model's 28 layers, a paper-depth tree through the learner, a short TreePO run
# end to end, a weight reload into a tensor-parallel vLLM engine), one process per leg, at most 10 minutes on one
# GPU. Each leg ends passed, failed or not run (with why). See jobs/gpu_check.py.
#
#   bash jobs/gpu_check.sh [MODEL_DIR] [--out DIR] [--legs a,b]   (no MODEL_DIR: random models of real shapes)
#
# Writes DIR/summary.json (default runs/gpu_check), with the NVIDIA driver's version. Exit status: 0 every leg ran
# and passed; 1 a leg failed or did not run for a reason other than the hardware, or the driver is older than the
# 580 vLLM 0.32.0's CUDA 13 wheel needs, or torch cannot use the GPUs; 2 bad arguments; 3 no GPU here (nothing ran);
# 4 no leg failed but some could not run on this hardware (e.g. two-GPU legs on one GPU): not a pass.
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
