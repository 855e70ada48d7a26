"""The generator pool (runtime/pool.py): the routing every copy does (sticky, balanced, re-homed on a loss, the dead
never re-admitted), resource fitting, the engine's fallback to prefix ids that makes a re-sent request safe, an
engine that cannot start, and, during real runs on a local Ray, engines killed mid-segment, an engine that stops
answering (SIGSTOP) and an engine whose step raises an out-of-memory error."""

import os
import signal
import time

import pytest
import ray

from treepo_ray.data.prompts import PromptStream
from treepo_ray.runtime.pipeline import Pipeline
from treepo_ray.runtime.pool import EngineSpec, GeneratorPool
from treepo_ray.runtime.recovery import kill_actor
from treepo_ray.runtime.registry import actor_id
from runtime_testlib import job, two_engines

# A copy's routing fields (GeneratorPool._ROUTING) as a freshly pickled pool has them, before any member list.
FRESH_ROUTING = dict(registry=None, max_resends=16, refresh_s=0.5, engine_wait_s=900.0, deadlines=None,
                     max_engine_errors=3, _epoch=0, _engines={}, _trees={}, _home={}, _dead=set())


def routing_copy(engines: dict) -> GeneratorPool:
    """A pool as a scheduler holds it (made the way unpickling makes it: routing fields only) over `engines`;
    nothing here calls Ray or an engine."""
    pool = GeneratorPool.__new__(GeneratorPool)
    pool.__setstate__({k: FRESH_ROUTING[k] for k in GeneratorPool._ROUTING})
    pool.set_engines(1, engines)
    return pool


def test_routing_is_sticky_rehomes_on_loss_and_never_readmits_the_dead():
    pool = routing_copy({"a": "A", "b": "B"})
    home = pool._home_of  # what call / call_sync route by
    assert [home(q) for q in ("t1", "t2", "t3")] == ["a", "b", "a"]  # new trees go to the least busy engine
    assert home("t2") == "b" and home("t1") == "a"  # sticky
    pool._lost("a")  # what a failed call does: t1 and t3 lose their home, the engine is gone for good
    assert list(pool._engines) == ["b"] and home("t1") == "b" and home("t3") == "b"
    pool.set_engines(5, {"a": "A", "b": "B", "c": "C"})  # a stale member list still naming "a"
    assert list(pool._engines) == ["b", "c"] and pool._epoch == 5
    assert home("t4") == "c"  # the newcomer has no live trees: new trees go there
    pool.finish("t2", [])
    pool.set_engines(6, {"c": "C"})  # "b" left: its trees move on their next request
    assert home("t1") == "c"
    pool.set_engines(7, {})
    with pytest.raises(RuntimeError, match="no live engine"):
        home("t9")


def test_engine_spec_asks_for_configured_resources():
    spec = EngineSpec("hf", "m", num_cpus=1, num_gpus=0, resources={"generator_gpu": 1})
    assert spec.demand() == {"CPU": 1.0, "generator_gpu": 1.0}
    assert spec.fits({"CPU": 4.0, "generator_gpu": 1.0})
    assert not spec.fits({"CPU": 4.0}) and not spec.fits({"CPU": 0.5, "generator_gpu": 2.0})


@pytest.mark.slow
def test_an_engine_that_cannot_start_fails_the_run_at_once(ray_local, tmp_path):
    # A bad engine config is not a lost node: no endless replacements, the engine's own error instead.
    spec = EngineSpec("hf", str(tmp_path / "no-model-here"), num_cpus=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)could not start.*no-model-here' is not a directory"):
        GeneratorPool(spec, num_engines=1, startup_timeout_s=120)
    assert time.monotonic() - start < 60


