#!/usr/bin/env bash
# GPU check, one GPU, under 10 minutes: tree vs sequential sampling throughput (`treepo-ray bench`) of the HF engine
# and, where vLLM is installed, of the vLLM engine, on an HF model directory; prints each engine's table and a summary.
#
#   bash jobs/gpu_check.sh MODEL_DIR [OUT_DIR]        (OUT_DIR default: runs/gpu_check)
#
# Environment:
#   PYTHON       interpreter with treepo-ray installed (default: .venv/bin/python if it exists, else python)
#   VLLM_PYTHON  interpreter with treepo-ray and vLLM (default: PYTHON if it imports vllm, else .venv-vllm/bin/python)
#   DEVICE       cuda (default) or cpu (to try the script on a machine without a GPU)
#   BENCH_ARGS   bench options (default: 8 prompts x 16 paths x 4 segments of 64 tokens, 3 timed repeats)
#   ENGINE_TIMEOUT  seconds allowed to each engine's run (default 270: both fit in 10 minutes)
# Each engine runs in its own process, so the second gets the whole GPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL="${1:?usage: bash jobs/gpu_check.sh MODEL_DIR [OUT_DIR]}"
OUT="${2:-$ROOT/runs/gpu_check}"
[[ -f "$MODEL/config.json" ]] || { echo "gpu_check: $MODEL is not an HF model directory (no config.json)" >&2; exit 2; }
DEVICE="${DEVICE:-cuda}"
BENCH_ARGS="${BENCH_ARGS:---prompts 8 --width 16 --depth 4 --segment-len 64 --repeats 3}"
ENGINE_TIMEOUT="${ENGINE_TIMEOUT:-270}"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python; fi
fi
if [[ -z "${VLLM_PYTHON:-}" ]]; then
  if "$PYTHON" -c "import vllm" 2>/dev/null; then VLLM_PYTHON="$PYTHON"; else VLLM_PYTHON="$ROOT/.venv-vllm/bin/python"; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"

echo "== gpu_check: model $MODEL, device $DEVICE, bench $BENCH_ARGS"
if [[ "$DEVICE" == cuda* ]]; then
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
fi

bench() {  # bench ENGINE PYTHON
  local engine="$1" py="$2" start=$SECONDS rc=0
  echo "== $engine engine ($py)"
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
  timeout "$ENGINE_TIMEOUT" "$py" -m treepo_ray.cli bench --engine "$engine" --model "$MODEL" --device "$DEVICE" \
    --no-progress --json "$OUT/bench_$engine.json" $BENCH_ARGS || rc=$?
  echo "== $engine engine: exit $rc after $((SECONDS - start)) s"
  return 0
}

rm -f "$OUT"/bench_*.json
bench hf "$PYTHON"
if "$VLLM_PYTHON" -c "import vllm" 2>/dev/null; then
  bench vllm "$VLLM_PYTHON"
else
  echo "== vllm engine: skipped (no interpreter with vllm: set VLLM_PYTHON)"
fi

"$PYTHON" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

rows = []
for path in sorted(Path(sys.argv[1]).glob("bench_*.json")):
    for name, entry in json.loads(path.read_text())["engines"].items():
        seq, tree, ratios = entry["sequential"], entry["tree"], entry["ratios"]
        rows.append(f"{name:<6} {seq['traj_per_s']:>9.2f} {tree['traj_per_s']:>9.2f} {seq['tok_per_s']:>9.0f} "
                    f"{tree['tok_per_s']:>9.0f} {ratios['speedup']:>8.2f} {ratios['token_bound']:>8.2f} "
                    f"{tree['forward_tokens']:>10} {seq['forward_tokens']:>10}")
print("== summary (traj/s and tok/s: sequential, tree; speedup = tree/sequential traj/s; bound = forward-token ratio)")
print(f"{'engine':<6} {'seq_tr/s':>9} {'tree_tr/s':>9} {'seq_tok/s':>9} {'tree_tok/s':>9} {'speedup':>8} "
      f"{'bound':>8} {'tree_fwd':>10} {'seq_fwd':>10}")
print("\n".join(rows) if rows else "(no engine finished)")
sys.exit(0 if rows else 1)
EOF
