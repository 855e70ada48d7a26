"""The asynchronous loop (runtime/loop.py) and the batch builder (runtime/batches.py) on a real local Ray with a real
(random) tiny model: rollout and learning overlap within the staleness bound, and DAPO refills a batch until it holds
mixed groups only; a scheduler killed or stopped mid-batch is replaced by the supervisor and its prompts grown again
into the same trees; the batches waiting in the queue at a checkpoint are trained after a restart as they were
grown."""

import json
import os
import signal
import threading
import time

import pytest
import ray

from treepo_ray.data.prompts import PromptStream
from treepo_ray.runtime.chaos import kill_actor
from runtime_testlib import faults, job, small, started, trained

pytestmark = pytest.mark.slow


def test_loop_overlaps_within_the_staleness_bound_and_dapo_refills(ray_local, tiny):
    run = job(small(tiny, "runtime.max_staleness=1"))
    rt = started(run)
    try:
        rows = trained(rt, 0, 4, PromptStream(run.train_set, 0), trees_logged=1)
        assert rt.loop.version == 4
        # Batch 0 is grown with the initial weights, batch 1 while the learner trains on batch 0 (so one version
        # behind), and no batch is ever more than max_staleness = 1 versions behind the learner.
        versions = [b.version for b, _ in rows]
        assert versions[:2] == [0, 0] and versions == sorted(versions)
        assert [m["perf/staleness"] for _, m in rows][:2] == [0, 1]
        assert all(0 <= m["perf/staleness"] <= 1 for _, m in rows)
        assert all(m["actor/samples"] == 16 and m["actor/skipped"] == 0 for _, m in rows)
        assert [m["perf/policy_version"] for _, m in rows] == [1, 2, 3, 4]
        # Forward tokens are counted per request, so per tree: batches that grow at the same time (and weights
        # loaded while one grows) each get their own figure, and no tree recomputes what its cache holds.
        assert all(m["tree/forward_tokens"] > 0 for _, m in rows)
        ratios = [m["tree/forward_per_unique"] for _, m in rows]
        assert all(r <= 1.02 for r in ratios), ratios
        assert [b.data_position for b, _ in rows] == [4, 8, 12, 16]
        # Batch 1 started growing as soon as batch 0 had taken its prompts, not when batch 0 was done.
        assert rows[1][0].grown[0] < rows[0][0].grown[1]
        # The weights that grew the last batch, which the pool owns and every engine runs.
        pool = rt.supervisor.pool
        assert pool.weights_version == versions[-1]
        assert {s["weights_version"] for s in pool.stats()} == {versions[-1]}
        # max_staleness = 0: grow, train, grow: no batch starts before the one before it was trained, and the
        # engines only ever take weights between batches.
        swapped = sum(s["loads_while_running"] for s in pool.stats())
        sync = [b for b, _ in trained(rt, 4, 7, PromptStream(run.train_set, 0, position=16), max_staleness=0)]
        assert rt.loop.version == 7
        assert all(later.grown[0] >= earlier.grown[1] for earlier, later in zip(sync, sync[1:]))
        assert sum(s["loads_while_running"] for s in pool.stats()) == swapped
    finally:
        rt.supervisor.shutdown()

    # DAPO: sequential sampling, synchronous, over-sample 2x and refill until the batch holds mixed groups only.
    run = job(small(tiny, "algo.name=dapo", "algo.dynamic_sampling=true", "algo.oversample=2",
                    "algo.max_extra_rounds=1", "runtime.max_staleness=0"))
    rt = started(run)
    try:
        stream = PromptStream(run.train_set, 0)
        batch = rt.loop.builder.make(0, stream, 0.0, 2, threading.Event())
        m = batch.metrics
        assert m["rollout/kept_prompts"] <= 4 and batch.num_samples == 4 * m["rollout/kept_prompts"]
        rounds = int(m["rollout/rounds"])
        assert stream.position == batch.data_position and 8 <= stream.position <= 8 + 8 * (rounds - 1)
        # the logged trees: the trained ones hold mixed groups; dropped ones (logged when too few were kept) do not
        assert all((len(set(t["reward"][n] for n in t["trajectories"])) == 2) == t["trained"] for t in batch.trees)
    finally:
        rt.supervisor.shutdown()


