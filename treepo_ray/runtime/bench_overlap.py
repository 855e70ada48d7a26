"""Does overlapping rollout and learning pay? Time per training step with max_staleness = 0 and = 1.

    python -m treepo_ray.runtime.bench_overlap [config.yaml] [--steps N] [--rounds R] [--json PATH] [key=value ...]

Both modes run in one invocation on one pipeline (the same actors, model, data), with one engine and one learner
rank that each reserve one CPU and use one torch thread, so what differs is only whether the generation of batch
k+1 overlaps the learner's step on batch k. The modes alternate in `rounds` chunks of `steps` steps each, so a
change in the machine's background load hits both alike. A step's time is the wall time between two finished
training steps; the first step of a chunk is left out (it can never overlap), and each mode reports the median
over its remaining steps. The synchronous loop costs about generation + learning per step, the overlapped one
about the larger of the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from treepo_ray.runtime.config import DEFAULT_CONFIG, TrainConfig, load_config

# One core per side: overlap, not extra hardware, is what is measured.
FAIR = ["runtime.num_engines=1", "runtime.engine_cpus=1", "runtime.learner_ranks=1", "runtime.learner_cpus=1",
        "runtime.torch_threads=1", "runtime.engine_gpus=0", "runtime.learner_gpus=0", "runtime.num_schedulers=1"]
STAGES = ("time/step", "time/rollout", "time/train", "time/wait")


def summarise(rows: list[dict], staleness: int) -> dict:
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"max_staleness": staleness, "timed_steps": len(rows), "step_s": med("time/step"),
            "rollout_s": med("time/rollout"), "train_s": med("time/train"), "wait_s": med("time/wait"),
            "staleness_mean": sum(r["perf/staleness"] for r in rows) / len(rows),
            "step_s_all": [round(r["time/step"], 4) for r in rows]}


def run(cfg: TrainConfig, steps: int, rounds: int) -> dict:
    from transformers import AutoTokenizer

    from treepo_ray.runtime.pipeline import Pipeline, PromptStream
    from treepo_ray.runtime.train import init_ray, load_task, resolve_model

    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    records, _ = load_task(cfg, tokenizer)
    init_ray(cfg)
    pipe = Pipeline(cfg, model_path, tokenizer)
    stream = PromptStream(records, cfg.trainer.seed)
    timed: dict[int, list[dict]] = {0: [], 1: []}
    done = 0
    try:
        for _ in range(rounds):
            for s in (0, 1):
                rows: list[dict] = []
                done = pipe.train(done, done + steps, stream, lambda batch, m: rows.append(m) or True,
                                  max_staleness=s)
                timed[s] += rows[1:]  # the chunk's first step cannot overlap anything
    finally:
        pipe.shutdown()
    sync, overlapped = summarise(timed[0], 0), summarise(timed[1], 1)
    for m in (sync, overlapped):
        print(f"max_staleness={m['max_staleness']}: {m['step_s']:.3f} s/step (median of {m['timed_steps']}; "
              f"rollout {m['rollout_s']:.3f} s, learner {m['train_s']:.3f} s, learner waiting {m['wait_s']:.3f} s)")
    ratio = overlapped["step_s"] / sync["step_s"]
    print(f"overlap: time per step with max_staleness=1 is {ratio:.3f} of max_staleness=0")
    return {"synchronous": sync, "overlapped": overlapped, "ratio": ratio, "algorithm": cfg.algo.name,
            "steps_per_chunk": steps, "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m treepo_ray.runtime.bench_overlap",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="YAML config (default: jobs/configs/cpu.yaml)")
    ap.add_argument("--steps", type=int, default=6, help="training steps per chunk (the first is not timed)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two modes")
    ap.add_argument("--json", default=None, help="write the result here as JSON")
    args, overrides = ap.parse_known_args(argv)
    if "=" in args.config:
        overrides, args.config = [args.config, *overrides], str(DEFAULT_CONFIG)
    if args.steps < 2 or args.rounds < 1:
        ap.error("--steps must be >= 2 and --rounds >= 1")
    try:
        cfg = load_config(args.config, overrides + FAIR)
    except ValueError as err:
        print(f"bench_overlap: {err}", file=sys.stderr)
        return 2
    started = time.time()
    result = run(cfg, args.steps, args.rounds)
    result["wall_s"] = time.time() - started
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
