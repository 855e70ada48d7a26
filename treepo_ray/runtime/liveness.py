"""Liveness: every blocking call on an actor has a deadline, and actors that stop answering are found by heartbeat.

    get(refs, timeout_s, what)      ray.get with a deadline; past it, DeadlineExceeded says what did not answer
    within(ref, timeout_s, what)    the same, awaited (for async actors and the schedulers)
    started(actors, timeout_s)      new actors must answer within the deadline; one that could not be scheduled is
                                    named with the resources it asked for and what the cluster has free
    Heartbeat                       pings a set of actors: dead ones, and stuck ones (alive, but a ping unanswered
                                    for longer than runtime.deadlines.heartbeat_s); the supervisor runs it
    ping, actor_lost, actor_id, on_this_node, brief
                                    what every actor module shares: a trivial call, telling a lost actor from other
                                    errors, placement on the driver's node, one-line errors

The deadlines themselves are runtime.deadlines (job/config.py: DeadlineConfig), one per kind of call. A deadline
that passes and is not recovered from stops the run with one line saying what did not answer (RunStopped).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from treepo_ray.job.faults import RunStopped


class DeadlineExceeded(RunStopped):
    """A call on an actor did not answer within its deadline."""


def get(refs, timeout_s: float, what: str):
    """`ray.get(refs)`, or DeadlineExceeded naming `what` after `timeout_s` seconds."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise DeadlineExceeded(f"{what}: no answer within {timeout_s:g}s") from None


async def within(ref, timeout_s: float, what: str):
    """`await ref`, or DeadlineExceeded naming `what` after `timeout_s` seconds."""
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
    except asyncio.TimeoutError:
        raise DeadlineExceeded(f"{what}: no answer within {timeout_s:g}s") from None


def started(actors: list[tuple[str, object, dict]], timeout_s: float) -> None:
    """Wait until every (name, actor, resources it asked for) answers a ping: scheduled and constructed. A
    constructor's error is raised as is; an actor still pending after `timeout_s` raises DeadlineExceeded naming
    it, its resources and the cluster's free resources (the usual cause: no node offers what it asks for)."""
    refs = {ping(actor): (name, asks) for name, actor, asks in actors}
    done, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    ray.get(done)
    if pending:
        late = "; ".join(f"{refs[r][0]} (asks {refs[r][1]})" for r in pending)
        raise DeadlineExceeded(f"not started within {timeout_s:g}s (runtime.deadlines.start_s): {late}; the "
                               f"cluster has free {free_resources()}")


class Heartbeat:
    """Pings the actors it is shown, one ping in flight per actor. `check(pings)` (name -> a function that sends
    that actor a ping: `ping(actor)`, or a method in a concurrency group of its own) returns (dead, stuck): the names
    whose actor died, with the error, and the names whose ping has waited longer than `timeout_s` (`start_s` for an
    actor that has never answered yet: it may still be starting). A ping queues behind a sync actor's running call,
    so an actor is judged stuck only where its ping runs beside its work: async actors (engines, schedulers), the
    threaded healer, and learner ranks (their `alive`, in a concurrency group of its own)."""

    def __init__(self, timeout_s: float, start_s: float):
        self.timeout_s, self.start_s = timeout_s, start_s
        self._pings: dict[str, tuple[object, float]] = {}  # name -> (ping ref, when sent)
        self._answered: set[str] = set()  # names that answered a ping (or are known to be up)

    def check(self, pings: dict[str, Callable[[], object]]) -> tuple[list[tuple[str, BaseException]], list[str]]:
        now = time.monotonic()
        for name in set(self._pings) - set(pings):
            self.forget(name)
        for name, send in pings.items():
            if name not in self._pings:
                self._pings[name] = (send(), now)
        by_ref = {ref: name for name, (ref, _) in self._pings.items()}
        done, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        dead = []
        for ref in done:
            name = by_ref[ref]
            del self._pings[name]
            try:
                ray.get(ref)
                self._answered.add(name)
            except RayActorError as err:
                if actor_lost(err):
                    dead.append((name, err))
        limit = lambda name: self.timeout_s if name in self._answered else self.start_s  # noqa: E731
        stuck = [name for name, (_, sent) in self._pings.items() if now - sent > limit(name)]
        return dead, stuck

    def answered(self, name: str) -> None:
        """`name` is known to be up (an engine admitted after it started): judge it by timeout_s from now on."""
        self._answered.add(name)

    def forget(self, name: str) -> None:
        """`name` is gone or replaced: a new actor under this name starts from scratch."""
        self._pings.pop(name, None)
        self._answered.discard(name)


# ---------------------------------------------------------------------------------------------- shared helpers


def _ping(_actor) -> bool:
    return True


def ping(actor):
    """ObjectRef that resolves once `actor` runs a trivial call (fails if it is dead); no method needed."""
    return actor.__ray_call__.remote(_ping)


def actor_lost(err: BaseException) -> bool:
    """True when `err` says the called actor itself died. A task whose *argument* came from a dead actor fails
    with RayTaskError(ActorDiedError), which is also a RayActorError but says nothing about the callee."""
    return isinstance(err, RayActorError) and not isinstance(err, RayTaskError)


def actor_id(actor) -> str:
    return actor._actor_id.hex()


def on_this_node() -> NodeAffinitySchedulingStrategy:
    """Scheduling strategy that places an actor on the caller's node (the driver's: same failure domain)."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def free_resources() -> dict:
    return {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}


def brief(err: BaseException) -> str:
    """An error as one line: its type and the first line of its message (Ray's carry pages of context)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
