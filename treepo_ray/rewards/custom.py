"""A user's own reward function, as verl takes it: `custom_reward_function.path` (a Python file) and `.name` (the
function in it, `compute_score` by default), called as

    compute_score(data_source, solution_str, ground_truth, extra_info, **reward_kwargs) -> float | dict

(keyword arguments; a dict must hold a numeric 'score' and may add 'acc' and 'pred'). It scores every row, whatever
its data source (it may call treepo_ray.rewards.default_compute_score for the ones it does not handle itself), in
bounded worker processes like the math verifier (rewards/workers.py), which see only the environment variables named
in `env`. An item that overruns the time limit, runs out of memory, raises, or returns NaN or something that is not a
score has no reward: it comes back with "failed" (its cause) and "error" (the reason, printed once), and is left out
of the loss, never scored as wrong.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from treepo_ray.config import UserError
from treepo_ray.rewards.workers import WorkerPool


@dataclass
class RewardFunctionConfig:
    """verl's `custom_reward_function` section: your own reward function instead of the built-in scorers."""

    path: str = ""
    """Python file that defines the function ('' = the built-in scorers, picked by each row's data source)."""
    name: str = "compute_score"
    """The function's name in that file."""
    reward_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of every call."""
    env: list[str] = field(default_factory=list)
    """Environment variables the function may read (an LLM judge's API key, say); the workers see no others beyond
    PATH, HOME, the locale and the Python path."""

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def resolved_path(self) -> str:
        return str(Path(self.path).expanduser().resolve())


def check_reward_function(cfg: RewardFunctionConfig) -> None:
    """Import the configured function here, once, so a wrong path or name is one clear error before the job starts
    (the verifier workers import it again in their own processes)."""
    from treepo_ray.rewards._worker import load_function

    path = Path(cfg.path).expanduser()
    where = f"custom_reward_function.path = {cfg.path!r}"
    if not path.is_file():
        raise UserError(f"{where}: no such file")
    try:
        load_function(str(path.resolve()), cfg.name)
    except AttributeError:
        raise UserError(f"{where}: the file defines no function custom_reward_function.name = {cfg.name!r}") from None
    except Exception as err:  # noqa: BLE001 - whatever the user's module raises on import
        raise UserError(f"{where}: importing it fails: {type(err).__name__}: {' '.join(str(err).split())}") from None
    try:
        json.dumps(cfg.reward_kwargs)
    except TypeError as err:
        raise UserError(f"custom_reward_function.reward_kwargs: not JSON-serialisable ({err})") from None


class FunctionScorer:
    """Scores items with the user's function in `num_workers` bounded processes; close() when done."""

    def __init__(self, cfg: RewardFunctionConfig, num_workers: int, memory_mb: int, timeout_s: float):
        self.cfg, self.timeout_s = cfg, timeout_s
        self._pool = WorkerPool("function", [cfg.resolved_path(), cfg.name, json.dumps(cfg.reward_kwargs)],
                                num_workers, memory_mb, tuple(cfg.env))
        self.errors = 0
        """Items whose call raised, timed out or returned something unusable (none has a reward)."""
        self._reported: set[str] = set()

    def score(self, items: list[tuple[str, str, object, dict]]) -> list[dict]:
        """{"score", "acc"?, "pred"?}, or {"failed": "error" | "timeout" | "nonfinite", "error": why}, of each
        (data_source, solution, ground_truth, extra_info)."""
        pending = deque((i, {"data_source": s, "solution_str": sol, "ground_truth": gt, "extra_info": extra})
                        for i, (s, sol, gt, extra) in enumerate(items))
        answers = self._pool.run(pending, self.timeout_s)
        out = []
        for i in range(len(items)):
            got = answers.get(i) or {"lost": "died"}
            got.pop("i", None)
            if "lost" in got:
                got = {"failed": "timeout", "error": f"no answer within {self.timeout_s:g} s of CPU time"} \
                    if got["lost"] == "timeout" else {"failed": "error", "error": "the worker died (out of memory?)"}
            elif "error" in got:
                got = {"failed": got.pop("cause", "error"), "error": got["error"]}
            if "failed" in got:
                self.errors += 1
                self._report(got["error"])
            out.append(got)
        return out

    def _report(self, error: str) -> None:
        """Print each distinct failure once (the first 20), so a broken function is seen but does not flood logs."""
        if error not in self._reported and len(self._reported) < 20:
            self._reported.add(error)
            print(f"custom reward function {self.cfg.name} ({self.cfg.path}): {error}; no reward, left out of the loss",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        self._pool.close()
