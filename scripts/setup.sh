#!/usr/bin/env bash
# Create .venv with the project and its test tools. torch is installed first, pinned: an unpinned `torch`
# (asked for by any dependency) would pull a multi-GB CUDA build; 2.13.0 resolves to the CPU build here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev]"
