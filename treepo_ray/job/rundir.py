"""The run directory in run storage: which run it is, who holds it, which run `resume=auto` continues, and the
batches that were waiting for the learner when a checkpoint was taken.

    <storage_path>/<algo>-<YYYYmmdd-HHMMSS>/      (or trainer.run_dir: a path or a storage URI)
        run.lock.<gen>      the lock: its holder (host, pid, run, heartbeat); a second run refuses the directory
        run.json            the run's name, creation time and W&B run id (a resumed run continues that W&B run)
        config.yaml         the config the run was started with, secrets redacted (resume=auto compares against it)
        checkpoint-<step>/  learner/checkpoint.py
        pending-<step>.json.gz
                            the trees of the batches waiting in the staleness queue at that checkpoint: a resumed
                            run trains them first instead of growing them again with newer weights
        metrics.jsonl, trees.jsonl, samples.jsonl, summary.json, training_curve.png, wandb/   (job/logs.py)

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
from treepo_ray.job.redact import listed_keys, redacted
from treepo_ray.learner.checkpoint import latest_checkpoint, list_checkpoints, prune_checkpoints

LOCK, RUN_RECORD, CONFIG = "run.lock", "run.json", "config.yaml"
_LOCK_GENERATION = re.compile(r"^run\.lock\.(\d+)$")
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
#
# The lock is a sequence of generations, one file each: run.lock.00000001, run.lock.00000002, ... Each file is
# created once, by `storage.create_exclusive` (of runs racing for one generation exactly one wins), and written
# only by the run that created it (its heartbeat). The newest generation is the lock's state: held while its holder
# lives, free once it says "released" or its holder is gone; a run takes the lock by creating the next generation,
# and a holder learns it was taken over from a generation above its own. Older generations are deleted by each new
# holder; the newest is never deleted, so a generation number is never reused while it matters.


def _lock_file(run_dir: str, generation: int) -> str:
    return storage.join(run_dir, f"{LOCK}.{generation:08d}")


def _generations(run_dir: str) -> list[int]:
    return sorted(int(m.group(1)) for name in storage.list_names(run_dir) if (m := _LOCK_GENERATION.match(name)))


def _machine() -> str:
    """This host, its boot and its process namespace: a pid names the same process only where all three agree."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{socket.gethostname()}/{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, Linux), so that a reused pid is not taken for it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive_here(pid: int, started: str | None = None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    return started is None or _process_start(pid) in (None, started)


def _same_machine(holder: dict) -> bool:
    if "machine" in holder:
        return holder["machine"] == _machine()
    return holder.get("host") == socket.gethostname()  # a lock written before "machine" was recorded


def stale_reason(holder: dict, stale_s: float, now: float | None = None) -> str | None:
    """Why a lock's holder is gone (None while it may be alive): it released the lock, its process on this host has
    exited, or (a holder on another host, which cannot be checked) its heartbeat is older than `stale_s`. A live
    process on this host is never taken for gone, however old its heartbeat (a long pause is not a death)."""
    if holder.get("released"):
        return "it was released"
    if _same_machine(holder):
        pid = int(holder.get("pid", -1))
        alive = _alive_here(pid, holder.get("pid_started"))
        return None if alive else f"its process {pid} on this host has exited"
    age = (time.time() if now is None else now) - float(holder.get("heartbeat", 0))
    if age > stale_s:
        return f"its last heartbeat was {age:.0f}s ago (trainer.lock_stale_s = {stale_s:g})"
    return None


def lock_holder(run_dir: str) -> tuple[int, dict | None]:
    """(newest generation, its holder) of `run_dir`'s lock; (0, None) when it was never locked. Generation 0 is the
    single `run.lock` of versions before generations. Raises RunLocked when the newest file cannot be read."""
    for _ in range(10):  # a file deleted between listing and reading (an older generation), or still being written
        generations = _generations(run_dir)
        where = _lock_file(run_dir, generations[-1]) if generations else storage.join(run_dir, LOCK)
        if not generations and not storage.exists(where):
            return 0, None
        try:
            return (generations[-1] if generations else 0), json.loads(storage.read_text(where))
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
            time.sleep(0.1)
    raise RunLocked(f"the lock file {where} cannot be read, so whether a run holds {run_dir} is unknown; if none "
                    "does, delete that file")


def _in_use(run_dir: str, holder: dict) -> str:
    return (f"{run_dir} is in use by run {holder.get('run')!r} (host {holder.get('host')}, pid {holder.get('pid')}, "
            f"since {holder.get('started')}); choose another trainer.run_dir, or stop that run first")


