"""Verification on Ray (runtime/verifier.py): a verifier's answer always becomes finite rewards, and the front retries
a lost or hung verifier, then scores the call's solutions as failures (real local Ray, real verifiers)."""

import math

import pytest
import ray

from treepo_ray.data.synthetic import DATA_SOURCE
from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.runtime.recovery import kill_actor
from treepo_ray.runtime.registry import RuntimeRegistry
from treepo_ray.runtime.verifier import VerifierFront, VerifierPool, sanitize_scores


def test_sanitize_scores_turns_nan_inf_and_garbage_into_failures():
    out, reasons = sanitize_scores([1.0, math.nan, -math.inf, "x", 0.5], 5, failure_score=-1.0)
    assert out == [1.0, -1.0, -1.0, -1.0, 0.5]
    assert len(reasons) == 3 and "score 1 is nan" in reasons[0]
    out, reasons = sanitize_scores([1.0], 3, failure_score=0.0)  # a wrong count fails the whole call
    assert out == [0.0, 0.0, 0.0] and "1 scores for 3 solutions" in reasons[0]
    out, reasons = sanitize_scores(None, 2, failure_score=0.0)
    assert out == [0.0, 0.0] and reasons


@pytest.mark.slow
def test_verifier_loss_retries_and_timeouts_score_failures(ray_local):
    registry = RuntimeRegistry.remote()
    faults = load_config(DEFAULT_CONFIG, ["runtime.faults.verifier_retries=1"]).runtime.faults
    pool = VerifierPool.start(2, 0, 5.0, registry, faults)
    items = [(DATA_SOURCE, "12 + 30 = 42\n\\boxed{42}", "42"), (DATA_SOURCE, "\\boxed{41}", "42")]
    try:
        assert ray.get(pool.score(items)) == [1.0, 0.0]
        # The verifier the next call goes to dies (SIGKILL of its process): the call is retried on the other one,
        # and the dead one is restarted in place by Ray (verifiers hold no state).
        kill_actor(pool.verifiers[1], "signal")
        assert ray.get(pool.score(items)) == [1.0, 0.0]
        assert ray.get(pool.score(items)) == [1.0, 0.0]  # round robin reaches the restarted one (or waits for it)
        kinds = [k for _, k, _, _ in ray.get(registry.drain.remote())]
        assert kinds and set(kinds) == {"verifier_retries"}  # retried, never failed
        # A call longer than the limit (a tower sympy tries to expand; the verifier's own per-item deadline is 5 s):
        # retried once, then the items score as failures with the reason logged; the hung verifiers are restarted.
        impatient = VerifierFront.remote(pool.verifiers, registry, 1, 1.0, -1.0)
        hard = [("math", r"\boxed{10^{10^{10}}}", "5"), items[0]]
        assert ray.get(impatient.score.remote(hard)) == [-1.0, -1.0]
        events = ray.get(registry.drain.remote())
        assert [k for _, k, _, _ in events] == ["verifier_retries", "verifier_failures"]
        assert "timed out after 1s" in events[-1][2] and events[-1][3] == 2
        ray.kill(impatient)
        assert ray.get(pool.score(items), timeout=60) == [1.0, 0.0]  # the timed-out verifiers came back
    finally:
        for actor in pool.actors() + [registry]:
            ray.kill(actor)
