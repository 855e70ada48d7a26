"""Math answer verification: the last `\\boxed{}` of a solution against a ground truth, bounded in time and memory.

Comparison order: equal normal forms (`boxed.normalize_answer`) are correct at once, without a worker; otherwise
math-verify decides symbolic equivalence (fractions, decimals, percentages, intervals, sets, LaTeX forms) in a
worker process. Each worker caps its own address space; the parent gives every item a deadline and kills and
replaces a worker that overruns it or dies, so a pathological answer (a nesting the parser backtracks on, a tower
of exponents sympy tries to expand) is scored wrong within the timeout and the next items go on.
"""

from __future__ import annotations

import atexit
import json
import os
import selectors
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

from treepo_ray.rewards.boxed import last_boxed, normalize_answer


@dataclass
class MathVerifyConfig:
    """Scoring values and the resource bounds of verification."""

    correct_score: float = 1.0
    """Score of a correct answer."""
    wrong_score: float = 0.0
    """Score of a wrong or missing answer (set -1.0 for the +1/-1 scheme of DAPO)."""
    timeout_s: float = 5.0
    """Wall-clock deadline of one symbolic comparison; past it the worker is killed and the answer is wrong."""
    memory_mb: int = 2048
    """Address-space limit of each worker process (0 = unlimited)."""
    num_workers: int = 2
    """Worker processes of a batch verifier."""
    max_answer_chars: int = 1000
    """A boxed answer (or ground truth) longer than this is wrong without parsing."""
    max_solution_chars: int = 100_000
    """Only the last this-many characters of a solution are searched for a box."""


def _result(cfg: MathVerifyConfig, ok: bool, pred: str) -> dict:
    return {"score": float(cfg.correct_score if ok else cfg.wrong_score), "acc": 1.0 if ok else 0.0, "pred": pred}


def _answer_of(text: str, cfg: MathVerifyConfig) -> str | None:
    """The boxed answer of a solution, or None."""
    return last_boxed(text, max_chars=cfg.max_solution_chars)


def _gold_of(ground_truth, cfg: MathVerifyConfig) -> str:
    """Ground truth as a string; a ground truth that is itself a worked solution gives its boxed answer."""
    if isinstance(ground_truth, bool) or not isinstance(ground_truth, (str, int, float)):
        raise ValueError(f"ground_truth must be a string or a number, got {type(ground_truth).__name__}")
    gold = str(ground_truth)
    boxed = last_boxed(gold, max_chars=cfg.max_solution_chars) if "box" in gold else None
    return boxed if boxed is not None else gold.strip()


