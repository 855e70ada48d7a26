"""A scoring worker process: reads JSON lines {"i", ...item} and answers {"i", ...result}, one item at a time.

Run as `python -m treepo_ray.rewards._worker MEMORY_MB KIND [ARGS]` (rewards/workers.py starts them). It bounds its
own address space, so a pathological item ends in MemoryError instead of swapping, and (for a user other than root,
whom the kernel does not limit) the processes it may start; a hang is ended by the parent, which kills this process's
group at the item's CPU-time limit. Two kinds:

- `math`: {"pred", "gold"} -> {"ok"}: math-verify's symbolic equivalence with the sympy rules of rewards/forms.py.
  Model output is parsed, never executed.
- `function PATH NAME KWARGS_JSON`: the user's reward function NAME from the file PATH (verl's
  `custom_reward_function`), called as NAME(data_source=, solution_str=, ground_truth=, extra_info=, **KWARGS) for
  {"data_source", "solution_str", "ground_truth", "extra_info"} -> {"score", "acc"?, "pred"?} or {"error", "cause"}
  (cause "nonfinite" for a NaN or infinite score, "error" for anything else it raised or returned).

A worker that cannot start (math-verify missing, the reward file fails to import) answers {"fatal": why} and exits.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import resource
import signal
import sys
import traceback
from pathlib import Path

from treepo_ray.rewards.forms import equal


def math_handler(args: list[str]):
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    equal("1", "1")  # import sympy and the parsers before announcing readiness

    def handle(item: dict) -> dict:
        try:
            return {"ok": equal(item["pred"], item["gold"])}
        except (Exception, MemoryError, RecursionError):
            return {"ok": False}

    return handle


def load_function(path: str, name: str):
    """The callable `name` of the Python file at `path` (imported under a private module name)."""
    spec = importlib.util.spec_from_file_location(f"treepo_custom_reward_{Path(path).stem}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AttributeError(f"{path} defines no function {name!r}")
    return fn


def normalized(value) -> dict:
    """A reward function's return value as {"score", "acc"?, "pred"?}: a number, or a dict with a numeric 'score'
    (verl's convention); anything else raises TypeError saying what came back."""
    if isinstance(value, dict):
        if "score" not in value:
            raise TypeError(f"returned a dict without 'score' (keys {sorted(value)[:8]})")
        out = {"score": _number(value["score"], "'score'")}
        if value.get("acc") is not None:
            out["acc"] = _number(value["acc"], "'acc'")
        if value.get("pred") is not None:
            out["pred"] = str(value["pred"])[:1000]
        return out
    return {"score": _number(value, "the score")}


class NonFiniteReward(ValueError):
    """A reward function returned NaN or an infinity: no reward, not a wrong answer."""


def _number(v, what: str) -> float:
    if hasattr(v, "item") and callable(v.item):  # numpy / torch scalars
        v = v.item()
    if not isinstance(v, (int, float)):
        raise TypeError(f"returned {type(v).__name__} as {what}; expected a number or a dict with a numeric 'score'")
    x = float(v)
    if not math.isfinite(x):
        raise NonFiniteReward(f"returned {x} as {what}")
    return x


def _uses_builtin_scorers(fn) -> bool:
    """Whether the function's module holds anything from treepo_ray.rewards (default_compute_score, say)."""
    for value in getattr(fn, "__globals__", {}).values():
        name = value.__name__ if isinstance(value, type(sys)) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.startswith("treepo_ray.rewards"):
            return True
    return False


def function_handler(args: list[str]):
    path, name, kwargs = args[0], args[1], json.loads(args[2])
    fn = load_function(path, name)
    if _uses_builtin_scorers(fn):  # it may call default_compute_score: import math-verify now, not within the
        equal("1", "1")            # first item's deadline
    def handle(item: dict) -> dict:
        try:
            return normalized(fn(data_source=item["data_source"], solution_str=item["solution_str"],
                                 ground_truth=item["ground_truth"], extra_info=item["extra_info"], **kwargs))
        except (Exception, MemoryError, RecursionError) as err:
            where = traceback.extract_tb(err.__traceback__)[-1] if err.__traceback__ else None
            at = f" ({Path(where.filename).name}:{where.lineno})" if where else ""
            cause = "nonfinite" if isinstance(err, NonFiniteReward) else "error"
            return {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}{at}", "cause": cause}

    return handle


HANDLERS = {"math": math_handler, "function": function_handler}
MAX_CHILDREN = 32
"""Processes a worker may start beyond those its user already runs (RLIMIT_NPROC counts per user)."""


def _limit_processes() -> None:
    """Cap the processes this worker (and its children) may start; the kernel does not apply it to root."""
    uid = os.getuid()
    if uid == 0:
        return
    running = sum(1 for d in os.listdir("/proc") if d.isdigit() and _owner(d) == uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (running + MAX_CHILDREN, running + MAX_CHILDREN))


def _owner(pid: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


PARENT_PID = "TREEPO_RAY_SCORING_PARENT"
"""The pid of the process that starts a worker (set by rewards/workers.py)."""


def _die_with_parent() -> None:
    """Have the kernel kill this worker when the process that started it dies. The worker leads a session of its own,
    so nothing else would: a verifier killed while this worker computes a tower of exponents (in C, holding the GIL,
    so no thread of ours could watch) would leave it computing for ever."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if str(os.getppid()) != os.environ.get(PARENT_PID, str(os.getppid())):
        os._exit(0)  # the parent died before the line above


def main() -> None:
    _die_with_parent()
    memory_mb, kind, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    if memory_mb > 0:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    _limit_processes()
    # The protocol owns the original stdout; anything a library (or a reward function) prints goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        handle = HANDLERS[kind](args)
    except (Exception, MemoryError) as err:
        out.write(json.dumps({"fatal": f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"}) + "\n")
        return
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        item = json.loads(line)
        out.write(json.dumps({"i": item["i"], **handle(item)}) + "\n")


if __name__ == "__main__":
    main()
