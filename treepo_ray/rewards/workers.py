"""Bounded scoring processes: a pool of `_worker` subprocesses, each item under a CPU-time limit, each worker under
a memory cap, a process-count cap and a cleared environment.

Every scorer that may run long or blow up on an input (math-verify's symbolic comparison, a user's reward function)
runs here. Each worker caps its own address space and processes (rewards/_worker.py); the parent gives every item a
limit in CPU seconds of the worker (so a busy machine does not turn slow answers into failures), with a wall-clock
backstop for an item that waits without computing, and kills the worker's whole process group (whatever it started
goes with it) when an item overruns or the worker dies, answering that item {"lost": "timeout"} or {"lost": "died"};
a worker dies with the process that started it (the kernel's parent-death signal: rewards/_worker.py).
Workers see only a few environment variables (PATH, HOME, locale, the Python path) plus the names the caller passes
through: cloud credentials and API keys of the job stay out of reach of reward code.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque

import psutil

IN_SCORING_WORKER = "TREEPO_RAY_SCORING_WORKER"
"""Set to "1" in every worker process: code there (a custom reward function calling default_compute_score) is
already bounded, so it scores math in its own process instead of starting another worker."""
BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
"""Environment variables every worker keeps; anything else must be named by the caller (custom_reward_function.env)."""
WALL_BACKSTOP = 3.0
"""An item may take this many times its CPU limit in wall time (waiting on a lock, sleeping, a busy machine)."""
POLL_S = 0.05
"""How often a busy worker's CPU time is read."""


def worker_env(names: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment of a scoring worker: BASE_ENV and `names` where set, one thread, the worker marker."""
    keep = {k: os.environ[k] for k in (*BASE_ENV, *names) if k in os.environ}
    return keep | {"OMP_NUM_THREADS": "1", IN_SCORING_WORKER: "1", "TREEPO_RAY_SCORING_PARENT": str(os.getpid())}


class _Worker:
    """One `_worker` subprocess (the leader of its own process group), its pipes, and the item it is working on."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treepo_ray.rewards._worker", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None if argv[1] == "function" else subprocess.DEVNULL,  # a user's function may print
            text=True,
            bufsize=1,
            env=env,
            start_new_session=True,  # its own process group: a kill takes whatever it started too
        )
        self.ready = False
        self.item: int | None = None
        self.cpu_limit = self.cpu_start = self.wall_deadline = 0.0

    def cpu_s(self) -> float:
        """CPU seconds the worker has used (user + system); 0 when it is gone."""
        try:
            t = psutil.Process(self.proc.pid).cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def send(self, i: int, item: dict, timeout_s: float) -> None:
        self.item, self.cpu_limit, self.cpu_start = i, timeout_s, self.cpu_s()
        self.wall_deadline = time.monotonic() + WALL_BACKSTOP * timeout_s
        self.proc.stdin.write(json.dumps({**item, "i": i}, default=str) + "\n")
        self.proc.stdin.flush()

    def overran(self, now: float) -> bool:
        return self.item is not None and (now >= self.wall_deadline or self.cpu_s() - self.cpu_start > self.cpu_limit)

    def kill(self) -> None:
        """Kill the worker, its process group and any descendant that left the group."""
        try:
            stray = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            stray = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in stray:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class WorkerPool:
    """`num_workers` worker processes of one kind (`_worker` KIND ARGS), started in the background when the pool is
    made and reused across calls. Not thread-safe: one caller at a time; close() when done."""

    def __init__(self, kind: str, args: list[str], num_workers: int, memory_mb: int, env_names: tuple[str, ...] = ()):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.argv, self.env = [str(memory_mb), kind, *args], worker_env(tuple(env_names))
        self._workers = [_Worker(self.argv, self.env) for _ in range(num_workers)]
        self.restarts = 0
        """Workers killed for overrunning a deadline or found dead (a counter for logs)."""

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def run(self, pending: deque[tuple[int, dict]], timeout_s: float) -> dict[int, dict]:
        """Each (index, item) of `pending` on a worker; index -> the worker's answer, or {"lost": "timeout"} when the
        item overran `timeout_s` CPU seconds (or its wall backstop), {"lost": "died"} when its worker died under it.
        Raises RuntimeError when workers keep failing to start."""
        out: dict[int, dict] = {}
        if not self._workers:
            raise RuntimeError("the scoring worker pool is closed")
        sel = selectors.DefaultSelector()
        failed_starts, fatal = 0, ""
        for w in self._workers:
            sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        try:
            while pending or any(w.item is not None for w in self._workers):
                for w in self._workers:
                    if w.ready and w.item is None and pending:
                        i, item = pending.popleft()
                        try:
                            w.send(i, item, timeout_s)
                        except (BrokenPipeError, OSError):
                            self._replace(sel, w, out, "died")
                wait = POLL_S if any(w.item is not None for w in self._workers) else 1.0
                for key, _ in sel.select(timeout=wait):
                    w = key.data
                    line = w.proc.stdout.readline()
                    msg = json.loads(line) if line else {}
                    if not line or "fatal" in msg:  # the worker died (or could not start): its item is lost
                        if not w.ready:
                            failed_starts += 1
                            fatal = msg.get("fatal", fatal)
                            if failed_starts >= 3:
                                raise RuntimeError(f"scoring worker ({' '.join(self.argv[1:3])}) exits at start: "
                                                   f"{fatal or 'no message (is math-verify installed?)'}")
                        self._replace(sel, w, out, "died")
                        continue
                    if msg.get("ready"):
                        w.ready = True
                    elif msg.get("i") == w.item:
                        out[w.item], w.item = msg, None
                now = time.monotonic()
                for w in list(self._workers):
                    if w.overran(now):
                        self._replace(sel, w, out, "timeout")
        finally:
            sel.close()
        return out

    def _replace(self, sel: selectors.BaseSelector, w: _Worker, out: dict[int, dict], why: str) -> None:
        """Kill `w` (its current item is answered {"lost": why}) and start a fresh worker in its place."""
        if w.item is not None:
            out[w.item] = {"lost": why}
        sel.unregister(w.proc.stdout)
        w.kill()
        fresh = _Worker(self.argv, self.env)
        self._workers[self._workers.index(w)] = fresh
        sel.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)
        self.restarts += 1
