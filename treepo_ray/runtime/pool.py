"""The generator pool: the run's engine actors, routed to and kept alive.

One class, two roles. Every copy routes (a scheduler or the healer holds a pickled copy): a tree's requests all go
to the engine its first request went to (its prefix cache lives there), a new tree goes to the engine with the
fewest live trees of that copy, and when that engine dies mid-segment the requests are sent again, whole, to a live
one. The driver's own pool also keeps the membership: it notices deaths, replaces lost engines, adds engines where
Ray reports room, and loads the pool's current weights into an engine before it joins. Copies catch up with the
member list through the RuntimeRegistry (registry.py), which also journals the fault events behind each step's
`fault/*` metrics.

Nothing of a tree lives in an engine: the schedulers own the tree state, and a request carries the full prefix ids.
A re-sent request names a cache key of the dead engine, which the new engine does not know, so it computes the
prefix from the ids (engines/base.py). Seeded sampling makes the re-sent segment the one the dead engine would
have produced, up to float rounding (a token drawn at a CDF boundary may differ: engines/hf/engine.py), so a loss
costs time, not trajectories.

An engine that is alive but stops answering (a ping unanswered for runtime.deadlines.heartbeat_s, or a call past
runtime.deadlines.generate_s) is killed and replaced like a dead one; so is an engine whose step raised an error that
is not bad input (out of memory, a CUDA error): its state may be broken, and the call is re-sent to another engine,
up to runtime.faults.max_engine_errors engines per call.

Engines are replaced, not restarted in place by Ray (max_restarts=0, max_task_retries=0). A call in flight to a
dead engine then fails at once with ActorDiedError, and the scheduler re-sends it to a live engine; Ray's retry
would instead wait for the engine's restart (after a preemption: for a new node) and run on a fresh actor that
still holds the base weights. The replacement is a new actor that joins the routing tables only after it has
loaded the weights the rest of the pool runs. While the cluster has no room it stays a pending actor, outside the
pool: the resource demand an autoscaler answers with a new node. Verifiers, which hold no state, are the case
where Ray's in-place restart is the right tool (verifier.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treepo_ray.engines.base import SegmentRequest, SegmentResult
from treepo_ray.job.config import DeadlineConfig
from treepo_ray.runtime.engine import EngineActor, engine_placement, release_placement, tensor_parallel_size
from treepo_ray.runtime.liveness import DeadlineExceeded, Heartbeat, get, within
from treepo_ray.runtime.registry import RuntimeRegistry, actor_id, actor_lost, on_this_node, report


def _watch(manager_ref, stop: threading.Event, poll_s: float) -> None:
    """The pool manager's thread: one `tick` every `poll_s` until stopped or the manager is gone."""
    while not stop.wait(poll_s):
        manager = manager_ref()
        if manager is None:
            return
        try:
            manager.tick()
        except Exception as err:  # a monitoring hiccup must not end the run; the next round tries again
            report(f"generator pool watch: {type(err).__name__}: {err}")
        del manager


@dataclass
class EngineSpec:
    """How to start one engine actor, and the resources it asks of Ray (runtime.engine_*)."""

    engine: str
    model_path: str
    engine_kwargs: dict = field(default_factory=dict)
    torch_threads: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict = field(default_factory=dict)
    groups: dict = field(default_factory=dict, init=False, repr=False)
    """Actor id -> placement group of each tensor-parallel engine started (engine.py), until `release`."""

    def __post_init__(self) -> None:
        tp = tensor_parallel_size(self.engine, self.engine_kwargs)
        if tp > 1 and self.num_gpus != tp:
            raise ValueError(f"runtime.engine_gpus = {self.num_gpus}, but model.engine_kwargs.tensor_parallel_size = "
                             f"{tp}: each engine needs {tp} GPUs")
        weakref.finalize(self, _release_all, self.groups)  # a dropped pool's engines die; their groups go too

    @classmethod
    def of(cls, cfg, model_path: str) -> "EngineSpec":
        """The engines of a run's config (model.engine, runtime.engine_*)."""
        rt = cfg.runtime
        return cls(cfg.model.engine, model_path, cfg.model.engine_kwargs, rt.torch_threads, rt.engine_cpus,
                   rt.engine_gpus, rt.engine_resources)

    def demand(self) -> dict[str, float]:
        want = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        return {k: float(v) for k, v in want.items() if v}

    def fits(self, available: dict) -> bool:
        """Whether `available` (ray.available_resources()) has room for one more engine."""
        return all(available.get(k, 0.0) >= v for k, v in self.demand().items())

    def start(self):
        tp = tensor_parallel_size(self.engine, self.engine_kwargs)
        if tp > 1:  # in its GPUs' placement group, where vLLM's Ray executor finds them
            group = engine_placement(tp, self.num_cpus, self.resources)
            place = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                     placement_group_capture_child_tasks=True)
            actor = EngineActor.options(num_cpus=self.num_cpus, scheduling_strategy=place, max_restarts=0,
                                        max_task_retries=0).remote(self.engine, self.model_path, self.engine_kwargs,
                                                                   self.torch_threads)
            self.groups[actor_id(actor)] = group
            return actor
        return EngineActor.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources or None,
                                   max_restarts=0, max_task_retries=0).remote(
            self.engine, self.model_path, self.engine_kwargs, self.torch_threads)

    def release(self, keep: set[str]) -> None:
        """Remove the placement groups of engines not in `keep` (dead, dropped or killed): their GPUs go back."""
        for eid in [eid for eid in self.groups if eid not in keep]:
            release_placement(self.groups.pop(eid))


