"""`treepo-ray COMMAND ...`: each command is the `main(argv)` of the module that owns it."""

from __future__ import annotations

import importlib
import sys

from treepo_ray.config import UserError
from treepo_ray.job.faults import RunStopped

COMMANDS = {
    "train": ("treepo_ray.runtime.train", "RL training job (default: local Ray, CPU, tiny model, TreePO)"),
    "eval": ("treepo_ray.job.evaluate", "Pass@1 / Major@k / pass@k of a model on a dataset (the train's config keys)"),
    "bench": ("treepo_ray.benchmarks.engine", "tree vs sequential sampling on one engine; `bench NAME ...` runs "
                                              "another benchmark (stream, learner, chaos, overlap, catpo, verifier)"),
    "pretrain": ("treepo_ray.data.pretrain", "build and pretrain the tiny base model on the synthetic task"),
    "viz": ("treepo_ray.job.viz", "render a run's saved trees as a self-contained HTML page"),
    "compare": ("treepo_ray.benchmarks.compare", "algorithms side by side: held-out accuracy against wall time and "
                                                 "sampled tokens, same budget each (default grpo, dapo, treepo)"),
}
BENCHMARKS = {
    "engine": "treepo_ray.benchmarks.engine",
    "stream": "treepo_ray.benchmarks.stream",
    "chaos": "treepo_ray.benchmarks.chaos",
    "overlap": "treepo_ray.benchmarks.overlap",
    "catpo": "treepo_ray.benchmarks.catpo",
    "learner": "treepo_ray.benchmarks.learner",
    "verifier": "treepo_ray.benchmarks.verifier",
}


def usage() -> str:
    lines = ["usage: treepo-ray COMMAND [args ...]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`treepo-ray COMMAND --help` shows a command's options."]
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
    if name == "bench" and rest and rest[0] in BENCHMARKS:  # `bench NAME ...`; plain `bench` is the engine's
        module_name, rest = BENCHMARKS[rest[0]], rest[1:]
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
