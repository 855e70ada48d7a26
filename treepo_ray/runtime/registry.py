"""The run's control plane: two small actors that import nothing heavy (no torch), placed on the driver's node so
that they fail only with the driver, and the helpers that tell a lost actor from other errors.

    RuntimeRegistry   the generator pool's current members (each scheduler's routing table catches up from it)
                      and a journal of fault events, drained into each step's `fault/*` metrics
    VerifierFront     scoring with a timeout, retried on the next verifier, then scored as a failure
"""

from __future__ import annotations

import asyncio
import math
import sys
import time

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def on_this_node() -> NodeAffinitySchedulingStrategy:
    """Scheduling strategy that places an actor on the caller's node (the driver's: same failure domain)."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def actor_lost(err: BaseException) -> bool:
    """True when `err` says the called actor itself died. A task whose *argument* came from a dead actor fails
    with RayTaskError(ActorDiedError), which is also a RayActorError but says nothing about the callee."""
    return isinstance(err, RayActorError) and not isinstance(err, RayTaskError)


def _ping(_actor) -> bool:
    return True


def ping(actor):
    """ObjectRef that resolves once `actor` runs a trivial call (fails if it is dead); no method needed."""
    return actor.__ray_call__.remote(_ping)


def actor_id(actor) -> str:
    return actor._actor_id.hex()


# ---------------------------------------------------------------------------------------------- registry


@ray.remote(num_cpus=0)
class RuntimeRegistry:
    """The run's membership list and fault journal. Small, stateless about trees, called rarely."""

    def __init__(self):
        self._epoch, self._members = 0, []
        self._events: list[tuple[float, str, str, int]] = []

    # The member list travels as [ObjectRef of {id: engine actor}]: a ref nested in a list is passed on as a ref, so
    # this process never deserialises engine handles (which would import the engine's module, torch and all).
    def set_engines(self, epoch: int, members: list) -> None:
        if epoch > self._epoch:  # calls from the one driver arrive in order; the guard keeps it so
            self._epoch, self._members = epoch, list(members)

    def engines_since(self, epoch: int):
        """(epoch, [ObjectRef of {id: engine}]) if the members changed after `epoch`, else None."""
        return None if epoch >= self._epoch else (self._epoch, self._members)

    def record(self, kind: str, detail: str = "", count: int = 1) -> None:
        self._events.append((time.time(), kind, detail, int(count)))

    def drain(self) -> list[tuple[float, str, str, int]]:
        out, self._events = self._events, []
        return out


def event_metrics(events: list[tuple[float, str, str, int]]) -> dict[str, float]:
    """`fault/<kind>` totals of drained journal events."""
    out: dict[str, float] = {}
    for _, kind, _, count in events:
        out[f"fault/{kind}"] = out.get(f"fault/{kind}", 0.0) + count
    return out


def report(message: str) -> None:
    """A fault's reason, on the console of the process that saw it (Ray forwards actors' stderr to the driver)."""
    print(f"[treepo-ray fault] {message}", file=sys.stderr, flush=True)


def sanitize_scores(scores, n: int, failure_score: float) -> tuple[list[float], list[str]]:
    """`n` finite rewards out of a verifier's answer: a wrong count fails all, a NaN/inf or non-number fails that
    item. Returns the rewards and one reason per failure."""
    try:
        values = list(scores)
    except TypeError:
        return [failure_score] * n, [f"verifier returned {type(scores).__name__}, not a list of {n} scores"]
    if len(values) != n:
        return [failure_score] * n, [f"verifier returned {len(values)} scores for {n} solutions"]
    out, reasons = [], []
    for i, v in enumerate(values):
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = math.nan
        if math.isfinite(x):
            out.append(x)
        else:
            out.append(failure_score)
            reasons.append(f"score {i} is {v!r}")
    return out, reasons


# ---------------------------------------------------------------------------------------------- verification


@ray.remote(num_cpus=0)
class VerifierFront:
    """Scoring with retries, in one small async actor in front of the verifier actors (so that callers get an
    ObjectRef, which an async scheduler awaits and a thread ray.get()s alike). It lives on the driver's node.

    A call whose verifier raises or takes longer than `call_timeout_s` is retried on the next verifier, at most
    `retries` times; a verifier that dies under a call (or is restarting) does not use up a retry while the call's
    overall deadline, call_timeout_s x (retries + 1), lasts. After that its solutions score `failure_score` (the
    rewards layer's wrong score) and the reason is logged and counted (fault/verifier_failures); NaN/inf scores
    become failures the same way (fault/nonfinite_rewards). A timed-out verifier is killed and restarted in place:
    verifiers hold no state, so Ray's in-place restart (max_restarts=-1) is the right tool for them; they run with
    max_task_retries=0 because the retry here goes to the next verifier instead of waiting for the restart.
    """

    def __init__(self, verifiers: list, registry, retries: int, call_timeout_s: float, failure_score: float):
        self.verifiers, self.registry = list(verifiers), registry
        self.retries, self.call_timeout_s, self.failure_score = retries, call_timeout_s, float(failure_score)
        self._next = 0

    async def score(self, items: list[tuple[str, str, str]]) -> list[float]:
        """One reward per (data_source, solution, ground_truth), never NaN, never an exception."""
        n, why, failures = len(items), "", 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.call_timeout_s * (self.retries + 1)
        while True:
            actor = self.verifiers[self._next % len(self.verifiers)]
            self._next += 1
            try:
                scores = await asyncio.wait_for(asyncio.wrap_future(actor.score.remote(items).future()),
                                                self.call_timeout_s)
            except asyncio.TimeoutError:
                why = f"timed out after {self.call_timeout_s:g}s"
                ray.kill(actor, no_restart=False)  # hung: restart it, so later calls do not queue behind this one
            except ActorUnavailableError as err:
                # Died under the call or restarting: Ray brings it back; try the next one without using up a retry
                # (until the overall deadline), so that a restart of every verifier at once fails nothing.
                why = f"verifier unavailable ({str(err).splitlines()[0] if str(err) else 'restarting'})"
                self.registry.record.remote("verifier_retries", f"scoring {n} solutions: {why}; retrying")
                if loop.time() < deadline:
                    await asyncio.sleep(0.1)
                    continue
            except Exception as err:  # noqa: BLE001 - a dead verifier or a scoring error: retry, then fail the items
                why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            else:
                return self._sanitized(scores, n)
            failures += 1
            if failures > self.retries:
                break
            self.registry.record.remote("verifier_retries", f"scoring {n} solutions: {why}; retrying")
        msg = f"{n} solutions scored as failures after {failures} failed attempts: {why}"
        report(msg)
        self.registry.record.remote("verifier_failures", msg, n)
        return [self.failure_score] * n

    def _sanitized(self, scores, n: int) -> list[float]:
        out, reasons = sanitize_scores(scores, n, self.failure_score)
        if reasons:
            msg = f"{len(reasons)} non-finite or malformed rewards scored as failures: {'; '.join(reasons[:3])}"
            report(msg)
            self.registry.record.remote("nonfinite_rewards", msg, len(reasons))
        return out