class _Worker:
    """One `_math_worker` subprocess, its pipes, and the item it is working on."""

    def __init__(self, memory_mb: int):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treepo_ray.rewards._math_worker", str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env=os.environ | {"OMP_NUM_THREADS": "1"},
        )
        self.ready = False
        self.item: int | None = None
        self.deadline = 0.0

    def send(self, i: int, pred: str, gold: str, timeout_s: float) -> None:
        self.item, self.deadline = i, time.monotonic() + timeout_s
        self.proc.stdin.write(json.dumps({"i": i, "pred": pred, "gold": gold}) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class MathVerifier:
    """Verifies many (solution, ground truth) pairs in parallel worker processes.

    Workers start in the background when the verifier is made and are reused across calls; use it as a context
    manager or call `close()`. Not thread-safe: one caller at a time.
    """

    def __init__(self, cfg: MathVerifyConfig | None = None):
        self.cfg = cfg or MathVerifyConfig()
        if self.cfg.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.cfg.num_workers}")
        if self.cfg.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.cfg.timeout_s}")
        self._workers = [_Worker(self.cfg.memory_mb) for _ in range(self.cfg.num_workers)]
        self.restarts = 0
        """Workers killed for overrunning a deadline or found dead (a counter for logs)."""

    def __enter__(self) -> "MathVerifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def score(self, solution: str, ground_truth) -> dict:
        """{"score", "acc", "pred"} of one solution."""
        return self.score_batch([solution], [ground_truth])[0]

    def score_batch(self, solutions: list[str], ground_truths: list) -> list[dict]:
        """{"score", "acc", "pred"} of each solution, in order."""
        if len(solutions) != len(ground_truths):
            raise ValueError(f"{len(solutions)} solutions but {len(ground_truths)} ground truths")
        cfg = self.cfg
        results: list[dict | None] = [None] * len(solutions)
        pending: deque[tuple[int, str, str]] = deque()
        for i, (text, gt) in enumerate(zip(solutions, ground_truths)):
            if not isinstance(text, str):
                raise ValueError(f"solution {i} must be a string, got {type(text).__name__}")
            gold = _gold_of(gt, cfg)
            pred = _answer_of(text, cfg)
            if pred is None:
                results[i] = _result(cfg, False, "")
            elif len(pred) > cfg.max_answer_chars or len(gold) > cfg.max_answer_chars:
                results[i] = _result(cfg, False, pred[: cfg.max_answer_chars])
            elif normalize_answer(pred) == normalize_answer(gold):
                results[i] = _result(cfg, True, pred)
            else:
                pending.append((i, pred, gold))
        preds = {i: pred for i, pred, _ in pending}
        for i, ok in self._run(pending).items():
            results[i] = _result(cfg, ok, preds[i])
        return results  # type: ignore[return-value]

    def _run(self, pending: deque[tuple[int, str, str]]) -> dict[int, bool]:
        """Symbolic comparisons of `pending` (index, pred, gold) on the workers; index -> equal."""
        out: dict[int, bool] = {}
        if not self._workers:
            raise RuntimeError("MathVerifier is closed")
        sel = selectors.DefaultSelector()
        failed_starts = 0
        for w in self._workers:
            sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        try:
            while pending or any(w.item is not None for w in self._workers):
                for w in self._workers:
                    if w.ready and w.item is None and pending:
                        i, pred, gold = pending.popleft()
                        try:
                            w.send(i, pred, gold, self.cfg.timeout_s)
                        except (BrokenPipeError, OSError):
                            self._replace(sel, w, out)
                busy = [w.deadline for w in self._workers if w.item is not None]
                wait = max(0.0, min(busy) - time.monotonic()) if busy else 1.0
                for key, _ in sel.select(timeout=wait):
                    w = key.data
                    line = w.proc.stdout.readline()
                    if not line:  # the worker died (e.g. killed by the kernel): its item is wrong
                        if not w.ready:
                            failed_starts += 1
                            if failed_starts >= 3:
                                raise RuntimeError("math-verify worker process exits at start (is math-verify installed?)")
                        self._replace(sel, w, out)
                        continue
                    msg = json.loads(line)
                    if msg.get("ready"):
                        w.ready = True
                    elif msg.get("i") == w.item:
                        out[w.item], w.item = bool(msg["ok"]), None
                now = time.monotonic()
                for w in list(self._workers):
                    if w.item is not None and now >= w.deadline:
                        self._replace(sel, w, out)
        finally:
            sel.close()
        return out

    def _replace(self, sel: selectors.BaseSelector, w: _Worker, out: dict[int, bool]) -> None:
        """Kill `w` (its current item scores wrong) and start a fresh worker in its place."""
        if w.item is not None:
            out[w.item] = False
        sel.unregister(w.proc.stdout)
        w.kill()
        fresh = _Worker(self.cfg.memory_mb)
        self._workers[self._workers.index(w)] = fresh
        sel.register(fresh.proc.stdout, selectors.EVENT_READ, fresh)
        self.restarts += 1


_shared: dict[tuple, MathVerifier] = {}


def _shared_verifier(cfg: MathVerifyConfig) -> MathVerifier:
    """One single-worker verifier per set of resource bounds, made on first use and closed at exit."""
    key = (cfg.timeout_s, cfg.memory_mb, cfg.max_answer_chars, cfg.max_solution_chars)
    if key not in _shared:
        bounds = MathVerifyConfig(
            timeout_s=cfg.timeout_s,
            memory_mb=cfg.memory_mb,
            num_workers=1,
            max_answer_chars=cfg.max_answer_chars,
            max_solution_chars=cfg.max_solution_chars,
        )
        _shared[key] = MathVerifier(bounds)
        atexit.register(_shared[key].close)
    return _shared[key]


def compute_score(solution_str: str, ground_truth, cfg: MathVerifyConfig | None = None) -> dict:
    """{"score", "acc", "pred"} of one solution: its last boxed answer against `ground_truth`.

    Runs on a shared one-worker verifier, so one call costs one comparison, not a process start.
    """
    cfg = cfg or MathVerifyConfig()
    result = _shared_verifier(cfg).score(solution_str, ground_truth)
    return _result(cfg, result["acc"] == 1.0, result["pred"])