def kill_a_busy_engine(pipe, how: str) -> bool:
    """Kill an engine while it has sequences running (mid-segment); True if one was caught busy."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        busy = [s["engine_id"] for s in pipe.pool.stats() if s["running"] > 0]
        if busy:
            victim = next(e for e in pipe.pool.engines() if actor_id(e) == busy[0])
            kill_actor(victim, how)
            return True
        time.sleep(0.005)
    return False


def full_trees(batch, metrics, width=4, prompts=4):
    """Every prompt of the step came back with its full set of finished trajectories."""
    return (metrics["actor/samples"] == width * prompts and len(batch.trees) == prompts
            and all(len(t["trajectories"]) == width for t in batch.trees))


@pytest.mark.slow
def test_engines_killed_mid_segment_change_nothing_but_wall_time(ray_local, tiny):
    # A negligible learning rate keeps the weights as they are, so the same prompts (same seeds) must give the
    # same trees in a run without faults and in one where engines die under them.
    run = job(two_engines(tiny, "learner.lr=1e-30"))
    pipe = Pipeline(run.cfg, run.model_path, run.tokenizer)
    clean, faulty, caught = [], [], []
    # Synchronous (max_staleness 0): after step k is trained the producer grows batch k + 1, so an engine is busy
    # when the kill looks for one (with a staleness of 1 the last batch may be grown already and nothing is running);
    # and the engines' decode steps slowed down, so a batch of these tiny trees keeps them busy for longer than a
    # look takes on a loaded machine.
    kills = {3: "ray", 4: "signal"}

    def on_faulty_step(batch, metrics):
        faulty.append((batch, metrics))
        if batch.step in kills:
            caught.append(kill_a_busy_engine(pipe, kills[batch.step]))
        return True

    try:
        assert pipe.train(0, 3, PromptStream(run.train_set, 0), lambda b, m: clean.append((b, m)) or True, 4) == 3
        for engine in pipe.pool.engines():
            slow_steps(engine, 0.03)
        assert pipe.train(3, 6, PromptStream(run.train_set, 0), on_faulty_step, 4, max_staleness=0) == 6
        assert caught == [True, True]
        deadline = time.monotonic() + 60
        while (pipe.pool.lost, pipe.pool.size) != (2, 2) and time.monotonic() < deadline:
            time.sleep(0.2)  # both losses noticed, both replacements joined
        assert pipe.pool.size == 2 and pipe.pool.lost == 2 and pipe.pool.joined == 4
        tail = pipe.fault_metrics()
    finally:
        pipe.shutdown()

    # Every step trained once, in order, on full trees (learner version = steps trained).
    assert [b.step for b, _ in clean + faulty] == list(range(6))
    assert [m["actor/version"] for _, m in clean + faulty] == [1, 2, 3, 4, 5, 6]
    assert all(full_trees(b, m) for b, m in clean + faulty)
    faults = {}
    for key in ("fault/resent_requests", "fault/engines_lost"):
        faults[key] = sum(m.get(key, 0.0) for _, m in faulty) + tail.get(key, 0.0)
    assert faults["fault/resent_requests"] >= 2 and faults["fault/engines_lost"] == 2
    # Same prompts, same seeds, same weights: the same trees, token for token, and the same rewards. Every
    # segment came from the weights the pool ran for that batch (a replacement loaded them before joining).
    for (b0, _), (b1, _) in zip(clean, faulty):
        assert [t["tokens"] for t in b0.trees] == [t["tokens"] for t in b1.trees]
        assert [t["reward"] for t in b0.trees] == [t["reward"] for t in b1.trees]
        assert all(t["meta"]["weights_version"] == b1.version for t in b1.trees)


def busy_engine(pipe):
    """An engine with sequences running (mid-segment), or None."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        busy = [s["engine_id"] for s in pipe.pool.stats() if s["running"] > 0]
        if busy:
            return next(e for e in pipe.pool.engines() if actor_id(e) == busy[0])
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


@pytest.mark.slow
def test_a_stuck_engine_and_an_engine_error_are_replaced_and_change_nothing(ray_local, tiny):
    # As above: a negligible learning rate, so the same prompts must give the same trees with and without faults.
    run = job(two_engines(tiny, "learner.lr=1e-30", "runtime.deadlines.heartbeat_s=2"))
    pipe = Pipeline(run.cfg, run.model_path, run.tokenizer)
    clean, faulty, done_to = [], [], {}

    def on_faulty_step(batch, metrics):
        faulty.append((batch, metrics))
        if batch.step == 3:  # the producer grows batch 4 (synchronous run): one engine stops answering (SIGSTOP)
            victim = busy_engine(pipe)
            pid = ray.get(victim.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
            os.kill(pid, signal.SIGSTOP)
            done_to["stopped"] = pid
        if batch.step == 4:  # the next decode step of an engine raises out of memory
            fail_next_step(pipe.pool.engines()[0])
            done_to["armed"] = True
        return True

    try:
        assert pipe.train(0, 3, PromptStream(run.train_set, 0), lambda b, m: clean.append((b, m)) or True, 4) == 3
        for engine in pipe.pool.engines():
            slow_steps(engine, 0.03)  # as above: busy for longer than a look takes
        start = time.monotonic()
        assert pipe.train(3, 6, PromptStream(run.train_set, 0), on_faulty_step, 4, max_staleness=0) == 6
        took = time.monotonic() - start
        deadline = time.monotonic() + 60
        while pipe.pool.size != 2 and time.monotonic() < deadline:
            time.sleep(0.2)  # the replacements joined
        assert pipe.pool.size == 2
        tail = pipe.fault_metrics()
    finally:
        pipe.shutdown()
    assert "stopped" in done_to and done_to["armed"] and took < 120
    faults = {k: sum(m.get(k, 0.0) for _, m in faulty) + tail.get(k, 0.0)
              for k in ("fault/engines_stuck", "fault/engine_errors", "fault/resent_requests")}
    # Each failed call counts: the stuck engine's and the failed step's callers all re-send.
    assert faults["fault/engines_stuck"] >= 1 and faults["fault/engine_errors"] >= 1, faults
    assert faults["fault/resent_requests"] >= 2
    assert [b.step for b, _ in clean + faulty] == list(range(6)) and all(full_trees(b, m) for b, m in faulty)
    for (b0, _), (b1, _) in zip(clean, faulty):  # the same prompts (both streams start at 0), the same trees
        assert [t["tokens"] for t in b0.trees] == [t["tokens"] for t in b1.trees]
        assert [t["reward"] for t in b0.trees] == [t["reward"] for t in b1.trees]
