"""The engines: the router every caller holds (runtime/router.py: sticky, balanced, re-homed on a loss, the dead never
re-admitted), resource fitting, an engine that cannot start, and, during real runs on a local Ray, engines killed
mid-segment, an engine that stops answering (SIGSTOP) and an engine whose step raises an out-of-memory error: the
supervisor drops and replaces them, the router re-sends their requests, and the trees come out as without faults."""

import os
import signal
import sys
import threading
import time

import pytest
import ray

from treepo_ray.data.prompts import PromptStream
from treepo_ray.job.config import RuntimeConfig
from treepo_ray.runtime.chaos import kill_actor
from treepo_ray.runtime.pool import EngineSpec, GeneratorPool
from treepo_ray.runtime.router import EngineRouter
from runtime_testlib import faults, job, started, trained, two_engines


def test_routing_is_sticky_rehomes_on_loss_and_never_readmits_the_dead():
    router = EngineRouter(registry=None, rt=RuntimeConfig())  # nothing here calls Ray or an engine
    router.set_engines(1, {"a": "A", "b": "B"})
    home = lambda q: router._route(q)[0]  # noqa: E731 - what `call` routes by
    assert [home(q) for q in ("t1", "t2", "t3")] == ["a", "b", "a"]  # new trees go to the least busy engine
    assert home("t2") == "b" and home("t1") == "a"  # sticky
    router._give_up("a")  # what a failed call does: t1 and t3 lose their home, the engine is gone for good
    assert home("t1") == "b" and home("t3") == "b"
    router.set_engines(5, {"a": "A", "b": "B", "c": "C"})  # a stale member list still naming "a"
    assert sorted(router._engines) == ["b", "c"] and router._epoch == 5
    assert home("t4") == "c"  # the newcomer has no live trees: new trees go there
    router.finish("t2", [])
    router.set_engines(6, {"c": "C"})  # "b" left: its trees move on their next call
    assert home("t1") == "c"
    router.set_engines(7, {})
    assert router._route("t9") is None  # no engine: `call` waits for one (runtime.faults.engine_wait_s)


def test_one_router_is_safe_to_share_between_threads():
    # The healer's threads share one router: homing trees, finishing them, giving engines up and adopting member
    # lists at once must neither raise nor lose count of the live trees on an engine.
    router = EngineRouter(registry=None, rt=RuntimeConfig())
    engines = {f"e{i}": f"E{i}" for i in range(4)}
    router.set_engines(1, engines)
    errors = []

    def trees(t: int) -> None:  # many trees alive at once, so that re-homing walks a large table
        try:
            for round_ in range(20):
                qids = [f"t{t}/{round_}/{k}" for k in range(500)]
                routed = [q for q in qids if router._route(q) is not None]
                for qid in routed:
                    router.finish(qid, [])
        except Exception as err:  # noqa: BLE001 - what the test looks for
            errors.append(err)

    def membership() -> None:
        try:
            for epoch in range(2, 2000):
                router.set_engines(epoch, dict(list(engines.items())[epoch % 4:]))
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=trees, args=(t,)) for t in range(8)] + [threading.Thread(target=membership)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch as often as they can: a race shows at once
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert router._home == {} and all(n == 0 for n in router._trees.values())  # every tree finished, none counted


def test_engine_spec_asks_for_configured_resources():
    spec = EngineSpec("hf", "m", {}, 1, 1, 0, {"generator_gpu": 1})
    assert spec.demand() == {"CPU": 1.0, "generator_gpu": 1.0}
    assert spec.fits({"CPU": 4.0, "generator_gpu": 1.0})
    assert not spec.fits({"CPU": 4.0}) and not spec.fits({"CPU": 0.5, "generator_gpu": 2.0})


@pytest.mark.slow
def test_an_engine_that_cannot_start_fails_the_run_at_once(ray_local, tmp_path):
    # A bad engine config is not a lost node: no endless replacements, the engine's own error instead.
    spec = EngineSpec("hf", str(tmp_path / "no-model-here"), {}, 1, 0, 0, {})
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)could not start.*no-model-here' is not a directory"):
        GeneratorPool(spec, RuntimeConfig())
    assert time.monotonic() - start < 60


def busy_engine(rt):
    """An engine with sequences running (mid-segment), or None."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        busy = [s["engine_id"] for s in rt.supervisor.pool.stats() if s["running"] > 0]
        if busy:
            return rt.supervisor.pool.members().get(busy[0])
        time.sleep(0.005)
    return None


def slow_steps(engine, seconds: float) -> None:
    """Make each of the engine's decode steps take `seconds` longer (same results, only later)."""
    def arm(actor):
        step = actor.engine.step

        def slow():
            time.sleep(seconds)
            return step()

        actor.engine.step = slow

    ray.get(engine.__ray_call__.remote(arm), timeout=30)


def fail_next_step(engine) -> None:
    """Make the engine's next decode step raise torch.OutOfMemoryError, once (what a real OOM raises)."""
    def arm(actor):
        import torch

        step = actor.engine.step

        def failing():
            actor.engine.step = step
            raise torch.OutOfMemoryError("CUDA out of memory (raised on purpose by the test)")

        actor.engine.step = failing

    ray.get(engine.__ray_call__.remote(arm), timeout=30)


def full_trees(batch, metrics, width=4, prompts=4):
    """Every prompt of the step came back with its full set of finished trajectories."""
    return (metrics["actor/samples"] == width * prompts and len(batch.trees) == prompts
            and all(len(t["trajectories"]) == width for t in batch.trees))


