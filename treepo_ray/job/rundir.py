"""The run directory in run storage: which run it is, who holds it, which run `resume=auto` continues, and the
batches that were waiting for the learner when a checkpoint was taken.

    <storage_path>/<algo>-<YYYYmmdd-HHMMSS>/      (or trainer.run_dir: a path or a storage URI)
        run.lock            the holder (host, pid, run, heartbeat); a second run refuses the directory
        run.json            the run's name, creation time and W&B run id (a resumed run continues that W&B run)
        config.yaml         the config the run was started with (resume=auto compares against it)
        checkpoint-<step>/  learner/checkpoint.py
        pending-<step>.json.gz
                            the trees of the batches waiting in the staleness queue at that checkpoint: a resumed
                            run trains them first instead of growing them again with newer weights
        metrics.jsonl, trees.jsonl, summary.json, training_curve.png, wandb/   (job/logs.py)

On an object store the logs are written to a local folder and uploaded with each checkpoint (`LogMirror`).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from treepo_ray import config as config_io
from treepo_ray import storage
from treepo_ray.learner.checkpoint import latest_checkpoint, list_checkpoints, prune_checkpoints

LOCK, RUN_RECORD, CONFIG = "run.lock", "run.json", "config.yaml"
_PENDING = re.compile(r"^pending-(\d+)\.json\.gz$")

# What makes two configs one run: a checkpoint continues only under the same task, model, sampling, credit, loss and
# seeds. Anything else (steps, resources, logging, evaluation, learning rate) may change when a run is resumed.
IDENTITY = ("algo", "model.path", "data", "rollout", "learner.loss", "learner.strategy", "trainer.seed",
            "trainer.prompts_per_step")


class RunDirError(config_io.UserError):
    """The run directory cannot be used as asked (a user error: one line and exit status 2, no traceback)."""


class RunLocked(RunDirError):
    """The run directory is held by another live run."""


# ---------------------------------------------------------------------------------------------- the lock


def _alive_here(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_reason(holder: dict, stale_s: float, now: float | None = None) -> str | None:
    """Why a lock's holder is gone ('' never; None while it may be alive): its process on this host has exited,
    or its heartbeat is older than `stale_s` (the only sign left of a holder on another host)."""
    now = time.time() if now is None else now
    if holder.get("host") == socket.gethostname() and not _alive_here(int(holder.get("pid", -1))):
        return f"its process {holder.get('pid')} on this host has exited"
    age = now - float(holder.get("heartbeat", 0))
    if age > stale_s:
        return f"its last heartbeat was {age:.0f}s ago (trainer.lock_stale_s = {stale_s:g})"
    return None


class RunLock:
    """The lock of one run directory, held by this process while it trains there. A thread renews its heartbeat
    every `stale_s / 4`; if another run took the lock over meanwhile (this one looked dead), `lost` says so."""

    def __init__(self, run_dir: str, run: str, stale_s: float):
        self.path, self.stale_s = storage.join(run_dir, LOCK), stale_s
        self.info = {"host": socket.gethostname(), "pid": os.getpid(), "run": run, "token": uuid.uuid4().hex,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "heartbeat": time.time()}
        self.lost = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> "RunLock":
        """Take the lock, or raise RunLocked naming its live holder. A dead holder's lock is taken over (said so)."""
        for _ in range(3):
            if storage.create_exclusive(self.path, json.dumps(self.info)):
                self._thread = threading.Thread(target=self._beat, name="run-lock", daemon=True)
                self._thread.start()
                return self
            try:
                holder = json.loads(storage.read_text(self.path))
            except (FileNotFoundError, json.JSONDecodeError):  # released meanwhile, or being written: try again
                time.sleep(0.2)
                continue
            why = stale_reason(holder, self.stale_s)
            if why is None:
                raise RunLocked(f"{storage.parent_of(self.path)} is in use by run {holder.get('run')!r} (host "
                                f"{holder.get('host')}, pid {holder.get('pid')}, since {holder.get('started')}); "
                                "choose another trainer.run_dir, or stop that run first")
            print(f"taking over the lock of {storage.parent_of(self.path)} from run {holder.get('run')!r} "
                  f"(host {holder.get('host')}, pid {holder.get('pid')}): {why}", flush=True)
            storage.delete(self.path)
        raise RunLocked(f"could not take the lock {self.path}: other runs keep taking it")

    def _holder(self) -> dict:
        try:
            return json.loads(storage.read_text(self.path))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def _beat(self) -> None:
        while not self._stop.wait(self.stale_s / 4):
            try:
                holder = self._holder()
                if holder.get("token") != self.info["token"]:
                    self.lost = (f"the lock of {storage.parent_of(self.path)} was taken over by run "
                                 f"{holder.get('run')!r} (host {holder.get('host')}, pid {holder.get('pid')})")
                    return
                self.info["heartbeat"] = time.time()
                storage.write_text(self.path, json.dumps(self.info))
            except OSError as err:  # storage hiccup: the next beat tries again
                print(f"run lock heartbeat failed: {err}", flush=True)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._holder().get("token") == self.info["token"]:
            storage.delete(self.path)


