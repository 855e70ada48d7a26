"""Does overlapping rollout and learning pay? Time per training step with max_staleness = 0 and = 1.

    python -m treepo_ray.runtime.bench_overlap [config.yaml] [--steps N] [--warmup K] [--json PATH] [key=value ...]

Both modes run in one invocation on the same Ray, data and model, with one engine and one learner rank, each
reserving one CPU and using one torch thread, so what differs is only whether generation of batch k+1 overlaps
the learner's step on batch k. The time per step is the mean wall time between two finished training steps,
after `warmup` steps (the first batch can never overlap). The synchronous loop costs about generation + learning
per step, the overlapped one about the larger of the two.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from treepo_ray import config as config_io
from treepo_ray.runtime.config import DEFAULT_CONFIG, TrainConfig

# One core per side: overlap, not extra hardware, is what is measured.
FAIR = ["runtime.num_engines=1", "runtime.engine_cpus=1", "runtime.learner_ranks=1", "runtime.learner_cpus=1",
        "runtime.torch_threads=1", "runtime.engine_gpus=0", "runtime.learner_gpus=0"]


def measure(cfg: TrainConfig, model_path: str, tokenizer, records: list[dict], steps: int, warmup: int) -> dict:
    """Run `steps` training steps of a fresh pipeline; return the mean step time after `warmup` and stage times."""
    from treepo_ray.runtime.pipeline import Pipeline, PromptStream

    pipe = Pipeline(cfg, model_path, tokenizer)
    rows: list[dict] = []
    try:
        pipe.train(0, steps, PromptStream(records, cfg.trainer.seed), lambda batch, m: rows.append(m) or True)
    finally:
        pipe.shutdown()
    timed = rows[warmup:]
    mean = lambda key: sum(r.get(key, 0.0) for r in timed) / max(len(timed), 1)  # noqa: E731
    return {"max_staleness": cfg.runtime.max_staleness, "steps": len(rows), "timed_steps": len(timed),
            "step_s": mean("time/step"), "rollout_s": mean("time/rollout"), "train_s": mean("time/train"),
            "wait_s": mean("time/wait"), "staleness": mean("perf/staleness"), "reward": mean("rollout/reward")}


def run(cfg: TrainConfig, steps: int, warmup: int) -> dict:
    from transformers import AutoTokenizer

    from treepo_ray.runtime.train import init_ray, load_task, resolve_model

    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    records, _ = load_task(cfg, tokenizer)
    init_ray(cfg)
    modes = {}
    for s in (0, 1):
        mode_cfg = config_io.apply_overrides(cfg, [f"runtime.max_staleness={s}"])
        modes[s] = measure(mode_cfg, model_path, tokenizer, records, steps, warmup)
        print(f"max_staleness={s}: {modes[s]['step_s']:.3f} s/step (rollout {modes[s]['rollout_s']:.3f} s, "
              f"learner {modes[s]['train_s']:.3f} s, learner waiting {modes[s]['wait_s']:.3f} s)", flush=True)
    ratio = modes[1]["step_s"] / modes[0]["step_s"]
    print(f"overlap: step time ratio (staleness 1 / staleness 0) = {ratio:.3f}")
    return {"synchronous": modes[0], "overlapped": modes[1], "ratio": ratio, "algorithm": cfg.algo.name,
            "steps": steps, "warmup": warmup}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m treepo_ray.runtime.bench_overlap", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="YAML config (default: jobs/configs/cpu.yaml)")
    ap.add_argument("--steps", type=int, default=10, help="training steps per mode")
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the mean")
    ap.add_argument("--json", default=None, help="write the result here as JSON")
    args, overrides = ap.parse_known_args(argv)
    if "=" in args.config:
        overrides, args.config = [args.config, *overrides], str(DEFAULT_CONFIG)
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    try:
        cfg = config_io.load(TrainConfig, args.config, overrides + FAIR)
    except ValueError as err:
        print(f"bench_overlap: {err}", file=sys.stderr)
        return 2
    started = time.time()
    result = run(cfg, args.steps, args.warmup)
    result["wall_s"] = time.time() - started
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
