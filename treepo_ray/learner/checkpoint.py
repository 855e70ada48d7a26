"""Checkpoints: writing and reading one, and the checkpoint folders of a run (naming, newest, pruning).

A checkpoint folder holds the model as a Hugging Face directory (weights + tokenizer, loadable by path), the
optimizer state (`optimizer.pt`, or DeepSpeed's per-rank partitions under `deepspeed/`), `learner_state.json`
(version, world size, optimizer-state format, learner config), one `rng_rank<r>.pt` per rank, and last the
completion marker `trainer_state.json` (the caller's trainer state).

A run directory holds `checkpoint-00000012/`-style folders, one per saved step. A folder is written under a hidden
temporary name and renamed into place only when complete, so a crash or a full disk leaves at worst a stale
temporary folder (ignored and cleaned up later), never a half-written checkpoint under a real name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from treepo_ray.learner.config import LearnerConfig
from treepo_ray.learner.strategy import FULL_OPTIMIZER_STATE, Strategy

PREFIX = "checkpoint-"
COMPLETE_MARKER = "trainer_state.json"
LEARNER_STATE = "learner_state.json"
OPTIMIZER_FILE = "optimizer.pt"  # full (unsharded) AdamW state, keyed by parameter name
DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "zero"  # DeepSpeed's own per-rank optimizer partitions
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


# ---------------------------------------------------------------------------------------------- one checkpoint


def write_checkpoint(final: str | Path, trainer_state: dict, *, strategy: Strategy, model: PreTrainedModel,
                     tokenizer: Any, version: int, config: LearnerConfig) -> Path:
    """Write `model`'s weights + `tokenizer`, the optimizer state, learner and trainer state, and every rank's RNG
    state to `final`, atomically. Raises RuntimeError, leaving any older checkpoint intact, when the write fails.
    Call on all ranks."""
    final = Path(final)
    tmp = temp_dir_for(final)
    try:
        trainer_json = json.dumps(trainer_state, indent=2)
    except (TypeError, ValueError) as err:
        raise ValueError(f"trainer_state is not JSON-serialisable: {err}") from err
    full_optimizer = strategy.optimizer_format == FULL_OPTIMIZER_STATE
    weights = strategy.export_weights()  # collective on FSDP2
    optim = strategy.full_optimizer_state() if full_optimizer else None

    def write_rank0() -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if optim is not None:
            torch.save(optim, tmp / OPTIMIZER_FILE)
        state = {"version": version, "world_size": strategy.world_size,
                 "optimizer_format": strategy.optimizer_format, "learner_config": dataclasses.asdict(config)}
        (tmp / LEARNER_STATE).write_text(json.dumps(state, indent=2))

    def finish() -> None:
        # The marker file goes last: a folder without it is never taken for a checkpoint.
        (tmp / COMPLETE_MARKER).write_text(trainer_json)
        commit_dir(tmp, final)

    error = _guard(write_rank0) if strategy.rank == 0 else ""
    error = strategy.first_error(error)
    if not error and not full_optimizer:  # DeepSpeedZeRO: every rank writes its own partition
        error = strategy.first_error(_guard(lambda: strategy.save_partitions(tmp / DEEPSPEED_DIR, DEEPSPEED_TAG)))
    if not error:
        rng_file = tmp / f"rng_rank{strategy.rank}.pt"
        error = strategy.first_error(_guard(lambda: torch.save(_rng_state(), rng_file)))
    if not error and strategy.rank == 0:
        error = _guard(finish)
    error = strategy.first_error(error)
    if error:
        if strategy.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"could not write checkpoint {final}: {error}; the previous checkpoint is untouched")
    return final


def read_checkpoint(directory: str | Path, *, strategy: Strategy, config: LearnerConfig) -> tuple[int, dict]:
    """Restore weights and optimizer state (through `strategy`) and this rank's RNG from `directory`; return
    (version, trainer_state). Call on all ranks. A checkpoint with full optimizer state (FSDP2 or one process)
    resumes at any world size (RNG then restarts from the seed); a DeepSpeed one only under DeepSpeed at its own
    world size."""
    directory = Path(directory)
    if not (directory / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"{directory} is not a complete checkpoint (no {COMPLETE_MARKER})")
    learner_state = json.loads((directory / LEARNER_STATE).read_text())
    fmt, saved_ws = learner_state.get("optimizer_format", FULL_OPTIMIZER_STATE), learner_state["world_size"]
    want, world_size = strategy.optimizer_format, strategy.world_size
    partitioned = want != FULL_OPTIMIZER_STATE  # DeepSpeed's partitions fit only the world size that wrote them
    if fmt != want or (partitioned and saved_ws != world_size):
        raise ValueError(f"{directory} holds {fmt!r} optimizer state from world size {saved_ws}; this learner "
                         f"(strategy {config.strategy!r}, world size {world_size}) needs {want!r}"
                         + (" at the same world size" if partitioned else ""))
    if partitioned:  # DeepSpeedZeRO: weights and optimizer state from DeepSpeed's own files
        strategy.load_partitions(directory / DEEPSPEED_DIR, DEEPSPEED_TAG)
    else:
        weights: dict[str, torch.Tensor] = {}
        optim: dict = {}
        if strategy.rank == 0:
            weights = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
            optim = torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        strategy.load_full_state(weights, optim)
    version = int(learner_state["version"])
    rng_file = directory / f"rng_rank{strategy.rank}.pt"
    if rng_file.is_file():
        rng = torch.load(rng_file, weights_only=False)  # our own file: holds Python/numpy RNG tuples
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    else:
        torch.manual_seed(config.seed + strategy.rank + version)
    return version, json.loads((directory / COMPLETE_MARKER).read_text())


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _guard(fn: Callable[[], Any]) -> str:
    """Run `fn`; return its error as text ("" when it succeeded), so that ranks can agree before raising."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - e.g. safetensors' own error on a full disk; ranks must agree
        return f"{type(err).__name__}: {err}"
    return ""