def when_engines_are_busy(rt, then) -> threading.Thread:
    """A thread that calls `then()` as soon as an engine has sequences running (a batch is half grown)."""
    def watch():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(s["running"] for s in rt.supervisor.pool.stats()):
            time.sleep(0.002)
        then()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_scheduler_killed_or_stuck_mid_batch_is_replaced_and_its_prompts_grown_again(ray_local, tiny):
    run = job(small(tiny, "runtime.num_schedulers=2", "rollout.treepo.max_depth=4", "rollout.treepo.segment_len=16",
                    "runtime.deadlines.heartbeat_s=2"))
    rt = started(run)
    sup = rt.supervisor
    prompts = PromptStream(run.train_set, 0).take(8)
    try:
        clean = sup.grow(prompts, 0.0)
        first = sup.schedulers[0]
        killer = when_engines_are_busy(rt, lambda: kill_actor(first, "signal"))
        killed = sup.grow(prompts, 0.0)
        killer.join()
        second = sup.schedulers[1]
        pid = ray.get(second.__ray_call__.remote(lambda _: os.getpid()))
        stopper = when_engines_are_busy(rt, lambda: os.kill(pid, signal.SIGSTOP))  # alive, not answering
        start = time.monotonic()
        stuck = sup.grow(prompts, 0.0)
        took = time.monotonic() - start
        stopper.join()
        totals = faults(rt)
        replaced = sup.schedulers[0] is not first and sup.schedulers[1] is not second
    finally:
        sup.shutdown()
    assert replaced
    assert totals["fault/schedulers_lost"] == 2 and totals["fault/schedulers_stuck"] == 1, totals
    assert totals["fault/regrown_prompts"] == 8  # each time the scheduler's shard of 4 prompts
    assert took < 2 + 30  # the heartbeat's deadline, then a regrown shard
    # The same seeds: the regrown shards are the trees the lost schedulers were growing, token for token.
    for trees in (killed, stuck):
        assert [t.query_id for t in trees] == [p.id for p in prompts]
        assert [t.tokens for t in trees] == [t.tokens for t in clean]
        assert [t.reward for t in trees] == [t.reward for t in clean]


def test_batches_waiting_at_a_checkpoint_are_trained_after_a_restart_as_they_were_grown(ray_local, tiny):
    run = job(small(tiny, "runtime.max_staleness=1", "learner.micro_batch_size=1"))  # slow steps: growth runs ahead
    rt = started(run)
    saved = {}
    try:
        steps = rt.loop.steps(0, 6, PromptStream(run.train_set, 0), trees_logged=4)
        for batch, _ in steps:
            if batch.step < 1:
                continue
            # The checkpoint after step 2: batch 2, grown with weights v1 while step 2 trained, waits in the queue,
            # and batch 3 too when it was grown in the meantime (batches overlap; the slots allow max_staleness + 1).
            deadline = time.monotonic() + 60
            while not rt.loop.waiting() and time.monotonic() < deadline:
                time.sleep(0.01)
            saved["batches"] = rt.loop.waiting()
            saved["records"] = json.loads(json.dumps([b.to_record() for b in saved["batches"]]))  # as the file has
            break  # the driver stops here
        steps.close()
        assert rt.loop.version == 2
        waiting = saved["batches"][0]
        assert [r["step"] for r in saved["records"]] in ([2], [2, 3]) and waiting.version in (1, 2)
        queued = [rt.loop.builder.from_record(r) for r in saved["records"]]
        assert queued[0].fetch() == waiting.fetch()  # credit recomputed from the saved trees
        stream = PromptStream(run.train_set, 0, position=queued[-1].data_position)
        rows = trained(rt, 2, 4, stream, queued=queued, trees_logged=4)
    finally:
        rt.supervisor.shutdown()
    (b2, m2), (b3, m3) = rows
    # Step 2 trained the saved batch as it was grown (in general with weights v1, one version stale), not grown
    # again with the weights of the checkpoint (v2).
    assert b2.version == waiting.version and m2["perf/staleness"] == 2 - waiting.version and b2.trees == waiting.trees
    assert m2["actor/samples"] == 16 and b3.data_position == waiting.data_position + 4