def faulty_steps(rt, start: int, end: int, stream, faults_at: dict) -> list:
    """Steps [start, end) of a synchronous loop, calling faults_at[step](rt) right after that step is trained: the
    producer grows the next batch meanwhile (max_staleness 0), so an engine is busy when the fault looks for one."""
    rows = []
    for batch, metrics in rt.loop.steps(start, end, stream, trees_logged=4, max_staleness=0):
        rows.append((batch, metrics))
        if batch.step in faults_at:
            faults_at[batch.step](rt)
    return rows


def until_replaced(rt, rows: list, lost: int) -> dict:
    """The run's fault/* totals once `lost` engines were dropped and as many replacements joined (within 60 s)."""
    totals = faults(rt, rows)
    deadline = time.monotonic() + 60
    while (totals.get("fault/engines_lost", 0), totals.get("fault/engines_joined", 0)) < (lost, lost) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
        for key, value in faults(rt).items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


def same_trees(clean: list, faulty: list) -> bool:
    """Same prompts, same seeds, same weights: the same trees, token for token, and the same rewards."""
    return all([t["tokens"] for t in b0.trees] == [t["tokens"] for t in b1.trees]
               and [t["reward"] for t in b0.trees] == [t["reward"] for t in b1.trees]
               for (b0, _), (b1, _) in zip(clean, faulty))


@pytest.mark.slow
def test_engines_killed_mid_segment_change_nothing_but_wall_time(ray_local, tiny):
    # A negligible learning rate keeps the weights as they are, so the same prompts (same seeds) must give the
    # same trees in a run without faults and in one where engines die under them.
    run = job(two_engines(tiny, "learner.lr=1e-30"))
    rt = started(run)
    caught = []

    def kill(how):
        def fault(rt):
            victim = busy_engine(rt)
            caught.append(victim is not None)
            if victim is not None:
                kill_actor(victim, how)
        return fault

    try:
        clean = trained(rt, 0, 3, PromptStream(run.train_set, 0), trees_logged=4)
        for engine in rt.supervisor.pool.members().values():
            slow_steps(engine, 0.03)  # busy for longer than a look takes on a loaded machine
        faulty = faulty_steps(rt, 3, 6, PromptStream(run.train_set, 0), {3: kill("ray"), 4: kill("signal")})
        totals = until_replaced(rt, faulty, lost=2)
        size = rt.supervisor.pool.size
    finally:
        rt.supervisor.shutdown()
    assert caught == [True, True]
    # Each kill is one engine lost, and one replacement that joined; their callers re-sent what they had asked.
    assert totals["fault/engines_lost"] == 2 and totals["fault/engines_joined"] == 2 and size == 2, totals
    assert totals["fault/resent_requests"] >= 2
    # Every step trained once, in order, on full trees (one optimizer step per training step).
    assert [b.step for b, _ in clean + faulty] == list(range(6))
    assert [m["actor/optimizer_steps"] for _, m in clean + faulty] == [1, 2, 3, 4, 5, 6]
    assert [m["perf/policy_version"] for _, m in clean + faulty] == [1, 2, 3, 4, 5, 6]
    assert all(full_trees(b, m) for b, m in clean + faulty)
    # Every segment came from the weights the pool ran for that batch (a replacement loaded them before joining).
    assert same_trees(clean, faulty)
    assert all(t["meta"]["weights_version"] == b.version for b, _ in faulty for t in b.trees)


@pytest.mark.slow
def test_a_stuck_engine_and_an_engine_error_are_replaced_and_change_nothing(ray_local, tiny):
    # As above: a negligible learning rate, so the same prompts must give the same trees with and without faults.
    run = job(two_engines(tiny, "learner.lr=1e-30", "runtime.deadlines.heartbeat_s=2"))
    rt = started(run)
    done_to = {}

    def stop(rt):  # the producer grows batch 4: one engine stops answering (SIGSTOP)
        victim = busy_engine(rt)
        done_to["stopped"] = ray.get(victim.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
        os.kill(done_to["stopped"], signal.SIGSTOP)

    def oom(rt):  # the next decode step of an engine raises out of memory
        fail_next_step(next(iter(rt.supervisor.pool.members().values())))
        done_to["armed"] = True

    try:
        clean = trained(rt, 0, 3, PromptStream(run.train_set, 0), trees_logged=4)
        for engine in rt.supervisor.pool.members().values():
            slow_steps(engine, 0.03)  # as above: busy for longer than a look takes
        start = time.monotonic()
        faulty = faulty_steps(rt, 3, 6, PromptStream(run.train_set, 0), {3: stop, 4: oom})
        took = time.monotonic() - start
        totals = until_replaced(rt, faulty, lost=2)
    finally:
        rt.supervisor.shutdown()
    assert "stopped" in done_to and done_to["armed"] and took < 120
    # The stuck engine was killed by the heartbeat (or its call's deadline), the failing one by its caller.
    assert totals["fault/engines_stuck"] >= 1 and totals["fault/engine_errors"] >= 1, totals
    assert totals["fault/engines_lost"] == 2 and totals["fault/resent_requests"] >= 2, totals
    assert [b.step for b, _ in clean + faulty] == list(range(6)) and all(full_trees(b, m) for b, m in faulty)
    assert same_trees(clean, faulty)
