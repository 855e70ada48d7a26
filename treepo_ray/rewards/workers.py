"""Bounded scoring processes: a pool of `_worker` subprocesses, each item under a deadline and a memory cap.

Every scorer that may run long or blow up on an input (math-verify's symbolic comparison, a user's reward function)
runs here: each worker caps its own address space; the parent gives every item a deadline and kills and replaces a
worker that overruns it or dies, so a pathological item is answered None (the caller scores it wrong) within the
timeout and the next items go on.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from collections import deque

IN_SCORING_WORKER = "TREEPO_RAY_SCORING_WORKER"
"""Set to "1" in every worker process: code there (a custom reward function calling default_compute_score) is
already bounded, so it scores math in its own process instead of starting another worker."""


class _Worker:
    """One `_worker` subprocess, its pipes, and the item it is working on."""

    def __init__(self, argv: list[str]):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treepo_ray.rewards._worker", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None if argv[1] == "function" else subprocess.DEVNULL,  # a user's function may print
            text=True,
            bufsize=1,
            env=os.environ | {"OMP_NUM_THREADS": "1", IN_SCORING_WORKER: "1"},
        )
        self.ready = False
        self.item: int | None = None
        self.deadline = 0.0

    def send(self, i: int, item: dict, timeout_s: float) -> None:
        self.item, self.deadline = i, time.monotonic() + timeout_s
        self.proc.stdin.write(json.dumps({**item, "i": i}, default=str) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
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

    def __init__(self, kind: str, args: list[str], num_workers: int, memory_mb: int):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self.argv = [str(memory_mb), kind, *args]
        self._workers = [_Worker(self.argv) for _ in range(num_workers)]
        self.restarts = 0
        """Workers killed for overrunning a deadline or found dead (a counter for logs)."""

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def run(self, pending: deque[tuple[int, dict]], timeout_s: float) -> dict[int, dict | None]:
        """Each (index, item) of `pending` on a worker; index -> the worker's answer, or None when the item overran
        `timeout_s` or its worker died. Raises RuntimeError when workers keep failing to start."""
        out: dict[int, dict | None] = {}
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
                            self._replace(sel, w, out)
                busy = [w.deadline for w in self._workers if w.item is not None]
                wait = max(0.0, min(busy) - time.monotonic()) if busy else 1.0
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
                        self._replace(sel, w, out)
                        continue
                    if msg.get("ready"):
                        w.ready = True
                    elif msg.get("i") == w.item:
                        out[w.item], w.item = msg, None
                now = time.monotonic()
                for w in list(self._workers):
                    if w.item is not None and now >= w.deadline:
                        self._replace(sel, w, out)
        finally:
            sel.close()
        return out

    def _replace(self, sel: selectors.BaseSelector, w: _Worker, out: dict[int, dict | None]) -> None:
        """Kill `w` (its current item gets None) and start a fresh worker in its place."""
        if w.item is not None:
            out[w.item] = None
        sel.unregister(w.proc.stdout)
        w.kill()
        fresh = _Worker(self.argv)
        self._workers[self._workers.index(w)] = fresh
        sel.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)
        self.restarts += 1
