"""The engine router: how any process reaches the generator pool's engines. Small and picklable: schedulers, the
healer and the driver's evaluator each hold one.

A tree's calls all go to the engine its first call went to (its prefix cache lives there); a new tree goes to the
engine with the fewest live trees of this router. A call has one path, `call` (awaited; `call_sync` runs it to
completion in a thread of its own loop): when the engine is lost, stops answering within runtime.deadlines.generate_s
(it is killed), or its step raises an error that is not bad input (out of memory, a CUDA error: killed, since its
state may be broken), the call is sent again, whole, to a live engine, up to runtime.faults.max_resends times, and
up to runtime.faults.max_engine_errors engines failing the same call (then the request is at fault). An engine given
up is never routed to again; the supervisor (supervisor.py) drops it from the pool and the pool asks for a
replacement. A router catches up with the pool's member list (the registry, registry.py) at most every
runtime.elastic.poll_s, and at once after a loss.

Nothing of a tree lives in an engine: the schedulers own the tree state, and a request carries the full prefix ids.
A re-sent request names a cache key of the dead engine, which the new engine does not know, so it computes the
prefix from the ids (engines/base.py). Seeded sampling makes the re-sent segment the one the dead engine would
have produced, up to float rounding (a token drawn at a CDF boundary may differ: engines/hf/engine.py), so a loss
costs time, not trajectories.

Thread-safe: the healer's threads share one router (its routing table is changed under a lock; calls wait outside
it).
"""

from __future__ import annotations

import asyncio
import threading
import time

import ray
from ray.exceptions import RayActorError, RayTaskError

from treepo_ray.runtime.liveness import DeadlineExceeded, actor_lost, within
from treepo_ray.runtime.registry import record_async


