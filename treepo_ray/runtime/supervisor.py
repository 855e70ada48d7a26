"""The supervisor: the one owner of every actor of a run, of their failures and of the waits on them.

    start        engines (the generator pool, pool.py), verifiers and their front (verifier.py), tree schedulers
                 (scheduler.py), the healer when the algorithm heals (healer.py), the learner group (learner.py); a
                 run that cannot start leaves no actor behind
    watch        one thread, every runtime.elastic.poll_s: the pool's membership (joins, replacements, growth), and a
                 heartbeat of every engine, scheduler, the healer and every learner rank. A dead one is dropped; a
                 stuck one (alive, a ping unanswered for runtime.deadlines.heartbeat_s) is killed and dropped. An
                 engine's replacement is the pool's floor; a lost learner rank takes its whole group down (its peers
                 would wait in a collective), so the learner's next call fails at once (LearnerLost)
    replace      a scheduler lost or killed, or the healer, while a batch grows: `grow` starts a new one and grows the
                 failed shard again with the same seeds (runtime.faults.max_regrows per round); the learner group,
                 when the trainer asks after LearnerLost (`replace_learner`)
    deadlines    every call the driver makes on these actors has one (runtime.deadlines: liveness.py); past it the
                 run stops with one line naming what did not answer, unless a replacement recovers it

Verifiers are restarted in place by Ray and their calls retried by the verifier front (verifier.py): a verifier
that hangs is killed by the front's time limit. The engine router (router.py) gives up engines whose calls fail and
re-sends the calls; what it gives up, the heartbeat here drops from the pool.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

import ray
from ray.exceptions import RayActorError

from treepo_ray.job.faults import RunStopped, report
from treepo_ray.job.scaling import ScalingPolicy, StepMeasure
from treepo_ray.runtime.chaos import ChaosMonkey, kill_actor
from treepo_ray.runtime.healer import make_healer
from treepo_ray.runtime.learner import LearnerGroup
from treepo_ray.runtime.liveness import (DeadlineExceeded, Heartbeat, actor_lost, brief, get, on_this_node, ping,
                                         started)
from treepo_ray.runtime.pool import EngineSpec, GeneratorPool
from treepo_ray.runtime.registry import event_metrics, record
from treepo_ray.runtime.scheduler import TreeScheduler
from treepo_ray.runtime.verifier import VerifierPool
from treepo_ray.runtime.weights import WeightSync
from treepo_ray.tree import Tree


def _watch(supervisor_ref, stop: threading.Event, poll_s: float) -> None:
    """The watch thread: one `tick` every `poll_s` until stopped or the supervisor is gone (it is held weakly: a
    supervisor dropped without shutdown() still releases its actor handles, and Ray ends the actors)."""
    while not stop.wait(poll_s):
        supervisor = supervisor_ref()
        if supervisor is None:
            return
        try:
            supervisor.tick()
        except Exception as err:  # noqa: BLE001 - a monitoring hiccup must not end the run; the next round tries again
            report(f"supervisor watch: {brief(err)}")
        del supervisor


def engines_with_room(cfg, model_path: str, settle_s: float = 10.0) -> int:
    """How many engines fit in the cluster's free room (at least one). A run just shut down gives its room back within
    seconds (its actors exit asynchronously): up to `settle_s` is waited for the free room to reach the whole
    cluster's, then what is free is taken."""
    rt = cfg.runtime
    demand = EngineSpec.of(cfg, model_path).demand()

    def fitting(room: dict) -> int:
        room = {**room, "CPU": room.get("CPU", 0.0) - rt.num_verifiers * rt.verifier_cpus}
        fits = [int(room.get(k, 0.0) // v) for k, v in demand.items() if v > 0]
        return min(fits) if fits else rt.num_engines

    end = time.monotonic() + settle_s
    while fitting(ray.available_resources()) < fitting(ray.cluster_resources()) and time.monotonic() < end:
        time.sleep(0.5)
    return max(1, fitting(ray.available_resources()))


def weights_of(cfg, pool: GeneratorPool) -> tuple[WeightSync, bool]:
    """How weights reach the engines (the path, the engines' dtype), and whether the engines take them while
    sequences run: asked of a running engine, before any export."""
    engine = next(iter(pool.members().values()))
    info = get(engine.describe.remote(), cfg.runtime.deadlines.call_s, "engine (describe)")
    weight_sync = WeightSync.for_run(cfg, info["weights_dtype"])
    print(weight_sync.describe(), flush=True)
    return weight_sync, info["loads_weights_while_running"]


class Supervisor:
    """Every actor of one run (module docstring). `train=False`: engines and verifiers only, to evaluate weights
    loaded into the pool (`for_evaluation`)."""

    def __init__(self, cfg, model_path: str, train: bool = True, num_engines: int | None = None):
        rt = cfg.runtime
        self.cfg, self.model_path, self.rt = cfg, model_path, rt
        self.pool: GeneratorPool | None = None
        self.verifiers: VerifierPool | None = None
        self.schedulers: list = []
        self.healer = None
        self.learner: LearnerGroup | None = None
        self.swaps_in_flight = False
        """The engines take new weights between two steps while sequences run (the next batch may start early)."""
        self._heartbeat = Heartbeat(rt.deadlines.heartbeat_s, rt.deadlines.start_s)
        self._lock = threading.RLock()  # the actor lists, shared by the watch thread and the growing batches
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._chaos: ChaosMonkey | None = None
        self._down: LearnerGroup | None = None  # a learner group taken down, until it is replaced
        self._learner_killed = False
        try:
            self.pool = GeneratorPool(EngineSpec.of(cfg, model_path), rt, num_engines, grow=train)
            self.router = self.pool.router()
            self.verifiers = VerifierPool.start(rt, self.pool.registry, cfg.custom_reward_function)
            started([(f"verifier {i}", v, {"CPU": rt.verifier_cpus} if rt.verifier_cpus else {})
                     for i, v in enumerate(self.verifiers.verifiers)], rt.deadlines.start_s)
            if train:
                # Schedulers and the healer mostly wait on engines and verifiers, so they reserve no CPU.
                self.healer = make_healer(self.router, self.verifiers, model_path, cfg)
                self.schedulers = [self._start_scheduler() for _ in range(rt.num_schedulers)]
                up = [(f"scheduler {i}", a, {}) for i, a in enumerate(self.schedulers)]
                up += [("healer", self.healer, {})] if self.healer else []
                started(up, rt.deadlines.start_s)
                weight_sync, self.swaps_in_flight = weights_of(cfg, self.pool)
                self.learner = LearnerGroup(model_path, cfg.learner, rt, weight_sync)
                for name in [n for n, _, _ in up] + list(self.learner.pings()):
                    self._heartbeat.answered(name)  # up: judged by the heartbeat's deadline from its first ping
        except BaseException:
            self.shutdown()  # a run that cannot start leaves no actor behind
            raise
        self.pool.allow_growth(True)  # only now: growth takes free room, which the actors above needed first
        self.policy = (ScalingPolicy(self.pool.num_engines, self.pool.max_engines, rt.elastic, rt.max_staleness)
                       if self.pool.autoscale else None)
        self._thread = threading.Thread(target=_watch, args=(weakref.ref(self), self._stop, rt.elastic.poll_s),
                                        name="supervisor", daemon=True)
        self._thread.start()

    @classmethod
    def for_evaluation(cls, cfg, model_path: str) -> "Supervisor":
        """Engines and verifiers only, as many engines as the cluster has room for (`engines_with_room`): after a
        run, the learner's CPUs or GPUs evaluate too."""
        return cls(cfg, model_path, train=False, num_engines=engines_with_room(cfg, model_path))

    def _start_scheduler(self):
        """A tree scheduler. It holds the tree state, so it lives on the driver's node (same failure domain), never
        on a spot generator node that can vanish; a lost one is replaced here, not restarted by Ray."""
        return TreeScheduler.options(num_cpus=0, scheduling_strategy=on_this_node(), max_restarts=0,
                                     max_task_retries=0).remote(self.router, self.verifiers, self.model_path,
                                                                self.cfg, self.healer)

    def journal(self, kind: str, detail: str, count: int = 1) -> None:
        """Record a fault event (fault/<kind> in the next step's metrics)."""
        record(self.pool.registry, kind, detail, self.rt.deadlines.call_s, count)

    # ------------------------------------------------------------------------------------------ watch

    def tick(self) -> None:
        """One round of the watch (module docstring)."""
        self.pool.tick()
        with self._lock:
            actors = {f"engine {eid[:8]}": (a, eid) for eid, a in self.pool.members().items()}
            for name in actors:  # a member answered its first call before it joined
                self._heartbeat.answered(name)
            actors.update({f"scheduler {i}": (a, None) for i, a in enumerate(self.schedulers)})
            if self.healer is not None:
                actors["healer"] = (self.healer, None)
            pings = {name: functools.partial(ping, a) for name, (a, _) in actors.items()}
            if self.learner is not None and self.learner is not self._down:
                pings.update(self.learner.pings())
            dead, stuck = self._heartbeat.check(pings)
        for name in stuck:
            self._heartbeat.forget(name)
            why = (f"{name} did not answer a ping for {self.rt.deadlines.heartbeat_s:g}s "
                   "(runtime.deadlines.heartbeat_s): killed")
            if name.startswith("learner rank"):
                self._take_learner_down(f"{why}, with the rest of its group", "learners_stuck")
                continue
            actor, eid = actors[name]
            ray.kill(actor)
            kind = name.split()[0]
            self.journal({"engine": "engines_stuck", "scheduler": "schedulers_stuck", "healer": "healers_stuck"}[kind],
                        why + (" and replaced" if kind != "engine" else ""))
            if eid is not None:
                self.pool.drop(eid, f"{name} stuck")
        for name, err in dead:
            if name.startswith("learner rank"):
                self._take_learner_down(f"{name} lost ({brief(err)}): the group of {len(self.learner.ranks)} ranks "
                                        "is taken down", "learner_takedowns")
            elif name.startswith("engine"):
                self.pool.drop(actors[name][1], f"{name} lost: {type(err).__name__}"
                               + (" (node preempted)" if getattr(err, "preempted", False) else ""))
            # a dead scheduler or healer fails the batch's call on it, and `grow` replaces it

    def _take_learner_down(self, why: str, kind: str) -> None:
        with self._lock:
            group = self._down = self.learner  # not watched again: its next call fails, and it is replaced
            for name in group.pings():
                self._heartbeat.forget(name)
        group.close()
        self.journal(kind, why)

    # ------------------------------------------------------------------------------------------ growing a batch

    def grow(self, prompts: list, progress: float) -> list[Tree]:
        """The scored trees of `prompts` (in prompt order), sharded over the schedulers. A shard whose scheduler is
        lost or stuck, or whose trees failed because the healer was lost, is grown again from its start on a
        replacement; its prompts carry their seeds, so the new trees are those the lost actor was growing. Any other
        failure of a shard stops the round."""
        rt = self.rt
        k = len(self.schedulers)
        shards = {i: prompts[i::k] for i in range(k) if prompts[i::k]}

        def start(i: int) -> tuple:
            with self._lock:
                actor, healer = self.schedulers[i], self.healer
            return actor.grow.remote(shards[i], progress), (i, actor, healer)

        running = dict(start(i) for i in shards)
        results: dict[int, list[Tree]] = {}
        regrows, deadline = 0, time.monotonic() + rt.deadlines.grow_s
        while running:
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"growing {len(prompts)} prompts: no answer within {rt.deadlines.grow_s:g}s "
                                       "(runtime.deadlines.grow_s)")
            done, _ = ray.wait(list(running), num_returns=len(running), timeout=rt.elastic.poll_s)
            for ref in done:
                i, actor, healer = running.pop(ref)
                try:
                    results[i] = ray.get(ref)
                    continue
                except Exception as err:  # noqa: BLE001 - recovered below if an actor was lost, else raised
                    if not self._replace_lost(i, actor, healer, err):
                        raise
                    regrows += 1
                    if regrows > rt.faults.max_regrows:
                        raise RunStopped(f"a batch's prompts were grown again {regrows - 1} times and their actors "
                                         f"keep failing (runtime.faults.max_regrows): {brief(err)}") from err
                self.journal("regrown_prompts", f"{len(shards[i])} prompts grown again on a new scheduler, with the "
                            "same seeds", len(shards[i]))
                ref, shard_of = start(i)
                running[ref] = shard_of
        out: list[Tree] = [None] * len(prompts)  # type: ignore[list-item]
        for i, shard in results.items():
            out[i::k] = shard
        return out

    def _replace_lost(self, i: int, actor, its_healer, err: BaseException) -> bool:
        """Scheduler `i`'s shard failed with `err` on `actor`: replace what was lost (the scheduler itself, or
        `its_healer`, the healer its trees were sent to, if it does not answer within the heartbeat's deadline) and
        return True; False when nothing was lost (the error is the shard's own). Batches growing at once replace each
        loss once."""
        if isinstance(err, RayActorError) and actor_lost(err):
            with self._lock:
                if self.schedulers[i] is actor:  # else another batch's shard on it found the loss first
                    self.journal("schedulers_lost", f"scheduler {i} lost ({brief(err)}); a new one grows its prompts "
                                 "again")
                    self._heartbeat.forget(f"scheduler {i}")
                    self.schedulers[i] = self._start_scheduler()
            return True
        if its_healer is None:
            return False
        try:
            get(ping(its_healer), self.rt.deadlines.heartbeat_s, "healer")
            return False
        except (RayActorError, DeadlineExceeded):
            pass
        with self._lock:
            if its_healer is self.healer:  # else another shard's failure replaced it already
                self.journal("healers_lost", f"the healer was lost ({brief(err)}); a new one takes over")
                ray.kill(self.healer)
                self._heartbeat.forget("healer")
                self.healer = make_healer(self.router, self.verifiers, self.model_path, self.cfg)
                for scheduler in self.schedulers:  # before the shard is sent again: calls run in the order sent
                    scheduler.set_healer.remote(self.healer)
        return True

    # ------------------------------------------------------------------------------------------ the learner

    def replace_learner(self) -> None:
        """A new learner group with the base weights, in place of a lost one (what is left of that is killed first,
        and the room it leaves kept for the new group, not given to a new engine)."""
        with self._lock:
            old = self.learner
            for name in old.pings():
                self._heartbeat.forget(name)
        old.close()
        self.pool.allow_growth(False)
        try:
            group = LearnerGroup(self.model_path, self.cfg.learner, self.rt, old.weights)
        finally:
            self.pool.allow_growth(True)
        with self._lock:
            self.learner = group
            for name in group.pings():
                self._heartbeat.answered(name)

    # ------------------------------------------------------------------------------------------ the rest

    def fault_metrics(self) -> dict:
        """pool/size and the fault events since the last call (fault/<kind> totals)."""
        events = get(self.pool.registry.drain.remote(), self.rt.deadlines.call_s, "the run's registry")
        return {"pool/size": float(self.pool.size), **event_metrics(events)}

    def scale(self, wait_s: float, step_s: float, queued: int, engine_busy_s: float | None = None) -> dict:
        """After a trained step: what it measured (the learner's wait and the step's wall time, the batches grown
        ahead, the engines' busy seconds) goes to the scaling policy (runtime.elastic.autoscale), whose decision the
        pool carries out and the console shows; the pool's figures (pool/target, pool/scale_ups, pool/scale_downs:
        decisions at this step)."""
        pool, policy = self.pool, self.policy
        wait_share = min(wait_s / step_s, 1.0) if step_s > 0 else 0.0
        out = {"pool/target": float(pool.target), "pool/wait_share": wait_share, "pool/queued": float(queued)}
        if policy is None:
            return out
        busy = (min(engine_busy_s / (step_s * pool.size), 1.0)
                if engine_busy_s is not None and pool.size and step_s > 0 else None)
        ups, downs = policy.scale_ups, policy.scale_downs
        before = pool.target
        decision = policy.observe(StepMeasure(wait_share, queued, busy), time.monotonic(),
                                  joined=pool.pending == 0 and pool.size >= pool.target)
        if decision is not None:
            policy.target = pool.set_target(decision.target)
            print(decision.line(before), flush=True)
        return {**out, "pool/target": float(pool.target), "pool/scale_ups": float(policy.scale_ups - ups),
                "pool/scale_downs": float(policy.scale_downs - downs)}

    def start_chaos(self) -> None:
        """runtime.chaos, while training runs (job/trainer.py)."""
        if self.rt.chaos.kill_every > 0:
            self._chaos = ChaosMonkey(self, self.rt.chaos)

    def stop_chaos(self) -> None:
        if self._chaos is not None:
            self._chaos.stop()
            self._chaos = None

    def after_step(self, version: int) -> None:
        """Step `version` is trained, logged and checkpointed: runtime.chaos.kill_learner_after_step kills learner
        rank 0 here, once."""
        if version == self.rt.chaos.kill_learner_after_step and not self._learner_killed:
            self._learner_killed = True
            done = kill_actor(self.learner.ranks[0], "signal")
            self.journal("chaos_kills_learner", f"chaos killed learner rank 0 ({done})")

    def victims(self, kind: str) -> list:
        """The live actors of one kind (chaos.py): engine, scheduler, verifier or learner."""
        with self._lock:
            return {"engine": list(self.pool.members().values()), "scheduler": list(self.schedulers),
                    "verifier": list(self.verifiers.verifiers), "learner": list(self.learner.ranks)}[kind]

    def shutdown(self) -> None:
        """Stop the watch and kill every actor of the run (their resources return to the cluster)."""
        self._stop.set()
        self.stop_chaos()
        if self._thread is not None:
            self._thread.join(timeout=self.rt.elastic.poll_s + self.rt.deadlines.call_s)
        if self.pool is not None:
            self.pool.close()  # the engines, pending ones too, and the registry
        if self.learner is not None:
            self.learner.close()  # the ranks and their placement group
        extra = [self.healer] if self.healer is not None else []
        for actor in (self.verifiers.actors() if self.verifiers else []) + self.schedulers + extra:
            ray.kill(actor)

