"""What does losing actors cost? The same seeded run without and with runtime.chaos, side by side.

    treepo-ray bench chaos [config.yaml] [--kill engine,scheduler,verifier,learner] [--every S] [--steps N]
                           [--json PATH] [key=value ...]

Both runs are the training job itself (runtime/train.py, job/trainer.py: run storage, checkpoints, recovery) in one
Ray, with the same config, model, prompts and seeds, each in a run directory of its own. The second kills one actor every S
seconds of wall time, the kinds of --kill in turn (runtime.chaos: ray.kill and SIGKILL of the actor's process
alternately). A lost engine's requests are re-sent to a live one; a lost scheduler's prompts are grown again on a
new one; a lost verifier is restarted in place and its call retried; a lost learner is rebuilt from the newest
checkpoint and the steps after it trained again. Seeded sampling makes every re-done piece of work the one that was
lost, so the runs must agree: `identical` is true when every step's trees (token for token), rewards and loss are
equal in both (for a step trained twice, its last training, the one the final weights descend from); the schedulers
number every tree's nodes depth-first (Tree.renumber), so equal trees compare equal. The engines' logits are exact only up
to float rounding that depends on what else a batch holds (engines/hf/engine.py), so a token drawn at a CDF
boundary can differ and the runs part from there: measured, of three pairs of fault-free runs with two engines
one agreed on all 40 steps, one parted at step 37 and one somewhere (its growth counters differed by one branch).
`trajectories_lost` does not depend on it.

Which weights version a batch is grown with depends on timing when max_staleness >= 1 (the producer takes the newest
weights published), so the bench runs max_staleness = 0 unless told otherwise: a batch is then always grown with the
weights of the step before it, in both runs. `versions` in the JSON shows them when the runs differ.

JSON: `faults` (kills per kind, and every fault/* count of the chaos run), `trajectories_lost` (trajectories the
clean run trained and the chaos run did not, over all steps), `identical`, `loss_max_abs_diff`, `wall_time_ratio` (chaos / clean
training-loop wall time), and the details.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile

from treepo_ray.benchmarks.common import parse_job_args, write_json
from treepo_ray.job.config import CHAOS_KINDS, TrainConfig

# Two engines of half a CPU each: a lost engine's requests go to the other at once, and its replacement fits in
# the room it left. A checkpoint every step: a lost learner redoes at most the step it was in. Override any of
# these on the command line.
DEFAULTS = ["runtime.num_engines=2", "runtime.engine_cpus=0.5", "runtime.elastic.poll_s=0.2", "runtime.max_staleness=0",
            "trainer.save_every=1", "trainer.keep_checkpoints=2", "trainer.eval_size=0",
            "runtime.faults.max_learner_restarts=1000", "log.wandb=false", "log.ray_metrics=false",
            "log.console_every=0"]


def run_once(cfg: TrainConfig, run_dir: str) -> dict:
    """One run of the training job; every step's trees, rewards and loss as of its last training."""
    from treepo_ray.runtime.train import run

    steps: dict[int, dict] = {}

    def observe(batch, metrics) -> None:
        steps[batch.step] = {"version": batch.version, "trees": [t["tokens"] for t in batch.trees],
                             "rewards": [t["reward"] for t in batch.trees], "loss": metrics.get("actor/loss"),
                             "trajectories": sum(len(t["trajectories"]) for t in batch.trees)}

    tr = dataclasses.replace(cfg.trainer, run_dir=run_dir, resume="")
    summary = run(dataclasses.replace(cfg, trainer=tr), observe)
    return {"steps": summary["steps"], "wall_s": summary["train_time_s"], "faults": summary["faults"],
            "rows": [steps[s] for s in sorted(steps)]}


