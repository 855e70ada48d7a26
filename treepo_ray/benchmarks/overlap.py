"""Does overlapping rollout and learning pay? Time per training step with max_staleness = 0 and = 1.

    treepo-ray bench overlap [config.yaml] [--steps N] [--rounds R] [--json PATH] [key=value ...]

Both modes run in one invocation on one run's actors (the same actors, model, data), with one engine and one learner
rank that each reserve one CPU and use one torch thread, so what differs is only whether the generation of batch
k+1 overlaps the learner's step on batch k. The modes alternate in `rounds` chunks of `steps` steps each, so a
change in the machine's background load hits both alike. A step's time is the wall time between two finished
training steps; the first step of a chunk is left out (it can never overlap), and each mode reports the mean over
its remaining steps (with overlapping batches, step times alternate: a batch grown beside the one before is done
soon after it) and their median. The synchronous loop costs about generation + learning per step, the overlapped
one about the larger of the two.
"""

from __future__ import annotations

import statistics
import sys
import time

from treepo_ray.benchmarks.common import parse_job_args, write_json
from treepo_ray.job.config import TrainConfig

# One core per side: overlap, not extra hardware, is what is measured.
FAIR = ["runtime.num_engines=1", "runtime.engine_cpus=1", "runtime.learner_ranks=1", "runtime.learner_cpus=1",
        "runtime.torch_threads=1", "runtime.engine_gpus=0", "runtime.learner_gpus=0", "runtime.num_schedulers=1"]


def summarise(rows: list[dict], staleness: int) -> dict:
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"max_staleness": staleness, "timed_steps": len(rows),
            "step_s": statistics.mean(r["timing_s/step"] for r in rows), "step_s_median": med("timing_s/step"),
            "rollout_s": med("timing_s/gen"), "train_s": med("timing_s/update_actor"), "wait_s": med("timing_s/wait"),
            "staleness_mean": sum(r["perf/staleness"] for r in rows) / len(rows),
            "step_s_all": [round(r["timing_s/step"], 4) for r in rows]}


def run(cfg: TrainConfig, steps: int, rounds: int) -> dict:
    from treepo_ray.data.prompts import PromptStream
    from treepo_ray.runtime.cluster import set_up
    from treepo_ray.runtime.train import start_runtime

    job = set_up(cfg)
    rt = start_runtime(cfg, job)
    stream = PromptStream(job.train_set, cfg.trainer.seed)
    timed: dict[int, list[dict]] = {0: [], 1: []}
    done = 0
    try:
        for _ in range(rounds):
            for s in (0, 1):
                rows = [m for _, m in rt.loop.steps(done, done + steps, stream, max_staleness=s)]
                done = rt.loop.version
                timed[s] += rows[1:]  # the chunk's first step cannot overlap anything
    finally:
        rt.supervisor.shutdown()
    sync, overlapped = summarise(timed[0], 0), summarise(timed[1], 1)
    for m in (sync, overlapped):
        print(f"max_staleness={m['max_staleness']}: {m['step_s']:.3f} s/step (mean of {m['timed_steps']}; "
              f"rollout {m['rollout_s']:.3f} s, learner {m['train_s']:.3f} s, learner waiting {m['wait_s']:.3f} s)")
    ratio = overlapped["step_s"] / sync["step_s"]
    print(f"overlap: time per step with max_staleness=1 is {ratio:.3f} of max_staleness=0")
    return {"synchronous": sync, "overlapped": overlapped, "ratio": ratio, "algorithm": cfg.algo.name,
            "steps_per_chunk": steps, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    def flags(ap) -> None:
        ap.add_argument("--steps", type=int, default=6, help="training steps per chunk (the first is not timed)")
        ap.add_argument("--rounds", type=int, default=2, help="alternations of the two modes")

    parsed = parse_job_args(argv, "overlap", __doc__, flags, after=FAIR)
    if isinstance(parsed, int):
        return parsed
    args, cfg = parsed
    if args.steps < 2 or args.rounds < 1:
        print("treepo-ray bench overlap: --steps must be >= 2 and --rounds >= 1", file=sys.stderr)
        return 2
    started = time.time()
    result = run(cfg, args.steps, args.rounds)
    result["wall_s"] = time.time() - started
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