# ---------------------------------------------------------------------------------------------- run identity


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def config_changes(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """(breaking, other): the settings that differ between two config dicts, as 'key: old -> new'. Breaking ones
    are under IDENTITY: a checkpoint of `saved` cannot be continued under `current`."""
    a, b = _flat(saved), _flat(current)
    breaking, other = [], []
    for key in sorted(set(a) | set(b)):
        if a.get(key) != b.get(key):
            line = f"{key}: {a.get(key)!r} -> {b.get(key)!r}"
            identity = any(key == k or key.startswith(k + ".") for k in IDENTITY)
            (breaking if identity else other).append(line)
    return breaking, other


def saved_config(run_dir: str) -> dict | None:
    where = storage.join(run_dir, CONFIG)
    return yaml.safe_load(storage.read_text(where)) if storage.exists(where) else None


@dataclass
class RunRecord:
    """run.json: what identifies a run across restarts of its driver."""

    name: str
    created: str
    wandb_id: str

    @classmethod
    def load_or_create(cls, run_dir: str) -> "RunRecord":
        where = storage.join(run_dir, RUN_RECORD)
        if storage.exists(where):
            return cls(**json.loads(storage.read_text(where)))
        record = cls(storage.name_of(run_dir), time.strftime("%Y-%m-%d %H:%M:%S"), uuid.uuid4().hex[:12])
        storage.write_text(where, json.dumps(record.__dict__, indent=2))
        return record


def write_config(run_dir: str, cfg_dict: dict, resume_from: str | None, step: int) -> str:
    """Write this attempt's resolved config as `<run_dir>/configs/attempt-<k>.yaml` (k = 1 for the fresh start,
    then one more per resume: earlier attempts' files are kept) and as `<run_dir>/config.yaml` (the newest, which
    `treepo-ray train` can load again). Returns the attempt file's location."""
    folder = storage.join(run_dir, "configs")
    k = 1 + sum(name.startswith("attempt-") for name in storage.list_names(folder)) if storage.exists(folder) else 1
    how = f"resumed from {resume_from} at step {step}" if resume_from is not None else "fresh start"
    text = f"# attempt {k}: {time.strftime('%Y-%m-%d %H:%M:%S')}, {how}\n" + yaml.safe_dump(cfg_dict, sort_keys=False)
    attempt = storage.join(folder, f"attempt-{k}.yaml")
    storage.write_text(attempt, text)
    storage.write_text(storage.join(run_dir, CONFIG), text)
    return attempt


# ---------------------------------------------------------------------------------------------- which run


def new_run_dir(storage_path: str, algo: str) -> str:
    return storage.join(storage_path, f"{algo}-{time.strftime('%Y%m%d-%H%M%S')}")


def resolve_run(cfg) -> tuple[str, str | None]:
    """(run directory, checkpoint to resume from or None) for a TrainConfig. Locations are absolute (a relative
    path is resolved here, on the driver, never on another node). trainer.resume: '' a fresh run; a checkpoint
    path; 'auto' the newest checkpoint of run_dir, or (no run_dir) of the newest run in storage_path whose config
    is compatible (IDENTITY) and that no live run holds: every run passed over is printed with the reason."""
    tr = cfg.trainer
    run_dir = storage.absolute(tr.run_dir) if tr.run_dir else ""
    current = config_io.to_dict(cfg)
    if tr.resume not in ("", "auto"):
        ckpt = storage.absolute(tr.resume)
        return run_dir or storage.parent_of(ckpt), ckpt
    if tr.resume != "auto":
        return run_dir or new_run_dir(storage.absolute(tr.storage_path), cfg.algo.name), None
    if run_dir:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is not None:
            breaking, _ = config_changes(saved_config(run_dir) or current, current)
            if breaking:
                raise RunDirError(f"trainer.resume=auto: {run_dir} was started with another config, so its "
                                  f"checkpoint cannot continue under this one: {'; '.join(breaking)}")
        return run_dir, ckpt
    root = storage.absolute(tr.storage_path)
    for name in sorted(storage.list_names(root), reverse=True):  # names end in their start time: newest first
        if not name.startswith(f"{cfg.algo.name}-"):
            continue
        candidate = storage.join(root, name)
        why = _not_resumable(candidate, current, tr.lock_stale_s)
        if why is None:
            return candidate, latest_checkpoint(candidate)
        print(f"resume=auto: not resuming {candidate}: {why}", flush=True)
    fresh = new_run_dir(root, cfg.algo.name)
    print(f"resume=auto: no run in {root} to continue; starting {fresh}", flush=True)
    return fresh, None


def _not_resumable(run_dir: str, current: dict, stale_s: float) -> str | None:
    if latest_checkpoint(run_dir) is None:
        return "it has no complete checkpoint"
    saved = saved_config(run_dir)
    if saved is None:
        return f"it has no {CONFIG}"
    breaking, _ = config_changes(saved, current)
    if breaking:
        return "its config differs in " + "; ".join(breaking)
    if storage.exists(storage.join(run_dir, LOCK)):
        try:
            holder = json.loads(storage.read_text(storage.join(run_dir, LOCK)))
        except (FileNotFoundError, json.JSONDecodeError):
            holder = {}
        if holder and stale_reason(holder, stale_s) is None:
            return f"run {holder.get('run')!r} holds it (host {holder.get('host')}, pid {holder.get('pid')})"
    return None


# ---------------------------------------------------------------------------------------------- pending batches


def pending_name(step: int) -> str:
    return f"pending-{step:08d}.json.gz"


def save_pending(run_dir: str, step: int, batches: list[dict]) -> str:
    """Write the waiting batches of the checkpoint of `step` (before that checkpoint, which names the file)."""
    name = pending_name(step)
    storage.write_bytes(storage.join(run_dir, name), gzip.compress(json.dumps(batches).encode(), compresslevel=3))
    return name


def load_pending(run_dir: str, name: str) -> list[dict]:
    return json.loads(gzip.decompress(storage.read_bytes(storage.join(run_dir, name))))


def prune_run(run_dir: str, keep: int) -> None:
    """Keep the newest `keep` checkpoints and the pending batches that belong to them."""
    prune_checkpoints(run_dir, keep)
    kept = {step for step, _ in list_checkpoints(run_dir)}
    for name in storage.list_names(run_dir):
        m = _PENDING.match(name)
        if m and int(m.group(1)) not in kept:
            storage.delete(storage.join(run_dir, name))


# ---------------------------------------------------------------------------------------------- logs


class LogMirror:
    """Where the logger writes (a local folder) and how it reaches the run directory: the same folder for a path;
    for an object store, a local folder under `cache_dir` whose files are uploaded by `upload()` (at each checkpoint
    and at the end) and downloaded when a run resumes."""

    FILES = ("metrics.jsonl", "trees.jsonl", "summary.json", "training_curve.png")

    def __init__(self, run_dir: str, cache_dir: str):
        self.run_dir = run_dir
        self.remote = storage.is_uri(run_dir)
        self.local = (Path(cache_dir) / "runs" / storage.name_of(run_dir)) if self.remote else Path(run_dir)
        self.local.mkdir(parents=True, exist_ok=True)

    def download(self) -> None:
        if self.remote:
            for name in self.FILES:
                where = storage.join(self.run_dir, name)
                if storage.exists(where):
                    (self.local / name).write_bytes(storage.read_bytes(where))

    def upload(self) -> None:
        if self.remote:
            for name in self.FILES:
                if (self.local / name).is_file():
                    storage.write_bytes(storage.join(self.run_dir, name), (self.local / name).read_bytes())
