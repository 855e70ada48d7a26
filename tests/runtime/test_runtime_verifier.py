"""Verification on Ray (runtime/verifier.py): a verifier's answer becomes finite rewards or Unverified (no reward, with
its cause), the front retries a lost, hung or stopped (alive, answering nothing) verifier, then fails the call's
solutions (real local Ray, real verifiers); its time limit counts from the start of scoring; unverified trajectories
are left out of the tree and counted per step and cause."""

import math
import os
import signal
import time

import pytest
import ray

from treepo_ray.data.synthetic import DATA_SOURCE
from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.runtime.registry import RuntimeRegistry
from treepo_ray.runtime.verifier import (
    Unverified,
    VerifierFront,
    VerifierPool,
    leave_out_unverified,
    sanitize_scores,
    verification_metrics,
    verified,
)
from treepo_ray.tree import Tree


def causes(rewards: list) -> list:
    """Each reward, or the cause of its absence."""
    return [r if verified(r) else r.cause for r in rewards]


def test_sanitize_scores_turns_nan_inf_and_garbage_into_failures():
    timeout = Unverified("timeout", "no verdict within 5 s of CPU time")
    out = sanitize_scores([1.0, math.nan, -math.inf, "x", 0.5, timeout], 6)
    assert causes(out) == [1.0, "nonfinite", "nonfinite", "nonfinite", 0.5, "timeout"]
    assert out[1].why == "score 1 is nan" and out[5] == timeout
    out = sanitize_scores([1.0], 3)  # a wrong count fails the whole call
    assert causes(out) == ["verifier"] * 3 and "1 scores for 3 solutions" in out[0].why
    assert causes(sanitize_scores(None, 2)) == ["verifier"] * 2


def fan(n: int) -> Tree:
    t = Tree(prompt_ids=[1], query_id="q")
    t.trajectories = [t.add_node(0, [10 + i], [-1.0], "eos") for i in range(n)]
    return t


def test_failed_verifications_are_left_out_and_a_step_with_too_many_stops_the_run():
    error = Unverified("error", "ZeroDivisionError: division by zero (judge.py:3)")
    tree = leave_out_unverified(fan(4), [1.0, error, 0.0, Unverified("timeout", "no verdict")])
    assert [tree.response_ids(n) for n in tree.trajectories] == [[10], [12]]  # never trained as wrong answers
    assert [tree.reward[n] for n in tree.trajectories] == [1.0, 0.0]
    assert tree.meta["unverified"] == {"error": 1, "timeout": 1}
    clean = leave_out_unverified(fan(4), [1.0, 0.0, 1.0, 1.0])
    assert "unverified" not in clean.meta and len(clean.trajectories) == 4
    assert verification_metrics([tree, clean], 0.5) == {
        "verify/failed": 2.0, "verify/failed_share": 0.25, "reward/errors": 1.0, "reward/timeouts": 1.0,
        "reward/nonfinite": 0.0, "verify/verifier_failures": 0.0}
    with pytest.raises(RuntimeError, match=r"2 of 8 trajectories .* no reward \(25% > runtime.faults.max_verify_failed_"
                                           r"share = 20%\); the first: error: ZeroDivisionError: division by zero"):
        verification_metrics([tree, clean], 0.2)


