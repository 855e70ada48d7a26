"""Math answer verification: the last `\\boxed{}` of a solution against a ground truth, bounded in time and memory.

Comparison order: equal normal forms (`boxed.normalize_answer`) are correct at once, without a worker; then the
string rules of rewards/forms.py (degrees, the empty set, multiple-choice letters and options, negated statements)
decide or rewrite the pair; otherwise math-verify decides symbolic equivalence (fractions, decimals, percentages,
intervals, sets, LaTeX forms), with forms.py's sympy rules beside it (the imaginary unit, inequalities against
intervals, false equations), in a bounded worker process (rewards/workers.py), so a pathological answer (a nesting
the parser backtracks on, a tower of exponents sympy tries to expand) is scored wrong within the timeout and the
next items go on.
"""

from __future__ import annotations

import atexit
import os
from collections import deque
from dataclasses import dataclass

from treepo_ray.rewards.boxed import last_boxed, normalize_answer
from treepo_ray.rewards.forms import prepare
from treepo_ray.rewards.workers import IN_SCORING_WORKER, WorkerPool


@dataclass
class MathVerifyConfig:
    """Scoring values and the resource bounds of verification."""

    correct_score: float = 1.0
    """Score of a correct answer."""
    wrong_score: float = 0.0
    """Score of a wrong or missing answer (set -1.0 for the +1/-1 scheme of DAPO)."""
    timeout_s: float = 5.0
    """CPU-time limit of one symbolic comparison; past it the worker is killed and the answer has no reward."""
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


def _failed(cfg: MathVerifyConfig, lost: str, pred: str) -> dict:
    """No verdict: the comparison overran its CPU-time limit or its worker died (acc 0 for accuracy counts)."""
    cause, why = ("timeout", f"no verdict within {cfg.timeout_s:g} s of CPU time") if lost == "timeout" else \
        ("error", "the math verifier's worker died (out of memory?)")
    return {**_result(cfg, False, pred), "failed": cause, "error": f"{why}: answer {pred[:80]!r}"}


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


def _decided_without_worker(text: str, ground_truth, cfg: MathVerifyConfig,
                            options: dict[str, str] | None = None) -> tuple[dict | None, str, str]:
    """(result, pred, gold): the result when no symbolic comparison is needed (no box, over the length caps, equal
    normal forms, a string rule of forms.py), else None with the two answers the worker must compare. `options`:
    a multiple-choice row's options by letter."""
    gold = _gold_of(ground_truth, cfg)
    pred = _answer_of(text, cfg)
    if pred is None:
        return _result(cfg, False, ""), "", gold
    if len(pred) > cfg.max_answer_chars or len(gold) > cfg.max_answer_chars:
        return _result(cfg, False, pred[: cfg.max_answer_chars]), pred, gold
    if normalize_answer(pred) == normalize_answer(gold):
        return _result(cfg, True, pred), pred, gold
    verdict, rewritten, target = prepare(pred, gold, options)
    if verdict is not None:
        return _result(cfg, verdict, pred), pred, gold
    return None, rewritten, target


class MathVerifier:
    """Verifies many (solution, ground truth) pairs in parallel worker processes.

    Workers start in the background when the verifier is made and are reused across calls; use it as a context
    manager or call `close()`. Not thread-safe: one caller at a time.
    """

    def __init__(self, cfg: MathVerifyConfig | None = None):
        self.cfg = cfg or MathVerifyConfig()
        if self.cfg.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.cfg.timeout_s}")
        self._pool = WorkerPool("math", [], self.cfg.num_workers, self.cfg.memory_mb)

    @property
    def restarts(self) -> int:
        """Workers killed for overrunning a deadline or found dead (a counter for logs)."""
        return self._pool.restarts

    def __enter__(self) -> "MathVerifier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._pool.close()

    def score(self, solution: str, ground_truth, options: dict[str, str] | None = None) -> dict:
        """{"score", "acc", "pred"} of one solution."""
        return self.score_batch([solution], [ground_truth], [options])[0]

    def score_batch(self, solutions: list[str], ground_truths: list,
                    options: list[dict[str, str] | None] | None = None) -> list[dict]:
        """{"score", "acc", "pred"} of each solution, in order, plus "failed" and "error" where no verdict came
        (a timeout, a dead worker: not a wrong answer); `options`: each row's multiple-choice options by
        letter (forms.options_of), or None."""
        if len(solutions) != len(ground_truths):
            raise ValueError(f"{len(solutions)} solutions but {len(ground_truths)} ground truths")
        cfg = self.cfg
        options = options or [None] * len(solutions)
        results: list[dict | None] = [None] * len(solutions)
        pending: deque[tuple[int, str, str]] = deque()
        for i, (text, gt, opts) in enumerate(zip(solutions, ground_truths, options)):
            if not isinstance(text, str):
                raise ValueError(f"solution {i} must be a string, got {type(text).__name__}")
            results[i], pred, gold = _decided_without_worker(text, gt, cfg, opts)
            if results[i] is None:
                pending.append((i, pred, gold))
        try:
            answers = self._pool.run(deque((i, {"pred": pred, "gold": gold}) for i, pred, gold in pending),
                                     cfg.timeout_s)
        except RuntimeError as err:
            raise RuntimeError(f"MathVerifier: {err}") from None
        for i, _, _ in pending:  # an item that overran its limit, or whose worker died, has no verdict
            got, pred = answers.get(i) or {"lost": "died"}, _answer_of(solutions[i], cfg)
            results[i] = _failed(cfg, got["lost"], pred) if "lost" in got else _result(cfg, bool(got.get("ok")), pred)
        return results  # type: ignore[return-value]


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


def compute_score(solution_str: str, ground_truth, cfg: MathVerifyConfig | None = None,
                  options: dict[str, str] | None = None) -> dict:
    """{"score", "acc", "pred"} of one solution: its last boxed answer against `ground_truth` (`options`: a
    multiple-choice row's options by letter).

    Runs on a shared one-worker verifier, so one call costs one comparison, not a process start; inside a scoring
    worker (a custom reward function calling default_compute_score), which is already bounded, in this process.
    """
    cfg = cfg or MathVerifyConfig()
    if os.environ.get(IN_SCORING_WORKER) == "1":
        from treepo_ray.rewards.forms import equal

        result, pred, gold = _decided_without_worker(solution_str, ground_truth, cfg, options)
        if result is not None:
            return result
        answer = _answer_of(solution_str, cfg)
        try:
            return _result(cfg, equal(pred, gold), answer)
        except (Exception, RecursionError):
            return _result(cfg, False, answer)
    result = _shared_verifier(cfg).score(solution_str, ground_truth, options)
    return {**result, **_result(cfg, result["acc"] == 1.0, result["pred"])}
