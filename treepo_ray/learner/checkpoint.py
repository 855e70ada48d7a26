"""Checkpoints: writing and reading one, and the checkpoint folders of a run (naming, newest, pruning).

A checkpoint folder holds the model as a Hugging Face directory (weights + tokenizer, loadable by path), the
optimizer state (`optimizer.pt`, or DeepSpeed's per-rank partitions under `deepspeed/`), `learner_state.json`
(optimizer steps, world size, optimizer-state format, learner config), one `rng_rank<r>.json` per rank, and last the
completion marker `treepo_trainer_state.json` (the caller's trainer state). With LoRA (learner.lora_rank > 0) the
model is the adapter instead, as peft's save_pretrained writes it (`adapter_model.safetensors`,
`adapter_config.json`: PeftModel.from_pretrained loads it on the base model), and with learner.save_merged also the
merged model under `merged/`; resuming loads the adapter onto the base model the learner was built from. The
marker's name is the project's own: a run directory may also hold other tools' `checkpoint-N` folders (the Hugging
Face Trainer's carry its own `trainer_state.json`), which are never listed, resumed or pruned here. Checkpoints
written before the marker was renamed carry `trainer_state.json`; that counts as the marker only beside
`learner_state.json`, a file no other tool writes.

Run directories live in run storage (treepo_ray/storage.py: a local or shared path, or an object store URI), so a
learner rank on any node writes where the driver lists, prunes and restores. A run directory holds
`checkpoint-00000012/`-style folders, one per saved step. A folder is written whole before it counts: on a file
system under a hidden temporary name, fsynced, then renamed into place; on an object store uploaded file by file
with the marker last. A crash or a full disk leaves at worst a stale temporary folder or a folder without its marker
(ignored, and deleted by the next pruning), never a half-written checkpoint that a restore would take. A complete
checkpoint that cannot be read any more (a file lost or damaged later) is passed over by `latest_checkpoint`, which
falls back to the one before it and says so.

Nothing is unpickled: tensors load with `torch.load(weights_only=True)` and the RNG states are JSON.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from treepo_ray import storage
from treepo_ray.learner.config import LearnerConfig
from treepo_ray.learner.export import (adapter_state_dict, from_adapter_state_dict, lora_layers, merged_state_dict,
                                       peft_lora_config)
from treepo_ray.learner.strategy import FULL_OPTIMIZER_STATE, Strategy

PREFIX = "checkpoint-"
COMPLETE_MARKER = "treepo_trainer_state.json"
LEGACY_MARKER = "trainer_state.json"  # the marker before 12/2026; also the Hugging Face Trainer's file name
LEARNER_STATE = "learner_state.json"
OPTIMIZER_FILE = "optimizer.pt"  # full (unsharded) AdamW state, keyed by parameter name (tensors only)
DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "zero"  # DeepSpeed's own per-rank optimizer partitions
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"  # LoRA: peft's adapter files
MERGED_DIR = "merged"  # LoRA with learner.save_merged: the merged model, a Hugging Face directory
_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def checkpoint_dir(run_dir: str | Path, step: int) -> str:
    """Where the checkpoint of `step` lives inside `run_dir` (a path or a storage URI)."""
    if step < 0:
        raise ValueError(f"step = {step}; it must be >= 0")
    return storage.join(run_dir, f"{PREFIX}{step:08d}")


def marker_of(location: str | Path) -> str | None:
    """The completion marker of the checkpoint folder `location` (None: not a complete checkpoint of this project)."""
    names = set(storage.list_names(str(location)))
    if COMPLETE_MARKER in names:
        return COMPLETE_MARKER
    return LEGACY_MARKER if {LEGACY_MARKER, LEARNER_STATE} <= names else None


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, str]]:
    """Complete checkpoints of this project in `run_dir` as (step, location), oldest first."""
    found = []
    for name in storage.list_names(str(run_dir)):
        m = _NAME.match(name)
        if m and marker_of(storage.join(run_dir, name)) is not None:
            found.append((int(m.group(1)), storage.join(run_dir, name)))
    return sorted(found)


def unreadable_reason(location: str | Path) -> str | None:
    """Why the complete checkpoint `location` cannot be restored (None: it looks whole): its marker or learner state
    does not parse, or a file the restore reads is missing. Checked on the driver, before a learner is asked."""
    location = str(location)
    try:
        marker = marker_of(location)
        if marker is None:
            return "it has no completion marker"
        if not isinstance(json.loads(storage.read_text(storage.join(location, marker))), dict):
            return f"its {marker} is not a JSON object"
        state = json.loads(storage.read_text(storage.join(location, LEARNER_STATE)))
        names = set(storage.list_names(location))
        if state.get("optimizer_format", FULL_OPTIMIZER_STATE) != FULL_OPTIMIZER_STATE:
            needs = [DEEPSPEED_DIR]
        elif state.get("lora"):
            needs = [ADAPTER_FILE, ADAPTER_CONFIG, OPTIMIZER_FILE]
        else:
            sharded = "model.safetensors.index.json" in names
            needs = ["model.safetensors.index.json" if sharded else "model.safetensors", "config.json", OPTIMIZER_FILE]
        missing = [name for name in needs if name not in names]
        return f"{', '.join(missing)} missing" if missing else None
    except (OSError, ValueError, AttributeError) as err:  # unreadable, not JSON (json's errors are ValueErrors)
        return f"{type(err).__name__}: {err}"


def latest_checkpoint(run_dir: str | Path, before: int | None = None) -> str | None:
    """The newest complete checkpoint in `run_dir` (of a step below `before`, when given) that can be read, or None.
    Each newer one that cannot be read is passed over, with a line saying why."""
    for step, location in reversed(list_checkpoints(run_dir)):
        if before is not None and step >= before:
            continue
        why = unreadable_reason(location)
        if why is None:
            return location
        print(f"checkpoint {location} cannot be read ({why}): falling back to the one before it", flush=True)
    return None


def step_of(location: str | Path) -> int:
    """The step of a checkpoint folder, from its name."""
    m = _NAME.match(storage.name_of(location))
    if m is None:
        raise ValueError(f"{location} is not named {PREFIX}<step>")
    return int(m.group(1))


def _ours_unfinished(run_dir: str | Path, name: str) -> bool:
    """A folder this project began to write and did not finish: its staging or replaced folder, or a folder named
    as `checkpoint_dir` names them with no marker (and no other tool's trainer_state.json)."""
    if name.startswith(f".{PREFIX}") and name.endswith((".tmp", ".old")):
        return True
    m = _NAME.match(name)
    if m is None or name != f"{PREFIX}{int(m.group(1)):08d}":
        return False
    names = set(storage.list_names(storage.join(run_dir, name)))
    return COMPLETE_MARKER not in names and LEGACY_MARKER not in names


def prune_checkpoints(run_dir: str | Path, keep: int) -> list[str]:
    """Delete all but the newest `keep` checkpoints, and this project's unfinished ones (a write that was cut off:
    a stale staging folder, a folder without its marker); return what was deleted. Other tools' folders are left
    alone. Only the run that holds the run directory's lock calls it, after its own save, so nothing deleted here
    is being written."""
    if keep < 1:
        raise ValueError(f"keep = {keep}; at least the newest checkpoint must be kept")
    removed = [loc for _, loc in list_checkpoints(run_dir)[:-keep]]
    removed += [storage.join(run_dir, name) for name in storage.list_names(str(run_dir))
                if _ours_unfinished(run_dir, name)]
    for loc in removed:
        storage.delete_dir(loc)
    return removed


# ---------------------------------------------------------------------------------------------- one checkpoint


def write_checkpoint(final: str | Path, trainer_state: dict, *, strategy: Strategy, model: PreTrainedModel,
                     tokenizer: Any, optimizer_steps: int, config: LearnerConfig) -> str:
    """Write `model`'s weights + `tokenizer`, the optimizer state, learner and trainer state, and every rank's RNG
    state to `final` (a path or a storage URI), atomically and durably. Raises RuntimeError, leaving any older
    checkpoint intact, when the write fails. Call on all ranks."""
    final = str(final)
    try:
        trainer_json = json.dumps(trainer_state, indent=2)
    except (TypeError, ValueError) as err:
        raise ValueError(f"trainer_state is not JSON-serialisable: {err}") from err
    full_optimizer = strategy.optimizer_format == FULL_OPTIMIZER_STATE
    weights = strategy.export_weights()  # collective on FSDP2
    layers = lora_layers(model)
    optim = strategy.full_optimizer_state() if full_optimizer else None
    # A file system: one staging folder beside `final` that every rank writes into (through the shared mount).
    # An object store: a local folder per rank, each uploading its own files.
    staging = storage.staging_dir(final)

    def write_rank0() -> None:
        if not storage.is_uri(final):
            shutil.rmtree(staging, ignore_errors=True)  # a write of this step that was cut off
        else:
            storage.delete_dir(final)  # its marker first of all: the folder stops counting before it changes
        staging.mkdir(parents=True, exist_ok=True)
        if layers:  # LoRA: the adapter as peft's save_pretrained writes it; the base model stays where it was read
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in adapter_state_dict(weights).items()}, staging / ADAPTER_FILE,
                      metadata={"format": "pt"})
            base = getattr(model, "name_or_path", None) or None
            peft_lora_config(config.lora_rank, config.lora_alpha, config.peft_target_modules,
                             base).save_pretrained(staging)
            if config.save_merged:
                model.save_pretrained(staging / MERGED_DIR, state_dict=merged_state_dict(weights, layers))
                if tokenizer is not None:
                    tokenizer.save_pretrained(staging / MERGED_DIR)
        else:
            model.save_pretrained(staging, state_dict=weights)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        if optim is not None:
            torch.save(optim, staging / OPTIMIZER_FILE)
        state = {"optimizer_steps": optimizer_steps, "world_size": strategy.world_size,
                 "optimizer_format": strategy.optimizer_format, "lora": bool(layers),
                 "learner_config": dataclasses.asdict(config)}
        (staging / LEARNER_STATE).write_text(json.dumps(state, indent=2))

    def write_rng() -> None:
        (staging / f"rng_rank{strategy.rank}.json").write_text(json.dumps(_rng_state()))

    error = strategy.first_error(_guard(write_rank0) if strategy.rank == 0 else "")
    if not error and not full_optimizer:  # DeepSpeedZeRO: every rank writes its own partition
        error = strategy.first_error(_guard(lambda: strategy.save_partitions(staging / DEEPSPEED_DIR, DEEPSPEED_TAG)))
    if not error:
        error = strategy.first_error(_guard(write_rng))
    if not error:  # every rank's files durable (fsynced, or uploaded) before the marker
        error = strategy.first_error(_guard(lambda: storage.push(staging, final)))
    if not error and strategy.rank == 0:
        # The marker file goes last: a folder without it is never taken for a checkpoint.
        error = _guard(lambda: storage.commit(staging, final, COMPLETE_MARKER, trainer_json))
    error = strategy.first_error(error)
    if storage.is_uri(final) or (error and strategy.rank == 0):
        shutil.rmtree(staging, ignore_errors=True)
    if error:
        raise RuntimeError(f"could not write checkpoint {final}: {error}; the previous checkpoint is untouched")
    return final