@pytest.mark.slow
def test_verifier_loss_retries_and_timeouts_score_failures(ray_local):
    registry = RuntimeRegistry.remote()
    rt = load_config(DEFAULT_CONFIG, ["runtime.faults.verifier_retries=1", "runtime.num_verifiers=2",
                                      "runtime.verifier_timeout_s=5"]).runtime
    pool = VerifierPool.start(rt, registry, None)
    items = [(DATA_SOURCE, "12 + 30 = 42\n\\boxed{42}", "42"), (DATA_SOURCE, "\\boxed{41}", "42")]
    try:
        assert ray.get(pool.score(items)) == [1.0, 0.0]
        # The verifier the next call goes to dies (SIGKILL of its process) while it scores that call (a tower sympy
        # tries to expand keeps it busy up to the verifier's own per-item deadline of 5 s): the call is retried on
        # the other one, and the dead one is restarted in place by Ray (verifiers hold no state). Killed between
        # two calls instead, it may be back before the next one reaches it, and nothing is retried.
        tower = ("math", r"\boxed{10^{10^{10}}}", "5")
        pid = ray.get(pool.verifiers[1].__ray_call__.remote(lambda _: os.getpid()))  # asked while it is idle
        in_flight = pool.score([tower, tower, *items])  # over 1 s a tower (the timeout below)
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        # a tower has no verdict within its CPU-time limit: no reward, not a wrong answer
        assert causes(ray.get(in_flight)) == ["timeout", "timeout", 1.0, 0.0]
        assert ray.get(pool.score(items)) == [1.0, 0.0]  # round robin reaches the restarted one (or waits for it)
        kinds = [k for _, k, _, _ in ray.get(registry.drain.remote())]
        assert set(kinds) == {"verifier_retries", "reward_timeout"}  # the call retried, never failed
        # A call longer than the limit (a tower sympy tries to expand; the verifier's own per-item deadline is 5 s):
        # retried once, then the items fail (Unverified) with the reason logged; the hung verifiers are restarted.
        impatient = VerifierFront.remote(pool.verifiers, registry, load_config(DEFAULT_CONFIG, [
            "runtime.faults.verifier_retries=1", "runtime.faults.verifier_call_timeout_s=1"]).runtime)
        hard = [tower, items[0]]
        assert causes(ray.get(impatient.score.remote(hard))) == ["verifier", "verifier"]
        events = ray.get(registry.drain.remote())
        assert [k for _, k, _, _ in events] == ["verifier_retries", "verifier_failures"]
        assert "timed out after 1s of scoring" in events[-1][2] and events[-1][3] == 2
        ray.kill(impatient)
        assert ray.get(pool.score(items), timeout=60) == [1.0, 0.0]  # the timed-out verifiers came back
    finally:
        for actor in pool.actors() + [registry]:
            ray.kill(actor)


@pytest.mark.slow
def test_the_time_limit_counts_from_the_start_of_scoring_not_from_the_queue(ray_local):
    registry = RuntimeRegistry.remote()
    rt = load_config(DEFAULT_CONFIG, ["runtime.faults.verifier_retries=0", "runtime.faults.verifier_call_timeout_s=4",
                                      "runtime.verifier_timeout_s=1.2"]).runtime
    # One verifier; each tower takes its 1.2 s CPU-time limit (at most 3.6 s of wall time on a busy machine).
    pool = VerifierPool.start(rt, registry, None)
    tower = ("math", r"\boxed{10^{10^{10}}}", "5")
    try:
        # Two calls at once on one verifier: the second scores after waiting for the first. Counted from when it was
        # sent it could be killed; counted from the start of its scoring it is in time.
        first, second = pool.score([tower, tower]), pool.score([tower])
        assert [causes(r) for r in ray.get([first, second], timeout=60)] == [["timeout", "timeout"], ["timeout"]]
        assert {k for _, k, _, _ in ray.get(registry.drain.remote())} == {"reward_timeout"}  # no verifier failed
    finally:
        for actor in pool.actors() + [registry]:
            ray.kill(actor)


@pytest.mark.slow
def test_a_verifier_that_stops_answering_is_killed_at_the_time_limit_and_its_call_retried(ray_local):
    registry = RuntimeRegistry.remote()
    rt = load_config(DEFAULT_CONFIG, ["runtime.num_verifiers=2", "runtime.faults.verifier_retries=1",
                                      "runtime.faults.verifier_call_timeout_s=3"]).runtime
    pool = VerifierPool.start(rt, registry, None)
    items = [(DATA_SOURCE, "12 + 30 = 42\n\\boxed{42}", "42"), (DATA_SOURCE, "\\boxed{41}", "42")]
    try:
        assert ray.get(pool.score(items)) == [1.0, 0.0]  # the first verifier, which goes to the back of the queue
        pid = ray.get(pool.verifiers[1].__ray_call__.remote(lambda _: os.getpid()))
        os.kill(pid, signal.SIGSTOP)  # alive, answering nothing: the next call goes to it
        start = time.monotonic()
        assert ray.get(pool.score(items), timeout=60) == [1.0, 0.0]  # retried on the other one
        assert 3 <= time.monotonic() - start < 3 + 30
        events = ray.get(registry.drain.remote())
        assert [k for _, k, _, _ in events] == ["verifier_retries"] and "timed out after 3s" in events[0][2]
        # The stopped one was killed and restarted in place by Ray (a new process): it scores again.
        deadline, restarted = time.monotonic() + 60, None
        while restarted is None and time.monotonic() < deadline:
            try:
                restarted = ray.get(pool.verifiers[1].__ray_call__.remote(lambda _: os.getpid()), timeout=10)
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError):
                time.sleep(0.5)  # restarting
        assert restarted is not None and restarted != pid
        assert ray.get(pool.verifiers[1].score.remote(items), timeout=60) == [1.0, 0.0]
    finally:
        for actor in pool.actors() + [registry]:
            ray.kill(actor)
