#!/usr/bin/env bash
# Submit the paper-scale training jobs to a running Ray cluster.
#
#   cluster/submit.sh [--dry-run] [--wait] METHOD... [key=value ...]
#
# METHOD is treepo, grpo, dapo, treerpo, catpo or all; each submits
#   python jobs/train.py jobs/configs/<METHOD>_paper.yaml [key=value ...]
# with jobs/runtime_env.yaml and this checkout as the working directory. key=value arguments are config
# overrides passed to every job. --dry-run prints the commands instead of running them; --wait follows each
# job's logs until it ends (default: submit and return). Jobs submitted together share the cluster: their
# actors wait for GPUs, and the autoscaler adds nodes up to the cluster's limits.
#
# Environment:
#   RAY_ADDRESS    dashboard address (default http://127.0.0.1:8265: `ray dashboard cluster/ray-cluster.yaml`
#                  or `kubectl port-forward svc/treepo-ray-head-svc 8265:8265` forwards it there)
#   RAY_AUTH_MODE  default token, as the cluster configs in cluster/ start Ray; the token is read from
#                  RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token
#   RAY            the ray executable (default: ray)
set -euo pipefail

METHODS=(treepo grpo dapo treerpo catpo)
usage() {
    sed -n '4,12p' "$0" | sed 's/^# \{0,1\}//'
}

dry_run=0
wait_flag=--no-wait
chosen=()
overrides=()
for arg in "$@"; do
    case "$arg" in
        -h|--help) usage; exit 0 ;;
        --dry-run) dry_run=1 ;;
        --wait) wait_flag= ;;
        all) chosen+=("${METHODS[@]}") ;;
        *=*) overrides+=("$arg") ;;
        -*) echo "submit.sh: unknown option '$arg'" >&2; usage >&2; exit 2 ;;
        *)
            if [[ " ${METHODS[*]} " != *" $arg "* ]]; then
                echo "submit.sh: unknown method '$arg' (expected one of: ${METHODS[*]} all)" >&2
                exit 2
            fi
            chosen+=("$arg") ;;
    esac
done
# Each method once, in the order first named (a repeated method would reuse its submission id).
unique=()
for method in ${chosen[@]+"${chosen[@]}"}; do
    [[ " ${unique[*]-} " == *" $method "* ]] || unique+=("$method")
done
chosen=(${unique[@]+"${unique[@]}"})
if [[ ${#chosen[@]} -eq 0 ]]; then
    echo "submit.sh: name at least one method (${METHODS[*]} or all)" >&2
    usage >&2
    exit 2
fi

# Paths below are relative to the repository root, whatever the caller's directory.
cd "$(dirname "$0")/.."
RAY=${RAY:-ray}
export RAY_ADDRESS=${RAY_ADDRESS:-http://127.0.0.1:8265}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
stamp=$(date +%Y%m%d-%H%M%S)

# Check every input before submitting anything, so a typo never leaves half of the runs started.
if [[ $dry_run -eq 0 ]]; then
    for method in "${chosen[@]}"; do
        for needed in "jobs/configs/${method}_paper.yaml" jobs/runtime_env.yaml jobs/train.py; do
            if [[ ! -f "$needed" ]]; then
                echo "submit.sh: $needed not found (needed to submit '$method')" >&2
                exit 1
            fi
        done
    done
fi

for method in "${chosen[@]}"; do
    config="jobs/configs/${method}_paper.yaml"
    cmd=("$RAY" job submit
         --address "$RAY_ADDRESS"
         --submission-id "treepo-paper-${method}-${stamp}"
         --runtime-env jobs/runtime_env.yaml
         --working-dir .
         ${wait_flag:+"$wait_flag"}
         -- python jobs/train.py "$config" ${overrides[@]+"${overrides[@]}"})
    if [[ $dry_run -eq 1 ]]; then
        printf '%q ' "${cmd[@]}"
        echo
    else
        "${cmd[@]}"
    fi
done