class EngineRouter:
    """Routes calls to the pool's engines (module docstring). Made by GeneratorPool.router(); pickles whole."""

    def __init__(self, registry, rt):
        """`rt`: the runtime section (deadlines, faults, elastic.poll_s)."""
        self.registry = registry
        self.deadlines, self.faults, self.refresh_s = rt.deadlines, rt.faults, rt.elastic.poll_s
        self._epoch = 0
        self._engines: dict[str, object] = {}  # engine id -> actor, as this router knows them
        self._trees: dict[str, int] = {}  # engine id -> live trees routed there
        self._home: dict[str, str] = {}  # tree (query id) -> engine id
        self._dead: set[str] = set()  # never re-admitted, even if a stale member list still names it
        self._checked = 0.0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_checked")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._checked = 0.0  # another process's clock: refresh on the first call
        self._lock = threading.Lock()

    # -------------------------------------------------------------------------------- the routing table

    def set_engines(self, epoch: int, engines: dict) -> None:
        """Adopt a member list; trees homed on engines that left are re-routed on their next call."""
        with self._lock:
            self._epoch = max(self._epoch, epoch)
            keep = {eid: e for eid, e in engines.items() if eid not in self._dead}
            for eid in set(self._engines) - set(keep):
                self._forget(eid)
            self._engines = keep
            for eid in keep:
                self._trees.setdefault(eid, 0)

    def _forget(self, eid: str) -> None:
        self._engines.pop(eid, None)
        self._trees.pop(eid, None)
        for qid in [q for q, home in self._home.items() if home == eid]:
            del self._home[qid]

    def _route(self, query_id: str) -> tuple[str, object] | None:
        """(engine id, actor) of `query_id`'s tree, homing a new tree on the least busy engine; None: no engine."""
        with self._lock:
            home = self._home.get(query_id)
            if home is None or home not in self._engines:
                if not self._engines:
                    return None
                home = min(self._engines, key=self._trees.__getitem__)
                self._home[query_id] = home
                self._trees[home] += 1
            return home, self._engines[home]

    def _give_up(self, eid: str) -> None:
        with self._lock:
            self._dead.add(eid)
            self._forget(eid)
            self._checked = 0.0  # look for replacements on the next call

    def finish(self, query_id: str, cache_keys: list[str]) -> None:
        """The tree is complete: free its caches on its engine (keys of a dead engine are unknown to the new one,
        which ignores them) and forget its route."""
        with self._lock:
            home = self._home.pop(query_id, None)
            engine = self._engines.get(home) if home is not None else None
            if engine is not None:
                self._trees[home] -= 1
        if engine is not None and cache_keys:
            engine.release.remote(cache_keys)

    async def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._checked >= self.refresh_s:
            self._checked = now
            got = await within(self.registry.engines_since.remote(self._epoch), self.deadlines.call_s, "registry")
            if got is not None:
                epoch, (members,) = got
                self.set_engines(epoch, await within(members, self.deadlines.call_s, "member list"))

    # -------------------------------------------------------------------------------- the one call path

    async def call(self, query_id: str, method: str, *args):
        """`engine.<method>(*args)` on the engine of `query_id`'s tree, sent again to another engine if that one
        fails (module docstring; the method must be safe to run twice: a dead engine's half-done call is lost)."""
        if query_id not in self._home:
            await self._refresh()  # a new tree: pick up engines that joined meanwhile
        wait_until, errors = time.monotonic() + self.faults.engine_wait_s, 0
        for _ in range(self.faults.max_resends + 1):
            while (route := self._route(query_id)) is None:
                if time.monotonic() > wait_until:
                    raise DeadlineExceeded(f"no live engine for {self.faults.engine_wait_s:g}s "
                                           "(runtime.faults.engine_wait_s)")
                await asyncio.sleep(self.refresh_s)
                await self._refresh(force=True)
            eid, engine = route
            try:
                return await within(getattr(engine, method).remote(*args), self.deadlines.generate_s,
                                    f"engine {eid[:8]} {method} for {query_id}")
            except (RayActorError, RayTaskError, DeadlineExceeded) as err:
                errors = await self._failed(eid, engine, err, query_id, method, args, errors)
        raise RuntimeError(f"{query_id}: sent {self.faults.max_resends + 1} times and every engine failed under it "
                           "(runtime.faults.max_resends)")

    def call_sync(self, query_id: str, method: str, *args):
        """`call`, blocking (a thread of a threaded actor, or the driver)."""
        return asyncio.run(self.call(query_id, method, *args))

    def generate(self, query_id: str, requests: list):
        """Awaitable of the results of `requests`, all of one tree."""
        return self.call(query_id, "generate", requests)

    async def _failed(self, eid: str, engine, err: BaseException, query_id: str, method: str, args: tuple,
                      errors: int) -> int:
        """A call on engine `eid` failed: give the engine up (killed if alive) and return the engine errors of this
        call so far, for the caller to send the call again; or raise: a request the engine refuses as bad input (a
        ValueError), anything else, and an engine error once more than max_engine_errors engines failed the same
        call."""
        if isinstance(err, RayActorError) and not isinstance(err, RayTaskError):
            if not actor_lost(err):
                raise err
            why = None
        elif isinstance(err, DeadlineExceeded):  # alive, not answering
            why = ("engines_stuck", f"engine {eid[:8]} stuck ({err}): killed")
        elif isinstance(err, RayTaskError) and not isinstance(err.cause, (ValueError, RayActorError)):
            errors += 1
            if errors > self.faults.max_engine_errors:
                raise err
            cause = f"{type(err.cause).__name__}: {str(err.cause).splitlines()[0] if str(err.cause) else ''}"
            why = ("engine_errors", f"engine {eid[:8]} failed ({cause}): killed and replaced")
        else:
            raise err
        if why is not None:
            ray.kill(engine)
            await record_async(self.registry, *why, self.deadlines.call_s)
        self._give_up(eid)
        n = len(args[0]) if method == "generate" else 1  # count requests, not calls
        await record_async(self.registry, "resent_requests", f"engine {eid[:8]} gone mid-call "
                           f"({type(err).__name__}): {n} {method} requests of {query_id} sent again",
                           self.deadlines.call_s, n)
        return errors