class RunLock:
    """The lock of one run directory, held by this process while it trains there. A thread renews its heartbeat
    every `stale_s / 4`; if another run took the lock over meanwhile (this one looked dead), `lost` says so."""

    def __init__(self, run_dir: str, run: str, stale_s: float):
        self.run_dir, self.stale_s, self.generation = run_dir, stale_s, 0
        self.info = {"host": socket.gethostname(), "machine": _machine(), "pid": os.getpid(),
                     "pid_started": _process_start(os.getpid()), "run": run, "token": uuid.uuid4().hex,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "heartbeat": time.time()}
        self.lost = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def path(self) -> str:
        """This run's generation file (once acquired)."""
        return _lock_file(self.run_dir, self.generation)

    def acquire(self) -> "RunLock":
        """Take the lock, or raise RunLocked naming its live holder. A gone holder's lock is taken over (said so)."""
        for attempt in range(20):
            generation, holder = lock_holder(self.run_dir)
            why = stale_reason(holder, self.stale_s) if holder is not None else "never locked"
            if why is None:
                raise RunLocked(_in_use(self.run_dir, holder))
            if self._claim(generation + 1):
                if holder is not None and not holder.get("released"):
                    print(f"taking over the lock of {self.run_dir} from run {holder.get('run')!r} (host "
                          f"{holder.get('host')}, pid {holder.get('pid')}): {why}", flush=True)
                self._delete_older()
                self._thread = threading.Thread(target=self._beat, name="run-lock", daemon=True)
                self._thread.start()
                return self
            time.sleep(0.02 * (1 + attempt % 5))  # another run took that generation first: look again
        raise RunLocked(f"could not take the lock of {self.run_dir}: other runs keep taking it")

    def _claim(self, generation: int) -> bool:
        """Create `generation`; it is ours only if no later one exists (a run that saw an old listing may create a
        generation deleted long ago: it then finds the newer ones and lets go)."""
        self.info["heartbeat"] = time.time()
        try:
            created = storage.create_exclusive(_lock_file(self.run_dir, generation), json.dumps(self.info))
        except storage.UnsupportedStorage as err:
            raise RunDirError(str(err)) from err
        if not created:
            return False
        self.generation = generation
        if self._newer() is None:
            return True
        storage.delete(self.path)
        self.generation = 0
        return False

    def _newer(self) -> dict | None:
        """The holder of a generation above ours ({} when unreadable), or None when ours is the newest."""
        above = [g for g in _generations(self.run_dir) if g > self.generation]
        if not above:
            return None
        try:
            return json.loads(storage.read_text(_lock_file(self.run_dir, above[-1])))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError):
            return {}

    def _delete_older(self) -> None:
        older = [_lock_file(self.run_dir, g) for g in _generations(self.run_dir) if g < self.generation]
        for where in older + [storage.join(self.run_dir, LOCK)]:
            try:
                storage.delete(where)
            except OSError as err:  # harmless: an older generation never counts again
                print(f"could not delete the old lock file {where}: {err}", flush=True)

    def _beat(self) -> None:
        renewed = time.monotonic()
        while not self._stop.wait(self.stale_s / 4):
            try:
                newer = self._newer()
                if newer is not None:
                    self.lost = (f"the lock of {self.run_dir} was taken over by run {newer.get('run')!r} (host "
                                 f"{newer.get('host')}, pid {newer.get('pid')})")
                    return
                self.info["heartbeat"] = time.time()
                storage.write_text(self.path, json.dumps(self.info))  # our own generation: no other run writes it
                renewed = time.monotonic()
            except OSError as err:
                if time.monotonic() - renewed > 0.75 * self.stale_s:  # another host may soon take it for gone
                    self.lost = (f"the lock of {self.run_dir} could not be renewed for "
                                 f"{time.monotonic() - renewed:.0f}s ({err}); another run may take it over")
                    return
                print(f"run lock heartbeat failed (tried again in {self.stale_s / 4:g}s): {err}", flush=True)

    def release(self) -> None:
        """Stop the heartbeat and mark our generation released (unless the lock was taken over meanwhile)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not self.generation or self.lost:
            return
        released = {**self.info, "released": time.strftime("%Y-%m-%d %H:%M:%S")}
        try:
            if self._newer() is None:
                storage.write_text(self.path, json.dumps(released))
        except OSError as err:
            print(f"could not release the lock of {self.run_dir} ({err}): the next run takes it over once this "
                  "process has exited (from another host: after trainer.lock_stale_s)", flush=True)


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
    are under IDENTITY: a checkpoint of `saved` cannot be continued under `current`.

    config.yaml holds its secrets redacted, so both sides are compared redacted (with both sides' log.redact_keys):
    the same secret is no change, and a changed secret (a rotated key) cannot be seen, so it never blocks a resume;
    the lines name no secret either."""
    listed = listed_keys(saved) + listed_keys(current)
    a, b = _flat(redacted(saved, listed)), _flat(redacted(current, listed))
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
    `treepo-ray train` can load again once its secrets are set again: they are written as "<redacted>",
    job/redact.py). Returns the attempt file's location."""
    folder = storage.join(run_dir, "configs")
    k = 1 + sum(name.startswith("attempt-") for name in storage.list_names(folder)) if storage.exists(folder) else 1
    how = f"resumed from {resume_from} at step {step}" if resume_from is not None else "fresh start"
    body = yaml.safe_dump(redacted(cfg_dict), sort_keys=False)  # no secret reaches the run directory
    text = f"# attempt {k}: {time.strftime('%Y-%m-%d %H:%M:%S')}, {how}\n" + body
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
    try:
        _, holder = lock_holder(run_dir)
    except RunLocked as err:
        return str(err)
    if holder is not None and stale_reason(holder, stale_s) is None:
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

    FILES = ("metrics.jsonl", "trees.jsonl", "samples.jsonl", "summary.json", "training_curve.png")

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
