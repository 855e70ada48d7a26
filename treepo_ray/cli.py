"""`treepo-ray COMMAND ...`: each command is the `main(argv)` of the module that owns it."""

from __future__ import annotations

import importlib
import sys

from treepo_ray.config import UserError
from treepo_ray.job.faults import RunStopped

COMMANDS = {
    "train": ("treepo_ray.runtime.train", "RL training job (default: local Ray, CPU, tiny model, TreePO); "
                                          "`train --print-config` shows every key"),
    "eval": ("treepo_ray.job.evaluate", "Pass@1 / Major@k / pass@k of a model on a dataset (the train's config keys)"),
    "bench": ("treepo_ray.benchmarks.engine", "tree vs sequential sampling on one engine; `bench NAME ...` runs "
                                              "another benchmark (`bench --help` lists them)"),
    "pretrain": ("treepo_ray.data.pretrain", "build and pretrain the tiny base model on the synthetic task"),
    "data": ("treepo_ray.data.verl_format", "write GSM8K or MATH in verl's parquet layout from a local file or a "
                                            "Hugging Face datasets cache folder"),
    "viz": ("treepo_ray.job.viz", "render a run's saved trees as a self-contained HTML page"),
    "compare": ("treepo_ray.benchmarks.compare", "algorithms side by side: held-out accuracy against wall time and "
                                                 "sampled tokens, same budget each (default grpo, dapo, treepo)"),
}
BENCHMARKS = {
    "engine": ("treepo_ray.benchmarks.engine", "tree vs sequential sampling on one engine (plain `bench`)"),
    "stream": ("treepo_ray.benchmarks.stream", "tree vs sequential rollout throughput as training sees it, one engine"),
    "chaos": ("treepo_ray.benchmarks.chaos", "the same seeded run without and with actors killed"),
    "overlap": ("treepo_ray.benchmarks.overlap", "time per step with max_staleness 0 and 1"),
    "catpo": ("treepo_ray.benchmarks.catpo", "CATPO against TreeRPO at equal sampled tokens"),
    "learner": ("treepo_ray.benchmarks.learner", "a learner step tree-packed vs one row per trajectory"),
    "verifier": ("treepo_ray.benchmarks.verifier", "the math verifier's accuracy and time per answer form"),
    "elastic": ("treepo_ray.benchmarks.elastic", "the engine pool scaled by its policy on a local autoscaler"),
}


def usage() -> str:
    lines = ["usage: treepo-ray COMMAND [args ...]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`treepo-ray COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def bench_usage() -> str:
    lines = ["usage: treepo-ray bench [NAME] [args ...]", "", "benchmarks:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in BENCHMARKS.items()]
    lines += ["", "`treepo-ray bench NAME --help` shows a benchmark's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"treepo-ray: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    if name == "bench" and rest and rest[0] in ("-h", "--help"):
        print(bench_usage())
        return 0
    if name == "bench" and rest and rest[0] in BENCHMARKS:  # `bench NAME ...`; plain `bench` is the engine's
        module_name, rest = BENCHMARKS[rest[0]][0], rest[1:]
    module = importlib.import_module(module_name)
    try:
        return int(module.main(rest) or 0)
    except UserError as err:  # a bad key, path or row: one line, never a traceback
        print(f"treepo-ray {name}: {err}", file=sys.stderr)
        return 2
    except RunStopped as err:  # an actor lost past its recovery, a deadline passed: one line naming it
        print(f"treepo-ray {name}: stopped: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
