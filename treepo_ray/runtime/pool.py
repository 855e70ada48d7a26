"""The generator pool: the run's engine actors as the driver keeps them. Calls to the engines go through engine
routers (router.py), which every caller holds; this manager only keeps the membership and the weights.

It keeps runtime.num_engines engine actors requested at all times (a lost one is asked for again at once; while the
cluster has no room the replacement waits as a pending actor, outside the pool: the resource demand an autoscaler
answers with a new node), adds more, up to runtime.elastic.max_engines, whenever Ray reports room for one, and lets an
engine join only after it has loaded the weights the pool runs. Which engines are lost or stuck is the supervisor's
to find (supervisor.py: heartbeats); it drops them here (`drop`), and the next `tick` asks for replacements. Routers
catch up with the member list through the RuntimeRegistry (registry.py).

Engines are replaced, not restarted in place by Ray (max_restarts=0, max_task_retries=0). A call in flight to a
dead engine then fails at once with ActorDiedError, and the router re-sends it to a live engine; Ray's retry would
instead wait for the engine's restart (after a preemption: for a new node) and run on a fresh actor that still holds
the base weights. Verifiers, which hold no state, are the case where Ray's in-place restart is the right tool
(verifier.py).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from treepo_ray.runtime.engine import EngineActor, engine_placement, release_placement, tensor_parallel_size
from treepo_ray.runtime.liveness import DeadlineExceeded, actor_id, actor_lost, free_resources, get, on_this_node
from treepo_ray.runtime.registry import RuntimeRegistry, record
from treepo_ray.runtime.router import EngineRouter
from treepo_ray.runtime.weights import BroadcastWeights


@dataclass
class EngineSpec:
    """How to start one engine actor, and the resources it asks of Ray (model.engine*, runtime.engine_*)."""

    engine: str
    model_path: str
    engine_kwargs: dict
    torch_threads: int
    num_cpus: float
    num_gpus: float
    resources: dict
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
        args = (self.engine, self.model_path, self.engine_kwargs, self.torch_threads)
        if tp > 1:  # in its GPUs' placement group, where vLLM's Ray executor finds them
            group = engine_placement(tp, self.num_cpus, self.resources)
            place = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0,
                                                     placement_group_capture_child_tasks=True)
            actor = EngineActor.options(num_cpus=self.num_cpus, scheduling_strategy=place, max_restarts=0,
                                        max_task_retries=0).remote(*args)
            self.groups[actor_id(actor)] = group
            return actor
        return EngineActor.options(num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources or None,
                                   max_restarts=0, max_task_retries=0).remote(*args)

    def release(self, keep: set[str]) -> None:
        """Remove the placement groups of engines not in `keep` (dead, dropped or killed): their GPUs go back."""
        for eid in [eid for eid in self.groups if eid not in keep]:
            release_placement(self.groups.pop(eid))


def _release_all(groups: dict) -> None:
    for eid in list(groups):
        release_placement(groups.pop(eid))


class GeneratorPool:
    """The run's engines (module docstring). `num_engines` overrides runtime.num_engines (an evaluator takes what
    fits); `grow`: whether it may grow past it, up to runtime.elastic.max_engines, once `allow_growth` is called."""

    def __init__(self, spec: EngineSpec, rt, num_engines: int | None = None, grow: bool = True):
        self.spec, self.rt = spec, rt
        self.num_engines = num_engines or rt.num_engines
        self.max_engines = max(rt.elastic.max_engines, self.num_engines) if grow else self.num_engines
        self.registry = RuntimeRegistry.options(scheduling_strategy=on_this_node()).remote()
        self._members: dict[str, object] = {}
        self._pending: dict[str, tuple[object, object]] = {}  # id -> (actor, ObjectRef that resolves when it is up)
        self._asked: dict[str, float] = {}  # pending engine id -> when it was asked for (until reported)
        self._weights: tuple[int, object] = (0, None)  # the version (and payload) every live engine holds
        self._epoch = 0
        self._lock = threading.RLock()
        self._growth = False  # off until the run's other actors are placed (growth takes free room), and while a
        self._starting = True  # learner is rebuilt; `_starting`: an engine's own error fails the run
        self.init_failures = 0  # engines in a row whose constructor raised (3: replacements stop)
        for _ in range(self.num_engines):
            self._spawn()
        try:
            self._await_first(rt.elastic.startup_timeout_s)
        except BaseException:
            self.close()  # no engine came up: leave no actor behind (the registry included)
            raise
        self._starting = False

    def router(self) -> EngineRouter:
        """A router over the current members (it follows later changes through the registry)."""
        router = EngineRouter(self.registry, self.rt)
        with self._lock:
            router.set_engines(self._epoch, dict(self._members))
        return router

    # -------------------------------------------------------------------------------- membership

    @property
    def size(self) -> int:
        """Engines in the pool now (live and serving)."""
        return len(self._members)

    def members(self) -> dict:
        """Engine id -> actor, of the engines in the pool now."""
        with self._lock:
            return dict(self._members)

    @property
    def weights_version(self) -> int:
        """The weights version every live engine runs (and every joiner loads before joining)."""
        return self._weights[0]

    def allow_growth(self, allowed: bool) -> None:
        """Growth past runtime.num_engines on (once the run's other actors are placed) or off (while a learner is
        rebuilt: the room it left is for its replacement)."""
        self._growth = allowed

    def tick(self, wait_s: float = 0.0) -> None:
        """One round: admit engines that came up, ask for replacements and for growth, report engines that wait
        for room."""
        with self._lock:
            self._admit(wait_s)
            self.spec.release(set(self._members) | set(self._pending))  # tensor-parallel engines' GPUs
            self._request_more()
            self._report_unscheduled()

    def drop(self, eid: str, why: str) -> None:
        """Engine `eid` is gone (dead, or killed by the caller): out of the pool, counted as fault/engines_lost."""
        with self._lock:
            if self._members.pop(eid, None) is None:
                return
            self._publish()
        record(self.registry, "engines_lost", why, self.rt.deadlines.call_s)

    def _spawn(self) -> None:
        actor = self.spec.start()
        self._pending[actor_id(actor)] = (actor, actor.stats.remote())
        self._asked[actor_id(actor)] = time.monotonic()

    def _await_first(self, timeout_s: float) -> None:
        """Wait for every engine of the initial pool (at least one; the rest may join later)."""
        deadline = time.monotonic() + timeout_s
        while self._pending and time.monotonic() < deadline:
            self.tick(wait_s=min(self.rt.elastic.poll_s, max(deadline - time.monotonic(), 0)))
        if not self._members:
            raise DeadlineExceeded(f"no engine actor started within {timeout_s:.0f}s "
                                   f"(runtime.elastic.startup_timeout_s; asks {self.spec.demand()}; the cluster has "
                                   f"free {free_resources()})")

    def _publish(self) -> None:
        self._epoch += 1
        self.registry.set_engines.remote(self._epoch, [ray.put(dict(self._members))])

    def _admit(self, wait_s: float) -> None:
        if not self._pending:
            return
        ready = {ref: eid for eid, (_, ref) in self._pending.items()}
        done, _ = ray.wait(list(ready), num_returns=len(ready), timeout=wait_s)
        joined = [eid for eid in (ready[ref] for ref in done) if self._join(eid)]
        if joined:
            self._publish()

    def _join(self, eid: str) -> bool:
        """A pending engine answered: it joins once it holds the pool's weights (True), or is given up."""
        actor, ref = self._pending.pop(eid)
        self._asked.pop(eid, None)
        version, weights = self._weights
        try:
            ray.get(ref)
            if weights is not None:  # the pool runs trained weights: the newcomer loads them first
                get(actor.load_weights.remote(weights, version), self.rt.deadlines.call_s,
                    f"engine {eid[:8]} loading weights v{version} before joining")
        except DeadlineExceeded as err:
            ray.kill(actor)
            self._event("engines_stuck", f"engine {eid[:8]} stuck while starting ({err}): killed")
            return False
        except RayActorError as err:
            if not actor_lost(err):  # the weights are what failed (their learner died): try again next round
                self._pending[eid] = (actor, actor.stats.remote())
                return False
            ray.kill(actor)
            if getattr(err, "actor_init_failed", False):  # its constructor raised: the config, not the cluster
                self.init_failures += 1
                if self._starting:  # at start: fail the run with the engine's own error
                    raise RuntimeError(f"an engine actor could not start: {err}") from None
                self._event("engine_init_failures", f"engine {eid[:8]} could not start ({self.init_failures} in a "
                            "row" + ("; no more replacements" if self.init_failures >= 3 else "") + f"): {err}")
                return False
            self._event("engines_lost", f"engine {eid[:8]} died while starting: {type(err).__name__}"
                        + (" (node preempted)" if getattr(err, "preempted", False) else ""))
            return False
        self.init_failures = 0
        self._members[eid] = actor
        if not self._starting:  # a replacement or growth, not the initial pool
            self._event("engines_joined", f"engine {eid[:8]} joined with weights v{version}")
        return True

    def _request_more(self) -> None:
        if self.init_failures >= 3:
            return  # engines fail in their constructor: more of them would fail the same way
        # Floor: every lost engine is asked for again at once; if there is no room it waits as a pending actor.
        while len(self._members) + len(self._pending) < self.num_engines:
            self._spawn()
        # Growth: one engine at a time, only where Ray reports room, and only while nothing is still pending.
        if (self._growth and not self._pending and len(self._members) < self.max_engines
                and self.spec.fits(ray.available_resources())):
            self._spawn()

    def _report_unscheduled(self) -> None:
        """An engine still pending after deadlines.start_s is reported once, with what it asks for: it waits for a
        node (an autoscaler may be adding one), and the run goes on with the engines it has."""
        now = time.monotonic()
        for eid in self._pending:
            asked = self._asked.get(eid)
            if asked is not None and now - asked > self.rt.deadlines.start_s:
                del self._asked[eid]
                self._event("engines_unscheduled", f"engine {eid[:8]} not started after {now - asked:.0f}s "
                            f"(runtime.deadlines.start_s): asks {self.spec.demand()}; the cluster has free "
                            f"{free_resources()}")

    def _event(self, kind: str, detail: str) -> None:
        record(self.registry, kind, detail, self.rt.deadlines.call_s)

    # -------------------------------------------------------------------------------- weights and counters

    def load_weights(self, weights, version: int) -> None:
        """Make `version` the pool's weights: every live engine loads it now (within runtime.deadlines.call_s, or it
        is killed), every later joiner before joining. The pool's lock is not held while engines load, so the
        supervisor's heartbeat goes on meanwhile."""
        with self._lock:
            self._weights = (version, weights)
            engines = dict(self._members)
        if isinstance(weights, BroadcastWeights):  # one transfer to every engine at once
            lost = {eid: "lost" for eid in weights.deliver(engines, version)}
        else:
            lost = self._load_each(engines, weights, version)
        for eid, why in lost.items():
            if why != "lost":
                ray.kill(engines[eid])
                self._event("engines_stuck", f"engine {eid[:8]} {why} while loading weights v{version}: killed")
            self.drop(eid, f"engine {eid[:8]} {why} while loading weights v{version}")

    def _load_each(self, engines: dict, weights, version: int) -> dict[str, str]:
        """Every engine loads one object-store copy; returns those lost or late (id -> why). Any other failure is
        raised, once every engine has answered."""
        pending = {eid: e.load_weights.remote(weights, version) for eid, e in engines.items()}
        refs = list(pending.values())
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.rt.deadlines.call_s)
        lost, error = {}, None
        for eid, ref in pending.items():
            if ref not in done:
                lost[eid] = f"not done within {self.rt.deadlines.call_s:g}s (runtime.deadlines.call_s)"
                continue
            try:
                ray.get(ref)
            except RayActorError as err:
                if actor_lost(err):
                    lost[eid] = "lost"
                else:  # e.g. the weights' owner, a learner, died: raised once all answered
                    error = error or err
        if error is not None:
            raise error
        return lost

    def stats(self) -> list[dict]:
        """Counters of each live engine (with its `engine_id`); engines that are dead, or that do not answer within
        the heartbeat deadline, are left out."""
        refs = {e.stats.remote(): eid for eid, e in self.members().items()}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=self.rt.deadlines.heartbeat_s)
        out = []
        for ref in done:
            try:
                out.append({**ray.get(ref), "engine_id": refs[ref]})
            except RayActorError as err:
                if not actor_lost(err):
                    raise
        return out

    def close(self) -> None:
        """Kill every engine, pending ones too, and the registry."""
        with self._lock:
            for actor in list(self._members.values()) + [a for a, _ in self._pending.values()]:
                ray.kill(actor)
            self._members.clear()
            self._pending.clear()
            self.spec.release(set())
        ray.kill(self.registry)