def read_checkpoint(directory: str | Path, *, strategy: Strategy, config: LearnerConfig) -> tuple[int, dict]:
    """Restore weights and optimizer state (through `strategy`) and this rank's RNG from `directory` (a path or a
    storage URI); return (optimizer steps, trainer_state). Call on all ranks. A checkpoint with full optimizer state (FSDP2
    or one process) resumes at any world size (RNG then restarts from the seed); a DeepSpeed one only under
    DeepSpeed at its own world size."""
    directory = str(directory)
    marker = marker_of(directory)
    if marker is None:
        raise FileNotFoundError(f"{directory} is not a complete checkpoint (no {COMPLETE_MARKER})")
    learner_state = json.loads(storage.read_text(storage.join(directory, LEARNER_STATE)))
    fmt, saved_ws = learner_state.get("optimizer_format", FULL_OPTIMIZER_STATE), learner_state["world_size"]
    want, world_size = strategy.optimizer_format, strategy.world_size
    partitioned = want != FULL_OPTIMIZER_STATE  # DeepSpeed's partitions fit only the world size that wrote them
    if fmt != want or (partitioned and saved_ws != world_size):
        raise ValueError(f"{directory} holds {fmt!r} optimizer state from world size {saved_ws}; this learner "
                         f"(strategy {config.strategy!r}, world size {world_size}) needs {want!r}"
                         + (" at the same world size" if partitioned else ""))
    lora = bool(learner_state.get("lora"))
    if lora != config.lora:
        raise ValueError(f"{directory} holds {'a LoRA adapter' if lora else 'a fully fine-tuned model'}; this "
                         f"learner has lora_rank = {config.lora_rank}: resume with the same model.lora_rank (or "
                         "load the merged model as model.path)")
    rng_name = f"rng_rank{strategy.rank}.json"
    # From an object store each rank fetches only what it reads: rank 0 the model and optimizer.
    wanted = [DEEPSPEED_DIR, rng_name] if partitioned else (None if strategy.rank == 0 else [rng_name])
    local, temporary = storage.local_copy(directory, wanted)
    try:
        if partitioned:  # DeepSpeedZeRO: weights and optimizer state from DeepSpeed's own files
            strategy.load_partitions(local / DEEPSPEED_DIR, DEEPSPEED_TAG)
        else:
            weights: dict[str, torch.Tensor] = {}
            optim: dict = {}
            if lora:  # the base weights as loaded (gathered: collective on FSDP2), the adapter from the checkpoint
                weights = strategy.export_weights()
            if strategy.rank == 0:
                if lora:
                    from safetensors.torch import load_file

                    adapter = from_adapter_state_dict(load_file(local / ADAPTER_FILE))
                    unknown = sorted(set(adapter) - set(weights))
                    if unknown:
                        raise ValueError(f"{directory}: adapter tensors {unknown[:3]} do not fit this model's LoRA "
                                         f"layers (lora_rank / target_modules differ?)")
                    weights.update(adapter)
                else:
                    weights = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).state_dict()
                optim = torch.load(local / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
            strategy.load_full_state(weights, optim)
        steps = int(learner_state.get("optimizer_steps", learner_state.get("version", 0)))  # "version" before 12/2026
        rng_file = local / rng_name
        if rng_file.is_file():
            _set_rng_state(json.loads(rng_file.read_text()))
        else:  # another world size wrote it (or a checkpoint from before RNG files were JSON)
            torch.manual_seed(config.seed + strategy.rank + steps)
    finally:
        if temporary:
            shutil.rmtree(local, ignore_errors=True)
    return steps, json.loads(storage.read_text(storage.join(directory, marker)))


def _rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON-able lists (no pickle in checkpoints)."""
    py_version, py_internal, py_gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": [py_version, list(py_internal), py_gauss],
             "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py_version, py_internal, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_internal), py_gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _guard(fn: Callable[[], Any]) -> str:
    """Run `fn`; return its error as text ("" when it succeeded), so that ranks can agree before raising."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - e.g. safetensors' own error on a full disk; ranks must agree
        return f"{type(err).__name__}: {err}"
    return ""
