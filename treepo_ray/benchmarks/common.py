"""What the benchmarks that run the training job share: their command line (a config file, dotted overrides and
--json, like `treepo-ray train`) and writing the result."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

from treepo_ray.job.config import DEFAULT_CONFIG, TrainConfig, load_config, resolve_config


def parse_job_args(argv: list[str] | None, name: str, doc: str, add_args: Callable[[argparse.ArgumentParser], None],
                   default_config: Path = DEFAULT_CONFIG, before: list[str] = (), after: list[str] = ()
                   ) -> tuple[argparse.Namespace, TrainConfig] | int:
    """`treepo-ray bench NAME [config.yaml] [--flags] [key=value ...]`: the parsed flags and the job's config
    (`before` goes under the user's overrides, `after` over them), or exit status 2 after a one-line error."""
    ap = argparse.ArgumentParser(allow_abbrev=False, prog=f"treepo-ray bench {name}", description=doc.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(default_config),
                    help=f"YAML config, a path or a packaged config's name (default: {Path(default_config).stem})")
    ap.add_argument("--json", default=None, help="write the result here as JSON")
    add_args(ap)
    args, overrides = ap.parse_known_args(argv)
    flags = [a for a in overrides if a.startswith("-")]
    if flags:  # no abbreviations: an unknown or shortened --flag is an error, never a config key
        print(f"treepo-ray bench {name}: unknown option {flags[0]!r} (`treepo-ray bench {name} --help`)",
              file=sys.stderr)
        return 2
    if "=" in args.config:
        overrides, args.config = [args.config, *overrides], str(default_config)
    args.overrides = overrides
    try:
        return args, load_config(resolve_config(args.config), [*before, *overrides, *after])
    except ValueError as err:
        print(f"treepo-ray bench {name}: {err}", file=sys.stderr)
        return 2


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(result, indent=2))
