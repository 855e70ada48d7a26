#!/usr/bin/env bash
# The wheel as a user gets it: built from this checkout, installed (not -e) into a fresh venv, then run from an empty
# directory outside the checkout, so a file the package reads at run time but does not ship fails here. Two commands:
# `treepo-ray pretrain` (its training runs in a subprocess that must import the installed package) with a few steps,
# and `treepo-ray train trainer.steps=2` (the packaged default config) on that model, kept to seconds. The default
# base model takes minutes to pretrain; the cache-hit path is what a user's second run takes anyway.
# Wheels come from pip's find-links and cache, so a second run takes about a minute (scripts/test.sh runs it).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3.11}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/treepo-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS

# Build from a copy of the sources, so the checkout gets no build/ or egg-info.
mkdir "$WORK/src"
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/treepo_ray" "$WORK/src/"
find "$WORK/src" -name __pycache__ -prune -exec rm -rf {} +
"$ROOT/.venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation "$WORK/src" -w "$WORK/dist"
WHEEL=$(ls "$WORK"/dist/treepo_ray-*.whl)

"$PYTHON" -m venv "$WORK/venv"
# torch pinned first (the CPU build); no .pyc compiled ahead for a throwaway venv (a third of the install's time).
"$WORK/venv/bin/python" -m pip install -q --no-compile "torch==${TORCH_VERSION:-2.13.0}"
"$WORK/venv/bin/python" -m pip install -q --no-compile "$WHEEL"
installed=$SECONDS

mkdir "$WORK/empty" && cd "$WORK/empty"
export PATH="$WORK/venv/bin:$PATH" PYTHONPATH="" WANDB_MODE=offline RAY_USAGE_STATS_ENABLED=0
# A few steps of pretraining, through the cache (prepare_base_model -> its subprocess).
model=$(treepo-ray pretrain --cache-dir cache steps=3 warmup_steps=1 batch_size=4 micro_batches=1 min_pass1=0 \
        eval_problems=4 eval_samples=1 eval_max_new_tokens=16 | tail -1 \
        | python -c 'import json, sys; print(json.load(sys.stdin)["model"])')
treepo-ray train trainer.steps=2 "model.path=$model" log.wandb=false trainer.prompts_per_step=2 \
    trainer.eval_size=4 trainer.eval_samples=1 rollout.treepo.width=4 rollout.treepo.init_divergence_min=2 \
    rollout.treepo.init_divergence_max=4 rollout.treepo.max_depth=2 rollout.treepo.segment_len=8 \
    rollout.treepo.max_response_len=0 rollout.treepo.max_total_len=0 algo.dynamic_sampling=false \
    > train.log 2>&1 || { tail -30 train.log; echo "wheel check: treepo-ray train failed" >&2; exit 1; }
ls runs/*/summary.json > /dev/null
unknown=$(treepo-ray train no_such_config 2>&1 || true)  # exits 2: one line naming the packaged configs
grep -q "gsm8k_1gpu.*treepo_paper" <<< "$unknown" \
    || { echo "wheel check: an unknown config name does not list the packaged ones: $unknown" >&2; exit 1; }
echo "wheel check: $(basename "$WHEEL") built and installed in $((installed - start)) s, pretrained and trained 2 steps" \
     "outside the checkout in $((SECONDS - installed)) s"
