"""The generator pool: the run's engine actors as the driver keeps them. Calls to the engines go through engine
routers (router.py), which every caller holds; this manager only keeps the membership and the weights.

It keeps its target of engine actors requested at all times (a lost one is asked for again at once; while the
cluster has no room the replacement waits as a pending actor, outside the pool: the resource demand an autoscaler
answers with a new node), and lets an engine join only after it has loaded the weights the pool runs. The target is
runtime.num_engines, or, with runtime.elastic.autoscale, what the scaling policy sets (`set_target`, between
num_engines and runtime.elastic.max_engines: job/scaling.py); without it, engines are added up to max_engines
whenever Ray reports room for one.

Engines leave without losing work: one given back (`set_target` lower) or on a node Ray marks as draining (`ray
drain-node`, a pre-stop hook, a spot notice) is taken out of the member list first, so routers send it nothing new
(a tree homed on it moves on its next call), and is killed once it holds no request; its node then idles, and the
autoscaler removes it. A drained engine's place is asked for again, elsewhere (Ray places nothing on a draining
node). Which engines are lost or stuck is the supervisor's
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
        self.target = self.num_engines  # engines kept requested (the policy's, with runtime.elastic.autoscale)
        self.autoscale = grow and rt.elastic.autoscale
        self.registry = RuntimeRegistry.options(scheduling_strategy=on_this_node()).remote()
        self._members: dict[str, object] = {}
        self._pending: dict[str, tuple[object, object]] = {}  # id -> (actor, ObjectRef that resolves when it is up)
        self._asked: dict[str, float] = {}  # pending engine id -> when it was asked for (until reported)
        self._nodes: dict[str, str] = {}  # member id -> the id of the node it runs on
        self._leaving: dict[str, tuple] = {}  # id -> (actor, ObjectRef of its stats, when it left the members)
        self._driver_node = ray.get_runtime_context().get_node_id()
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
            self._watch_drains()
            self._let_go()
            self.spec.release(set(self._members) | set(self._pending) | set(self._leaving))  # tensor-parallel GPUs
            self._request_more()
            self._report_unscheduled()

    def drop(self, eid: str, why: str) -> None:
        """Engine `eid` is gone (dead, or killed by the caller): out of the pool, counted as fault/engines_lost."""
        with self._lock:
            self._nodes.pop(eid, None)
            if self._members.pop(eid, None) is None:
                return
            self._publish()
        record(self.registry, "engines_lost", why, self.rt.deadlines.call_s)

    def nodes(self) -> dict[str, str]:
        """Engine id -> the id of the node it runs on, of the engines in the pool now."""
        with self._lock:
            return dict(self._nodes)

    @property
    def pending(self) -> int:
        """Engines asked for that have not joined yet."""
        return len(self._pending)

    @property
    def leaving(self) -> int:
        """Engines out of the pool that still finish what they hold."""
        return len(self._leaving)

    def set_target(self, n: int) -> int:
        """Keep `n` engines requested (within runtime.num_engines and elastic.max_engines); returns the target. Going
        down gives back engines still pending first (their demand stops at once), then members on other nodes than
        the driver's, newest first: their nodes idle, and an autoscaler removes them."""
        with self._lock:
            self.target = min(max(n, self.num_engines), self.max_engines)
            excess = len(self._members) + len(self._pending) - self.target
            for eid in list(self._pending)[::-1][:max(excess, 0)]:
                ray.kill(self._pending.pop(eid)[0])
                self._asked.pop(eid, None)
                excess -= 1
            newest = list(reversed(self._members))  # members in joining order, newest first
            for eid in sorted(newest, key=lambda e: self._nodes.get(e) == self._driver_node):
                if excess <= 0:
                    break
                self._retire(eid, f"engine {eid[:8]} given back (the pool's target is {self.target})",
                             "engines_given_back")
                excess -= 1
            return self.target

    def _retire(self, eid: str, why: str, kind: str) -> None:
        """Take member `eid` out of the pool; it is killed once idle (`_let_go`)."""
        actor = self._members.pop(eid)
        self._nodes.pop(eid, None)
        self._leaving[eid] = (actor, actor.stats.remote(), time.monotonic())
        self._publish()
        self._event(kind, why)

    def _watch_drains(self) -> None:
        """Members on a node Ray marks as draining leave (module docstring)."""
        if not self.rt.elastic.drain or not self._nodes:
            return
        draining = ray._private.state.state.get_draining_nodes()  # node id -> deadline in ms (0: none)
        for eid, node in list(self._nodes.items()):
            if node in draining:
                deadline = draining[node] / 1000 - time.time() if draining[node] else None
                self._retire(eid, f"engine {eid[:8]} left: its node {node[:8]} is draining"
                             + (f" (going in {deadline:.0f}s)" if deadline is not None else ""), "engines_drained")

    def _let_go(self) -> None:
        """Kill each leaving engine once it holds no request (its last answers are back with their callers) and
        routers had time to see it gone; at the latest after deadlines.generate_s. One whose node went first is
        forgotten: routers re-send what it held."""
        now, settle = time.monotonic(), 2 * self.rt.elastic.poll_s
        for eid, (actor, ref, since) in list(self._leaving.items()):
            late = now - since > self.rt.deadlines.generate_s
            done, _ = ray.wait([ref], timeout=0)
            if not done and not late:
                continue
            try:
                held = ray.get(ref) if done else {}
            except RayActorError:
                del self._leaving[eid]  # gone with its node
                continue
            if not late and (now - since < settle or held.get("running", 0) or held.get("pending", 0)):
                self._leaving[eid] = (actor, actor.stats.remote() if done else ref, since)
                continue
            ray.kill(actor)
            del self._leaving[eid]

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
        self._nodes[eid] = ray._private.state.state.actor_table(eid)["Address"]["NodeID"]
        if not self._starting:  # a replacement or growth, not the initial pool
            self._event("engines_joined", f"engine {eid[:8]} joined with weights v{version}")
        return True

    def _request_more(self) -> None:
        if self.init_failures >= 3:
            return  # engines fail in their constructor: more of them would fail the same way
        # The target (the floor while growth is off): every lost or drained engine is asked for again at once; if
        # there is no room it waits as a pending actor, the demand an autoscaler answers.
        want = self.target if self._growth else self.num_engines
        while len(self._members) + len(self._pending) < want:
            self._spawn()
        # Growth by room (without the policy): one engine at a time, only where Ray reports room, and only while
        # nothing is still pending.
        if (not self.autoscale and self._growth and not self._pending and len(self._members) < self.max_engines
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
            lost = weights.deliver(engines, version)
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
            for actor in (list(self._members.values()) + [a for a, _ in self._pending.values()]
                          + [a for a, _, _ in self._leaving.values()]):
                ray.kill(actor)
            self._members.clear()
            self._pending.clear()
            self._leaving.clear()
            self.spec.release(set())
        ray.kill(self.registry)
