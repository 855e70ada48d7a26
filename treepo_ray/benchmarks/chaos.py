"""What does losing engines cost? The same short run without and with runtime.chaos, side by side.

    treepo-ray bench chaos [config.yaml] [--steps N] [--every S] [--json PATH] [key=value ...]

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

import dataclasses
import json
import sys
import time

from treepo_ray.benchmarks.common import parse_job_args, write_json
from treepo_ray.job.config import TrainConfig

# Two engines of half a CPU each: a lost engine's requests go to the other at once, and its replacement fits in
# the room it left. Override on the command line.
DEFAULTS = ["runtime.num_engines=2", "runtime.engine_cpus=0.5", "runtime.elastic.poll_s=0.2", "log.wandb=false"]


def run_once(job, cfg: TrainConfig, steps: int) -> dict:
    """Train `steps` steps on a fresh pipeline (with runtime.chaos as configured); what each step produced."""
    from treepo_ray.data.prompts import PromptStream
    from treepo_ray.runtime.pipeline import Pipeline
    from treepo_ray.runtime.recovery import train_with_recovery

    pipe = Pipeline(cfg, job.model_path, job.tokenizer)
    rows: list[dict] = []

    def on_step(batch, metrics) -> bool:
        rows.append({"step": batch.step, "version": batch.version, "trees": [t["tokens"] for t in batch.trees],
                     "rewards": [t["reward"] for t in batch.trees], "loss": metrics.get("actor/loss"),
                     "trajectories": sum(len(t["trajectories"]) for t in batch.trees),
                     "samples": metrics.get("actor/samples"),
                     "faults": {k: v for k, v in metrics.items() if k.startswith("fault/")}})
        return True

    try:
        start = time.perf_counter()
        done = train_with_recovery(pipe, 0, steps, PromptStream(job.train_set, cfg.trainer.seed, cfg.data.shuffle),
                                   on_step, None, trees_per_step=cfg.trainer.prompts_per_step)
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
    from treepo_ray.runtime.train import set_up

    job = set_up(cfg)
    off = dataclasses.replace(cfg.runtime.chaos, kill_generator_every=0.0, kill_learner_after_step=0)
    on = dataclasses.replace(cfg.runtime.chaos, kill_generator_every=every)
    results = {}
    for name, chaos in (("clean", off), ("chaos", on)):
        run_cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, chaos=chaos))
        results[name] = run_once(job, run_cfg, steps)
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
    def flags(ap) -> None:
        ap.add_argument("--steps", type=int, default=40, help="training steps of each run (cpu.yaml: the whole run)")
        ap.add_argument("--every", type=float, default=3.0, help="seconds between two engine kills in the chaos run")

    parsed = parse_job_args(argv, "chaos", __doc__, flags, before=DEFAULTS)
    if isinstance(parsed, int):
        return parsed
    args, cfg = parsed
    if args.steps < 1 or args.every <= 0:
        print("treepo-ray bench chaos: --steps must be >= 1 and --every > 0", file=sys.stderr)
        return 2
    write_json(args.json, run(cfg, args.steps, args.every))
    return 0


if __name__ == "__main__":
    sys.exit(main())