def _release_all(groups: dict) -> None:
    for eid in list(groups):
        release_placement(groups.pop(eid))


class GeneratorPool:
    """The run's engines. Built once on the driver, which keeps `num_engines` engine actors requested at all times
    (lost ones are replaced; a replacement waits as a pending actor until the cluster has room) and adds more, up to
    `max_engines`, whenever Ray reports room for one; an engine joins only after loading the weights the pool runs.
    A thread polls every `poll_s` once `start()` is called.

    Pickled copies (what schedulers and the healer hold) only route: `generate` / `call` / `call_sync` / `finish`.
    Each copy catches up with the registry's member list at most every `poll_s` seconds, and at once after a loss.
    """

    # What a pickled copy keeps: the routing state. The rest (members, pending actors, the thread) is the driver's.
    _ROUTING = ("registry", "max_resends", "refresh_s", "engine_wait_s", "deadlines", "max_engine_errors", "_epoch",
                "_engines", "_trees", "_home", "_dead")

    def __init__(self, spec: EngineSpec, num_engines: int, max_engines: int = 0, poll_s: float = 0.5,
                 max_resends: int = 16, engine_wait_s: float = 900.0, startup_timeout_s: float = 600.0,
                 registry=None, deadlines: DeadlineConfig | None = None, max_engine_errors: int = 3):
        if num_engines < 1:
            raise ValueError(f"num_engines = {num_engines}; the pool needs at least one engine")
        # Routing (every copy).
        self.registry = registry or RuntimeRegistry.options(scheduling_strategy=on_this_node()).remote()
        self.max_resends, self.refresh_s, self.engine_wait_s = max_resends, poll_s, engine_wait_s
        self.deadlines, self.max_engine_errors = deadlines or DeadlineConfig(), max_engine_errors
        self._epoch = 0
        self._engines: dict[str, object] = {}  # engine id -> actor, as this copy knows them
        self._trees: dict[str, int] = {}  # engine id -> live trees this copy routed there
        self._home: dict[str, str] = {}  # tree (query id) -> engine id
        self._dead: set[str] = set()  # never re-admitted, even if a stale member list still names it
        self._checked = 0.0
        # Membership (the driver's pool only).
        self.spec, self.num_engines = spec, num_engines
        self.max_engines = max(max_engines, num_engines)
        self.poll_s = poll_s
        self._members: dict[str, object] = {}
        self._pending: dict[str, tuple[object, object]] = {}  # id -> (actor, ObjectRef that resolves when it is up)
        self._heartbeat = Heartbeat(self.deadlines.heartbeat_s)
        self._asked: dict[str, float] = {}  # pending engine id -> when it was asked for (until reported)
        self._weights: tuple[int, object] = (0, None)  # the version (and ObjectRef) every live engine holds
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._growth = threading.Event()  # cleared while paused: no growth (a restarting learner needs the room)
        self._growth.set()
        self._thread: threading.Thread | None = None
        self.joined = self.lost = 0
        self.init_failures = 0  # engines in a row whose constructor raised (3: replacements stop)
        for _ in range(num_engines):
            self._spawn()
        try:
            self._await_first(startup_timeout_s)
        except BaseException:
            self.close()  # no engine came up: leave no actor behind (the registry included)
            raise

    def __getstate__(self) -> dict:
        return {k: self.__dict__[k] for k in self._ROUTING}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._checked = 0.0  # another process's clock: refresh on the first call

    # -------------------------------------------------------------------------------- routing (every copy)

    def set_engines(self, epoch: int, engines: dict) -> None:
        """Adopt a member list; trees homed on engines that left are re-routed on their next request."""
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

    def _home_of(self, query_id: str) -> str:
        home = self._home.get(query_id)
        if home is None or home not in self._engines:
            if not self._engines:
                raise RuntimeError("the generator pool has no live engine")
            home = min(self._engines, key=self._trees.__getitem__)
            self._home[query_id] = home
            self._trees[home] += 1
        return home

    async def _refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._checked >= self.refresh_s:
            self._checked = now
            got = await within(self.registry.engines_since.remote(self._epoch), self.deadlines.call_s, "registry")
            if got is not None:
                epoch, (members,) = got
                self.set_engines(epoch, await within(members, self.deadlines.call_s, "member list"))

    def _refresh_sync(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._checked >= self.refresh_s:
            self._checked = now
            got = get(self.registry.engines_since.remote(self._epoch), self.deadlines.call_s, "registry")
            if got is not None:
                epoch, (members,) = got
                self.set_engines(epoch, get(members, self.deadlines.call_s, "member list"))

    def _no_engine(self, deadline: float) -> None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no live engine for {self.engine_wait_s:.0f}s (runtime.faults.engine_wait_s)")

    def _failed(self, eid: str, err: BaseException, query_id: str, method: str, args: tuple, errors: int) -> int:
        """A call on engine `eid` failed: if the engine is lost, stuck (past its deadline) or its step raised (out
        of memory, a CUDA error: its state may be broken), give it up (killed if alive; the pool manager replaces
        it) and let the caller send the call again; returns the engine errors of this call so far. Raised instead:
        a request the engine refuses as bad input (a ValueError), anything else, and an engine error once more than
        max_engine_errors engines failed the same call (then the request is at fault, not the engines)."""
        engine = self._engines.get(eid)
        if isinstance(err, RayActorError):
            if not actor_lost(err):
                raise err
        elif isinstance(err, DeadlineExceeded):  # alive, not answering
            if engine is not None:
                ray.kill(engine)
            self.registry.record.remote("engines_stuck", f"engine {eid[:8]} stuck ({err}): killed")
        elif isinstance(err, RayTaskError) and not isinstance(err.cause, ValueError):
            errors += 1
            if errors > self.max_engine_errors:
                raise err
            if engine is not None:
                ray.kill(engine)
            cause = f"{type(err.cause).__name__}: {str(err.cause).splitlines()[0] if str(err.cause) else ''}"
            self.registry.record.remote("engine_errors", f"engine {eid[:8]} failed ({cause}): killed and replaced")
        else:
            raise err
        self._lost(eid)
        n = len(args[0]) if method == "generate" else 1  # count requests, not calls
        self.registry.record.remote("resent_requests", f"engine {eid[:8]} gone mid-call ({type(err).__name__}): "
                                    f"{n} {method} requests of {query_id} sent again", n)
        return errors

    def _gave_up(self, query_id: str) -> RuntimeError:
        return RuntimeError(f"{query_id}: sent {self.max_resends + 1} times and every engine died under it "
                            "(runtime.faults.max_resends)")

    def generate(self, query_id: str, requests: list[SegmentRequest]):
        """Awaitable of the results of `requests`, all of one tree (call it in an event loop)."""
        return self.call(query_id, "generate", requests)

    async def call(self, query_id: str, method: str, *args):
        """`engine.<method>(*args)` on the engine of `query_id`'s tree, sent again to another engine if that one
        dies before answering (the method must be safe to run twice: a dead engine's half-done call is lost)."""
        if query_id not in self._home:
            await self._refresh()  # a new tree: pick up engines that joined meanwhile
        deadline, errors = time.monotonic() + self.engine_wait_s, 0
        for _ in range(self.max_resends + 1):
            while not self._engines:
                self._no_engine(deadline)
                await asyncio.sleep(self.refresh_s)
                await self._refresh(force=True)
            eid = self._home_of(query_id)
            try:
                return await within(getattr(self._engines[eid], method).remote(*args), self.deadlines.generate_s,
                                    f"engine {eid[:8]} {method} for {query_id}")
            except (RayActorError, RayTaskError, DeadlineExceeded) as err:
                errors = self._failed(eid, err, query_id, method, args, errors)
        raise self._gave_up(query_id)

    def call_sync(self, query_id: str, method: str, *args):
        """Blocking `call`, for callers outside an event loop (threads of a threaded actor)."""
        if query_id not in self._home:
            self._refresh_sync()
        deadline, errors = time.monotonic() + self.engine_wait_s, 0
        for _ in range(self.max_resends + 1):
            while not self._engines:
                self._no_engine(deadline)
                time.sleep(self.refresh_s)
                self._refresh_sync(force=True)
            eid = self._home_of(query_id)
            try:
                return get(getattr(self._engines[eid], method).remote(*args), self.deadlines.generate_s,
                           f"engine {eid[:8]} {method} for {query_id}")
            except (RayActorError, RayTaskError, DeadlineExceeded) as err:
                errors = self._failed(eid, err, query_id, method, args, errors)
        raise self._gave_up(query_id)

    def _lost(self, eid: str) -> None:
        self._dead.add(eid)
        self._forget(eid)
        self._checked = 0.0  # look for replacements on the next call

    def finish(self, query_id: str, cache_keys: list[str]) -> None:
        """The tree is complete: free its caches on its engine (keys of a dead engine are unknown to the new one,
        which ignores them) and forget its route."""
        home = self._home.pop(query_id, None)
        if home is not None and home in self._engines:
            self._trees[home] -= 1
            if cache_keys:
                self._engines[home].release.remote(cache_keys)

    def _load_into_engines(self, state_ref, version: int) -> dict[str, str]:
        """Load one object-store copy of the weights into every engine; returns the engines found dead or stuck (id ->
        why; the pool manager replaces them). Any other failure is raised."""
        if hasattr(state_ref, "deliver"):  # a broadcast (weights.py): one transfer to every engine at once
            lost = state_ref.deliver(dict(self._engines), version)
            for eid in lost:
                self._lost(eid)
            return {eid: "lost" for eid in lost}
        pending = {eid: e.load_weights.remote(state_ref, version) for eid, e in list(self._engines.items())}
        end, lost, error = time.monotonic() + self.deadlines.call_s, {}, None
        # The manager's heartbeat waits for this call (one lock), so the load pings on its own: an engine stopped
        # mid-load is found after heartbeat_s, not call_s.
        watch = Heartbeat(self.deadlines.heartbeat_s, self.deadlines.heartbeat_s)
        while pending:
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending),
                               timeout=min(0.2, max(end - time.monotonic(), 0.0)))
            for eid in [eid for eid, ref in pending.items() if ref in done]:  # every answer is taken, even after an error
                try:
                    ray.get(pending.pop(eid))
                except RayActorError as err:
                    if not actor_lost(err):  # e.g. the weights' owner, a learner, died: raised once all answered
                        error = error or err
                        continue
                    lost[eid] = "lost"
                    self._lost(eid)
            _, stuck = watch.check({eid: self._engines[eid] for eid in pending})
            late = {eid: f"stuck (no ping answered for {self.deadlines.heartbeat_s:g}s, runtime.deadlines.heartbeat_s)"
                    for eid in stuck}
            if time.monotonic() >= end:
                late.update({eid: f"not done within {self.deadlines.call_s:g}s (runtime.deadlines.call_s)"
                             for eid in pending if eid not in late})
            for eid, why in late.items():
                ray.kill(self._engines[eid])
                del pending[eid]
                lost[eid] = why
                self._lost(eid)
        if error is not None:
            raise error
        return lost

    def stats(self) -> list[dict]:
        """Counters of each live engine (with its `engine_id`); engines that are dead, or that do not answer within
        the heartbeat deadline, are left out."""
        refs = {e.stats.remote(): eid for eid, e in list(self._engines.items())}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.deadlines.heartbeat_s)
        out = []
        for ref in done:
            try:
                out.append({**ray.get(ref), "engine_id": refs[ref]})
            except RayActorError as err:
                if not actor_lost(err):
                    raise
        return out

    # -------------------------------------------------------------------------------- membership (the driver)

    def _spawn(self) -> None:
        actor = self.spec.start()
        self._pending[actor_id(actor)] = (actor, actor.stats.remote())
        self._asked[actor_id(actor)] = time.monotonic()

    def _report_unscheduled(self) -> None:
        """An engine still pending after deadlines.start_s is reported once, with what it asks for: it waits for a
        node (an autoscaler may be adding one), and the run goes on with the engines it has."""
        now = time.monotonic()
        for eid in self._pending:
            asked = self._asked.get(eid)
            if asked is not None and now - asked > self.deadlines.start_s:
                del self._asked[eid]
                free = {k: v for k, v in ray.available_resources().items() if not k.startswith("node:")}
                self._event("engines_unscheduled", f"engine {eid[:8]} not started after {now - asked:.0f}s "
                            f"(runtime.deadlines.start_s): asks {self.spec.demand()}; the cluster has free {free}")

    def _await_first(self, timeout_s: float) -> None:
        """Wait for every engine of the initial pool (at least one; the rest may join later)."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            self.tick(wait_s=min(self.poll_s, max(deadline - time.monotonic(), 0)))
        if not self._members:
            raise RuntimeError(f"no engine actor started within {timeout_s:.0f}s (asks {self.spec.demand()}; "
                               f"cluster has {ray.available_resources()})")

    def _publish(self) -> None:
        self._epoch += 1
        self.set_engines(self._epoch, self._members)
        self.registry.set_engines.remote(self._epoch, [ray.put(dict(self._members))])

    def _event(self, kind: str, detail: str, count: int = 1) -> None:
        self.registry.record.remote(kind, detail, count)

    def tick(self, wait_s: float = 0.0) -> None:
        """One round: admit engines that came up, drop dead ones, ask for replacements and for growth."""
        with self._lock:
            self._admit(wait_s)
            self._check_health()
            self.spec.release(set(self._members) | set(self._pending))  # tensor-parallel engines' GPUs
            self._request_more()
            self._report_unscheduled()

    def _admit(self, wait_s: float) -> None:
        if not self._pending:
            return
        ready = {ref: eid for eid, (_, ref) in self._pending.items()}
        done, _ = ray.wait(list(ready), num_returns=len(ready), timeout=wait_s)
        changed = False
        for ref in done:
            eid = ready[ref]
            actor, _ = self._pending.pop(eid)
            self._asked.pop(eid, None)
            version, weights = self._weights
            try:
                ray.get(ref)
                if weights is not None:  # the pool runs trained weights: the newcomer loads them first
                    get(actor.load_weights.remote(weights, version), self.deadlines.call_s,
                        f"engine {eid[:8]} loading weights v{version} before joining")
            except DeadlineExceeded as err:
                ray.kill(actor)
                self._event("engines_stuck", f"engine {eid[:8]} stuck while starting ({err}): killed")
                continue
            except RayActorError as err:
                if not actor_lost(err):  # the weights are what failed (their learner died): try again next round
                    self._pending[eid] = (actor, actor.stats.remote())
                    continue
                ray.kill(actor)
                if getattr(err, "actor_init_failed", False):  # its constructor raised: the config, not the cluster
                    self.init_failures += 1
                    if self._thread is None:  # at start: fail the run with the engine's own error
                        raise RuntimeError(f"an engine actor could not start: {err}") from None
                    report(f"engine {eid[:8]} could not start ({self.init_failures} in a row"
                           + ("; no more replacements" if self.init_failures >= 3 else "") + f"): {err}")
                    continue
                self._event("engines_lost", f"engine {eid[:8]} died while starting: {type(err).__name__}"
                            + (" (node preempted)" if getattr(err, "preempted", False) else ""))
                continue
            self.init_failures = 0
            self._members[eid] = actor
            self._heartbeat.answered(eid)  # it answered `stats`: up
            self.joined += 1
            changed = True
            if self._thread is not None:  # a replacement or growth, not the initial pool
                self._event("engines_joined", f"engine {eid[:8]} joined with weights v{version}")
        if changed:
            self._publish()

    def _check_health(self) -> None:
        """Heartbeat: dead engines are dropped; stuck ones (alive, a ping unanswered for deadlines.heartbeat_s)
        are killed and dropped. The floor in _request_more then asks for their replacements."""
        dead, stuck = self._heartbeat.check(dict(self._members))
        for eid in stuck:
            ray.kill(self._members[eid])
            self._event("engines_stuck", f"engine {eid[:8]} did not answer a ping for "
                        f"{self.deadlines.heartbeat_s:g}s (runtime.deadlines.heartbeat_s): killed and replaced")
            self._drop(eid, f"engine {eid[:8]} stuck")
        for eid, err in dead:
            self._drop(eid, f"engine {eid[:8]} lost: {type(err).__name__}"
                       + (" (node preempted)" if getattr(err, "preempted", False) else ""))
        if dead or stuck:
            self._publish()

    def _drop(self, eid: str, why: str) -> None:
        if self._members.pop(eid, None) is not None:
            self._heartbeat.forget(eid)
            self.lost += 1
            self._event("engines_lost", why)

    def _request_more(self) -> None:
        if self.init_failures >= 3:
            return  # engines fail in their constructor: more of them would fail the same way
        # Floor: every lost engine is asked for again at once; if there is no room it waits as a pending actor.
        while len(self._members) + len(self._pending) < self.num_engines:
            self._spawn()
        # Growth: one engine at a time, once the run's other actors are placed (start()), only where Ray reports
        # room, and only while nothing is still pending.
        if (self._thread is not None and self._growth.is_set() and not self._pending
                and len(self._members) < self.max_engines and self.spec.fits(ray.available_resources())):
            self._spawn()

    # -------------------------------------------------------------------------------- the thread

    def start(self) -> "GeneratorPool":
        """Start watching the pool (call once the run's other actors are placed: growth takes free room)."""
        if self._thread is None:
            # The thread holds the manager only weakly: a pipeline dropped without shutdown() still releases its
            # actor handles, and Ray then ends the engines as it always did.
            self._thread = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, self.poll_s),
                                            name="generator-pool", daemon=True)
            self._thread.start()
        return self

    def pause_growth(self) -> None:
        self._growth.clear()

    def resume_growth(self) -> None:
        self._growth.set()

    def close(self) -> None:
        """Stop the thread and kill every engine, pending ones too."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._lock:
            for actor in list(self._members.values()) + [a for a, _ in self._pending.values()]:
                ray.kill(actor)
            self._members.clear()
            self._pending.clear()
            self.spec.release(set())
        ray.kill(self.registry)

    # -------------------------------------------------------------------------------- what the pipeline calls

    @property
    def size(self) -> int:
        """Engines in the pool now (live and serving)."""
        return len(self._members)

    def engines(self) -> list:
        with self._lock:
            return list(self._members.values())

    @property
    def weights_version(self) -> int:
        """The weights version every live engine runs (and every joiner loads before joining)."""
        return self._weights[0]

    def load_weights(self, state_ref, version: int) -> None:
        """Make `version` the pool's weights: every live engine loads it now, every later joiner before joining."""
        with self._lock:
            self._weights = (version, state_ref)
            lost = self._load_into_engines(state_ref, version)
            for eid, why in lost.items():
                if why != "lost":
                    self._event("engines_stuck", f"engine {eid[:8]} {why} while loading weights v{version}: "
                                "killed and replaced")
                self._drop(eid, f"engine {eid[:8]} {why} while loading weights v{version}")
            if lost:
                self._publish()

    def generate_now(self, requests: list[SegmentRequest], timeout_s: float = 900.0) -> list[SegmentResult]:
        """Results of `requests` (any prefixes), spread over the live engines; requests of an engine that dies are
        sent again to another one. Blocking; for the driver (evaluation)."""
        results: dict[str, SegmentResult] = {}
        todo = list(requests)
        deadline, errors = time.monotonic() + timeout_s, 0
        while todo:
            with self._lock:
                engines = list(self._members.items())
            if not engines:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no live engine for {timeout_s:.0f}s to run {len(todo)} requests on")
                self.tick(wait_s=self.poll_s)
                continue
            shards = [todo[i::len(engines)] for i in range(len(engines))]
            calls = [(eid, shard, e.generate.remote(shard)) for shard, (eid, e) in zip(shards, engines) if shard]
            todo = []
            for eid, shard, ref in calls:
                try:
                    for res in get(ref, self.deadlines.generate_s, f"engine {eid[:8]} generate"):
                        results[res.request_id] = res
                except (RayActorError, RayTaskError, DeadlineExceeded) as err:
                    errors = self._failed(eid, err, "evaluation", "generate", (shard,), errors)
                    todo += shard
                    with self._lock:
                        self._drop(eid, f"engine {eid[:8]} gone: {type(err).__name__}")
                        self._publish()
        return [results[r.request_id] for r in requests]

    def drain_events(self) -> list[tuple[float, str, str, int]]:
        try:
            return get(self.registry.drain.remote(), self.deadlines.call_s, "registry")
        except (RayActorError, DeadlineExceeded):
            return []
