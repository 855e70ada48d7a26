"""Checkpoint directories of a run: naming, finding the newest, pruning, and atomic replacement.

A run directory holds `checkpoint-00000012/`-style folders, one per saved step. A folder is written under a hidden
temporary name and renamed into place only when complete, so a crash or a full disk leaves at worst a stale
temporary folder (ignored and cleaned up later), never a half-written checkpoint under a real name.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

PREFIX = "checkpoint-"
COMPLETE_MARKER = "trainer_state.json"
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """Where the checkpoint of `step` lives inside `run_dir`."""
    if step < 0:
        raise ValueError(f"step = {step}; it must be >= 0")
    return Path(run_dir) / f"{PREFIX}{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `run_dir` as (step, path), oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        m = _NAME.match(child.name)
        if m and child.is_dir() and (child / COMPLETE_MARKER).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in `run_dir`, or None when there is none."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (and stale temporary folders); return what was deleted."""
    if keep < 1:
        raise ValueError(f"keep = {keep}; at least the newest checkpoint must be kept")
    removed = [path for _, path in list_checkpoints(run_dir)[:-keep]]
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        removed += [c for c in run_dir.iterdir() if c.name.startswith(f".{PREFIX}") and c.is_dir()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def temp_dir_for(final: Path) -> Path:
    """The hidden sibling a checkpoint is written into before being renamed to `final`."""
    return final.parent / f".{final.name}.tmp"


def commit_dir(tmp: Path, final: Path) -> None:
    """Move the completed `tmp` folder to `final`, replacing an older `final` only after the new one is whole."""
    old = final.parent / f".{final.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