def compare(clean: dict, chaos: dict) -> dict:
    """Whether the two runs trained the same thing, step by step."""
    column = lambda run, key: [row[key] for row in run["rows"]]  # noqa: E731
    same = {key: column(clean, key) == column(chaos, key) for key in ("trees", "rewards", "loss")}
    lost = sum(max(0, a["trajectories"] - b["trajectories"]) for a, b in zip(clean["rows"], chaos["rows"]))
    lost += sum(row["trajectories"] for row in clean["rows"][len(chaos["rows"]):])  # steps the chaos run never did
    lost += int(chaos["faults"].get("fault/verifier_failures", 0))
    # With learner.off_policy=behaviour the loss uses the engines' sampled log-probs, which a re-sent request on
    # another engine (another batch shape) reproduces only to float rounding: how far apart the losses are says so.
    diffs = [abs(a - b) for a, b in zip(column(clean, "loss"), column(chaos, "loss")) if a is not None and b is not None]
    return {"identical": all(same.values()) and clean["steps"] == chaos["steps"],
            "same": same, "trajectories_lost": lost, "loss_max_abs_diff": max(diffs, default=0.0),
            "versions": {"clean": column(clean, "version"), "chaos": column(chaos, "version")}}


def run(cfg: TrainConfig, steps: int, every: float, kinds: list[str]) -> dict:
    tr = dataclasses.replace(cfg.trainer, steps=steps, stop_after=0)
    off = dataclasses.replace(cfg.runtime.chaos, kill_every=0.0, kill_learner_after_step=0)
    on = dataclasses.replace(cfg.runtime.chaos, kill_every=every, kill=list(kinds))
    results = {}
    with tempfile.TemporaryDirectory(prefix="treepo-chaos-") as storage_path:
        for name, chaos in (("clean", off), ("chaos", on)):
            run_cfg = dataclasses.replace(cfg, trainer=tr, runtime=dataclasses.replace(cfg.runtime, chaos=chaos),
                                          log=dataclasses.replace(cfg.log, trees_per_step=tr.prompts_per_step))
            results[name] = r = run_once(run_cfg, f"{storage_path}/{name}")
            print(f"{name:>5}: {r['steps']} steps in {r['wall_s']:.1f} s, faults "
                  f"{json.dumps({k.split('/')[1]: v for k, v in sorted(r['faults'].items())})}", flush=True)
    clean, chaos = results["clean"], results["chaos"]
    verdict = compare(clean, chaos)
    ratio = chaos["wall_s"] / clean["wall_s"]
    kills = {kind: int(chaos["faults"].get(f"fault/chaos_kills_{kind}", 0)) for kind in kinds}
    print(f"chaos (one of {', '.join(kinds)} killed every {every:g} s, kills {kills}): {ratio:.2f}x the wall time; "
          f"identical {verdict['identical']} {verdict['same']} (loss max abs diff {verdict['loss_max_abs_diff']:.2e}), "
          f"trajectories lost {verdict['trajectories_lost']}")
    return {"kill": list(kinds), "every_s": every, "steps": steps, "algorithm": cfg.algo.name,
            "num_engines": cfg.runtime.num_engines, "max_staleness": cfg.runtime.max_staleness,
            "faults": {**kills, **chaos["faults"]}, "trajectories_lost": verdict["trajectories_lost"],
            "identical": verdict["identical"], "same": verdict["same"],
            "loss_max_abs_diff": verdict["loss_max_abs_diff"], "wall_time_ratio": ratio,
            "clean_wall_s": clean["wall_s"], "chaos_wall_s": chaos["wall_s"],
            "trajectories": {k: sum(row["trajectories"] for row in v["rows"]) for k, v in results.items()},
            "versions": verdict["versions"]}


def main(argv: list[str] | None = None) -> int:
    def flags(ap) -> None:
        ap.add_argument("--steps", type=int, default=40, help="training steps of each run (cpu.yaml: the whole run)")
        ap.add_argument("--every", type=float, default=3.0, help="seconds between two kills in the chaos run")
        ap.add_argument("--kill", default="engine", help=f"kinds killed in turn, comma-separated: {CHAOS_KINDS}")

    parsed = parse_job_args(argv, "chaos", __doc__, flags, before=DEFAULTS)
    if isinstance(parsed, int):
        return parsed
    args, cfg = parsed
    kinds = [k.strip() for k in args.kill.split(",") if k.strip()]
    if args.steps < 1 or args.every <= 0 or not kinds or any(k not in CHAOS_KINDS for k in kinds):
        print(f"treepo-ray bench chaos: --steps must be >= 1, --every > 0, --kill one or more of {CHAOS_KINDS}",
              file=sys.stderr)
        return 2
    write_json(args.json, run(cfg, args.steps, args.every, kinds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
