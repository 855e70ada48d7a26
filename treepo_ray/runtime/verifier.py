"""Verification on Ray: verifier actors (CPU) running the rewards layer's scorer, behind one front that retries.

    VerifierActor   scores (data_source, solution, ground_truth) triples; restarted in place by Ray when lost
    VerifierFront   a small async actor on the driver's node: timeout, retry on the next verifier, then a failure
    VerifierPool    what schedulers, the healer and the driver hold: `score(items)` -> ObjectRef of the rewards
"""

from __future__ import annotations

import asyncio
import math

import ray
from ray.exceptions import ActorUnavailableError

from treepo_ray.rewards.math import MathVerifyConfig
from treepo_ray.runtime.registry import on_this_node, report


@ray.remote
class VerifierActor:
    """Scores (data_source, solution, ground_truth) triples with the rewards layer; never executes model output."""

    def __init__(self, timeout_s: float, reward_function=None):
        from treepo_ray.rewards import BatchScorer

        # routes each item by its data_source, or to the custom reward function (RewardFunctionConfig) when set
        self.scorer = BatchScorer(timeout_s=timeout_s, reward_function=reward_function)

    def score(self, items: list[tuple]) -> list[float]:
        """One score per (data_source, solution, ground_truth, extra_info)."""
        return self.scorer.score_batch(items)


class VerifierPool:
    """What schedulers, the healer and the driver hold (picklable): `score(items)` is an ObjectRef of one finite
    reward per item, from the VerifierFront. `verifiers` are the actors behind it."""

    def __init__(self, verifiers: list, front):
        if not verifiers:
            raise ValueError("VerifierPool needs at least one verifier actor")
        self.verifiers, self.front = list(verifiers), front

    @classmethod
    def start(cls, num_verifiers: int, num_cpus: float, timeout_s: float, registry, faults,
              reward_function=None) -> "VerifierPool":
        """`num_verifiers` verifier actors (restarted in place when lost) and their front; `reward_function`: the
        job's custom_reward_function section (None or unset = the built-in scorers)."""
        verifiers = [VerifierActor.options(num_cpus=num_cpus, max_restarts=-1, max_task_retries=0).remote(
            timeout_s, reward_function) for _ in range(num_verifiers)]
        front = VerifierFront.options(scheduling_strategy=on_this_node()).remote(
            verifiers, registry, faults.verifier_retries, faults.verifier_call_timeout_s,
            MathVerifyConfig().wrong_score)
        return cls(verifiers, front)

    def score(self, items: list[tuple[str, str, str]]):
        """ObjectRef of one finite reward per item."""
        return self.front.score.remote(items)

    def actors(self) -> list:
        return [*self.verifiers, self.front]


def sanitize_scores(scores, n: int, failure_score: float) -> tuple[list[float], list[str]]:
    """`n` finite rewards out of a verifier's answer: a wrong count fails all, a NaN/inf or non-number fails that
    item. Returns the rewards and one reason per failure."""
    try:
        values = list(scores)
    except TypeError:
        return [failure_score] * n, [f"verifier returned {type(scores).__name__}, not a list of {n} scores"]
    if len(values) != n:
        return [failure_score] * n, [f"verifier returned {len(values)} scores for {n} solutions"]
    out, reasons = [], []
    for i, v in enumerate(values):
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = math.nan
        if math.isfinite(x):
            out.append(x)
        else:
            out.append(failure_score)
            reasons.append(f"score {i} is {v!r}")
    return out, reasons



@ray.remote(num_cpus=0)
class VerifierFront:
    """Scoring with retries, in one small async actor in front of the verifier actors (so that callers get an
    ObjectRef, which an async scheduler awaits and a thread ray.get()s alike). It lives on the driver's node.

    A call whose verifier raises or takes longer than `call_timeout_s` is retried on the next verifier, at most
    `retries` times; a verifier that dies under a call (or is restarting) does not use up a retry while the call's
    overall deadline, call_timeout_s x (retries + 1), lasts. After that its solutions score `failure_score` (the
    rewards layer's wrong score) and the reason is logged and counted (fault/verifier_failures); NaN/inf scores
    become failures the same way (fault/nonfinite_rewards). A timed-out verifier is killed and restarted in place:
    verifiers hold no state, so Ray's in-place restart (max_restarts=-1) is the right tool for them; they run with
    max_task_retries=0 because the retry here goes to the next verifier instead of waiting for the restart.
    """

    def __init__(self, verifiers: list, registry, retries: int, call_timeout_s: float, failure_score: float):
        self.verifiers, self.registry = list(verifiers), registry
        self.retries, self.call_timeout_s, self.failure_score = retries, call_timeout_s, float(failure_score)
        self._next = 0

    async def score(self, items: list[tuple[str, str, str]]) -> list[float]:
        """One reward per (data_source, solution, ground_truth), never NaN, never an exception."""
        n, why, failures = len(items), "", 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.call_timeout_s * (self.retries + 1)
        while True:
            actor = self.verifiers[self._next % len(self.verifiers)]
            self._next += 1
            try:
                scores = await asyncio.wait_for(asyncio.wrap_future(actor.score.remote(items).future()),
                                                self.call_timeout_s)
            except asyncio.TimeoutError:
                why = f"timed out after {self.call_timeout_s:g}s"
                ray.kill(actor, no_restart=False)  # hung: restart it, so later calls do not queue behind this one
            except ActorUnavailableError as err:
                # Died under the call or restarting: Ray brings it back; try the next one without using up a retry
                # (until the overall deadline), so that a restart of every verifier at once fails nothing.
                why = f"verifier unavailable ({str(err).splitlines()[0] if str(err) else 'restarting'})"
                self.registry.record.remote("verifier_retries", f"scoring {n} solutions: {why}; retrying")
                if loop.time() < deadline:
                    await asyncio.sleep(0.1)
                    continue
            except Exception as err:  # noqa: BLE001 - a dead verifier or a scoring error: retry, then fail the items
                why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            else:
                return self._sanitized(scores, n)
            failures += 1
            if failures > self.retries:
                break
            self.registry.record.remote("verifier_retries", f"scoring {n} solutions: {why}; retrying")
        msg = f"{n} solutions scored as failures after {failures} failed attempts: {why}"
        report(msg)
        self.registry.record.remote("verifier_failures", msg, n)
        return [self.failure_score] * n

    def _sanitized(self, scores, n: int) -> list[float]:
        out, reasons = sanitize_scores(scores, n, self.failure_score)
        if reasons:
            msg = f"{len(reasons)} non-finite or malformed rewards scored as failures: {'; '.join(reasons[:3])}"
            report(msg)
            self.registry.record.remote("nonfinite_rewards", msg, len(reasons))
        return out
