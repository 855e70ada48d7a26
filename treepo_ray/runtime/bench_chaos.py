"""What does losing engines cost? The same short run without and with runtime.chaos, side by side.

    python -m treepo_ray.runtime.bench_chaos [config.yaml] [--steps N] [--every S] [--json PATH] [key=value ...]

Both runs share one Ray, the config, the model, the prompts and the seeds; each builds a fresh pipeline and trains
N steps. The second kills one engine every S seconds of wall time (runtime.chaos.kill_generator_every; it
alternates ray.kill and SIGKILL of the actor's process). Printed: the wall time of each training loop and the
slowdown, the faults seen, and whether the two runs grew the same trees (token for token) with the same rewards and
trained to the same losses. They should: the requests of a lost engine are sent again whole to a live one, seeded
sampling makes the re-sent segments the ones the dead engine would have produced, and a replacement joins with the
weights the pool runs. (With max_staleness >= 1, which weights version a batch is grown with can depend on timing;
`versions` in the output shows it when the runs differ.)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from treepo_ray.runtime.config import DEFAULT_CONFIG, TrainConfig, load_config

# Two engines of half a CPU each: a lost engine's requests go to the other at once, and its replacement fits in
# the room it left. Override on the command line.
DEFAULTS = ["runtime.num_engines=2", "runtime.engine_cpus=0.5", "runtime.elastic.poll_s=0.2", "log.wandb=false"]


def run_once(cfg: TrainConfig, model_path: str, tokenizer, records: list[dict], steps: int) -> dict:
    """Train `steps` steps on a fresh pipeline (with runtime.chaos as configured); what each step produced."""
    from treepo_ray.runtime.faults import train_with_restarts
    from treepo_ray.runtime.pipeline import Pipeline, PromptStream

    pipe = Pipeline(cfg, model_path, tokenizer)
    rows: list[dict] = []

    def on_step(batch, metrics) -> bool:
        rows.append({"step": batch.step, "version": batch.version, "trees": [t["tokens"] for t in batch.trees],
                     "rewards": [t["reward"] for t in batch.trees], "loss": metrics.get("train/loss"),
                     "trajectories": sum(len(t["trajectories"]) for t in batch.trees),
                     "samples": metrics.get("train/samples"),
                     "faults": {k: v for k, v in metrics.items() if k.startswith("fault/")}})
        return True

    try:
        start = time.perf_counter()
        done = train_with_restarts(pipe, 0, steps, PromptStream(records, cfg.trainer.seed, cfg.data.shuffle), on_step,
                                   None, trees_per_step=cfg.trainer.prompts_per_step)
        wall = time.perf_counter() - start
        tail = pipe.fault_metrics()
    finally:
        pipe.shutdown()
    faults: dict[str, float] = {}
    for row in rows:
        for k, v in row["faults"].items():
            faults[k] = faults.get(k, 0.0) + v
    for k, v in tail.items():
        if k.startswith("fault/"):
            faults[k] = faults.get(k, 0.0) + v
    trajectories = sum(row["trajectories"] for row in rows)
    return {"steps": done, "wall_s": wall, "rows": rows, "faults": faults, "trajectories": trajectories}


def compare(clean: dict, chaos: dict) -> dict:
    """Whether the two runs produced the same thing, step by step."""
    column = lambda run, key: [row[key] for row in run["rows"]]  # noqa: E731
    same = lambda key: column(clean, key) == column(chaos, key)  # noqa: E731
    return {"same_trees": same("trees"), "same_rewards": same("rewards"), "same_losses": same("loss"),
            "same_steps": same("step") and clean["steps"] == chaos["steps"],
            "same_trajectories": clean["trajectories"] == chaos["trajectories"],
            "versions": {"clean": column(clean, "version"), "chaos": column(chaos, "version")}}


def run(cfg: TrainConfig, steps: int, every: float) -> dict:
    import dataclasses

    from transformers import AutoTokenizer

    from treepo_ray.runtime.train import init_ray, load_task, resolve_model

    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    records, _ = load_task(cfg, tokenizer)
    init_ray(cfg)
    off = dataclasses.replace(cfg.runtime.chaos, kill_generator_every=0.0, kill_learner_after_step=0)
    on = dataclasses.replace(cfg.runtime.chaos, kill_generator_every=every)
    results = {}
    for name, chaos in (("clean", off), ("chaos", on)):
        run_cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, chaos=chaos))
        results[name] = run_once(run_cfg, model_path, tokenizer, records, steps)
        r = results[name]
        print(f"{name:>5}: {r['steps']} steps in {r['wall_s']:.1f} s, {r['trajectories']} trajectories, "
              f"faults {json.dumps({k.split('/')[1]: v for k, v in sorted(r['faults'].items())})}", flush=True)
    verdict = compare(results["clean"], results["chaos"])
    slowdown = results["chaos"]["wall_s"] / results["clean"]["wall_s"]
    print(f"chaos (one engine killed every {every:g} s): {slowdown:.2f}x the wall time; same trees "
          f"{verdict['same_trees']}, rewards {verdict['same_rewards']}, losses {verdict['same_losses']}, "
          f"trajectories {verdict['same_trajectories']}")
    return {"kill_generator_every_s": every, "steps": steps, "algorithm": cfg.algo.name,
            "num_engines": cfg.runtime.num_engines, "max_staleness": cfg.runtime.max_staleness,
            "clean_wall_s": results["clean"]["wall_s"], "chaos_wall_s": results["chaos"]["wall_s"],
            "slowdown": slowdown, "trajectories": {k: v["trajectories"] for k, v in results.items()},
            "faults": results["chaos"]["faults"], **verdict}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m treepo_ray.runtime.bench_chaos", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG),
                    help="YAML config (default: jobs/configs/cpu.yaml)")
    ap.add_argument("--steps", type=int, default=40, help="training steps of each run (cpu.yaml: the whole run)")
    ap.add_argument("--every", type=float, default=3.0, help="seconds between two engine kills in the chaos run")
    ap.add_argument("--json", default=None, help="write the result here as JSON")
    args, overrides = ap.parse_known_args(argv)
    if "=" in args.config:
        overrides, args.config = [args.config, *overrides], str(DEFAULT_CONFIG)
    if args.steps < 1 or args.every <= 0:
        ap.error("--steps must be >= 1 and --every > 0")
    try:
        cfg = load_config(args.config, DEFAULTS + overrides)
    except ValueError as err:
        print(f"bench_chaos: {err}", file=sys.stderr)
        return 2
    result = run(cfg, args.steps, args.every)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
