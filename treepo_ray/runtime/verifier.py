"""Verification on Ray: verifier actors (CPU) running the rewards layer's scorer, behind one front that retries.

    VerifierActor   scores (data_source, solution, ground_truth) triples; restarted in place by Ray when lost
    VerifierFront   a small async actor on the driver's node: a call goes to a free verifier (its time limit counts
                    from the start of scoring), is retried on the next one, then fails (None rewards)
    VerifierPool    what schedulers, the healer and the driver hold: `score(items)` -> ObjectRef of the rewards
    leave_out_unverified, verification_metrics
                    failed trajectories are left out of the tree (never trained on as wrong) and counted per step
"""

from __future__ import annotations

import asyncio
import math

import ray
from ray.exceptions import ActorUnavailableError

from treepo_ray.job.faults import RunStopped
from treepo_ray.runtime.liveness import on_this_node
from treepo_ray.runtime.registry import record_async
from treepo_ray.tree import Tree


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
    """What schedulers, the healer and the driver hold (picklable): `score(items)` is an ObjectRef of one reward per
    item, None where verification failed, from the VerifierFront. `verifiers` are the actors behind it."""

    def __init__(self, verifiers: list, front):
        if not verifiers:
            raise ValueError("VerifierPool needs at least one verifier actor")
        self.verifiers, self.front = list(verifiers), front

    @classmethod
    def start(cls, rt, registry, reward_function) -> "VerifierPool":
        """runtime.num_verifiers verifier actors (restarted in place when lost) and their front (`rt`: the runtime
        section); `reward_function`: the job's custom_reward_function section (unset = the built-in scorers)."""
        verifiers = [VerifierActor.options(num_cpus=rt.verifier_cpus, max_restarts=-1, max_task_retries=0).remote(
            rt.verifier_timeout_s, reward_function) for _ in range(rt.num_verifiers)]
        front = VerifierFront.options(scheduling_strategy=on_this_node()).remote(verifiers, registry, rt)
        return cls(verifiers, front)

    def score(self, items: list[tuple[str, str, str]]):
        """ObjectRef of one finite reward per item, or None where verification failed after the retries."""
        return self.front.score.remote(items)

    def actors(self) -> list:
        return [*self.verifiers, self.front]


def sanitize_scores(scores, n: int) -> tuple[list[float | None], list[str]]:
    """`n` rewards out of a verifier's answer, None for each that is not a finite number (a wrong count fails all).
    Returns the rewards and one reason per failure."""
    try:
        values = list(scores)
    except TypeError:
        return [None] * n, [f"verifier returned {type(scores).__name__}, not a list of {n} scores"]
    if len(values) != n:
        return [None] * n, [f"verifier returned {len(values)} scores for {n} solutions"]
    out: list[float | None] = []
    reasons = []
    for i, v in enumerate(values):
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = math.nan
        if math.isfinite(x):
            out.append(x)
        else:
            out.append(None)
            reasons.append(f"score {i} is {v!r}")
    return out, reasons


def leave_out_unverified(tree: Tree, rewards: list[float | None]) -> Tree:
    """Set the verified trajectories' rewards; trajectories whose verification failed are left out of the tree (so
    out of the loss: they are never trained on as wrong answers), counted in tree.meta["verify_failed"]."""
    ok = [i for i, r in enumerate(rewards) if r is not None]
    if len(ok) < len(rewards):
        tree = tree.keep_trajectories(ok)
        tree.meta["verify_failed"] = len(rewards) - len(ok)
    tree.set_trajectory_rewards([rewards[i] for i in ok])
    return tree


def verification_metrics(trees: list[Tree], max_failed_share: float) -> dict[str, float]:
    """verify/failed (trajectories left out) and verify/failed_share of one step's trees; raises when the share
    is above `max_failed_share` (runtime.faults.max_verify_failed_share): the verifiers are broken, and training on
    what is left would be training on a biased sample."""
    failed = sum(t.meta.get("verify_failed", 0) for t in trees)
    total = failed + sum(len(t.trajectories) for t in trees)
    share = failed / total if total else 0.0
    if share > max_failed_share:
        raise RunStopped(f"{failed} of {total} trajectories of this step could not be verified ({share:.0%} > "
                           f"runtime.faults.max_verify_failed_share = {max_failed_share:.0%}); the reasons are in "
                           "the [treepo-ray fault] lines above")
    return {"verify/failed": float(failed), "verify/failed_share": share}


@ray.remote(num_cpus=0)
class VerifierFront:
    """Scoring with retries, in one small async actor in front of the verifier actors (so that callers get an
    ObjectRef, which an async scheduler awaits and a thread ray.get()s alike). It lives on the driver's node.

    Calls wait here for a verifier that is free and only then go to it, so a call's time limit, `call_timeout_s`,
    counts from the start of its scoring, never from its time in a queue. A call whose verifier raises or runs past
    the limit is retried on the next free verifier, at most `retries` times; a verifier that dies under a call (or
    is restarting) does not use up a retry while the call's overall deadline, call_timeout_s x (retries + 1) from
    its first attempt, lasts. After that its solutions come back as None, the reason logged and counted
    (fault/verifier_failures); NaN/inf scores become None the same way (fault/nonfinite_rewards). The caller leaves
    those trajectories out (leave_out_unverified). A timed-out verifier is killed and restarted in place: verifiers
    hold no state, so Ray's in-place restart (max_restarts=-1) is the right tool for them; they run with
    max_task_retries=0 because the retry here goes to the next verifier instead of waiting for the restart.
    """

    def __init__(self, verifiers: list, registry, rt):
        self.verifiers, self.registry = list(verifiers), registry
        self.retries, self.call_timeout_s = rt.faults.verifier_retries, rt.faults.verifier_call_timeout_s
        self.record_s = rt.deadlines.call_s
        self._free: asyncio.Queue | None = None  # made in the actor's event loop, on the first call

    async def score(self, items: list[tuple[str, str, str]]) -> list[float | None]:
        """One reward per (data_source, solution, ground_truth), None where verification failed; never raises."""
        if self._free is None:
            self._free = asyncio.Queue()
            for actor in self.verifiers:
                self._free.put_nowait(actor)
        n, why, failures, deadline = len(items), "", 0, None
        loop = asyncio.get_running_loop()
        while True:
            actor = await self._free.get()  # a verifier with nothing else to do: the time limit starts now
            deadline = deadline or loop.time() + self.call_timeout_s * (self.retries + 1)
            try:
                scores = await asyncio.wait_for(asyncio.wrap_future(actor.score.remote(items).future()),
                                                self.call_timeout_s)
            except asyncio.TimeoutError:
                why = f"timed out after {self.call_timeout_s:g}s of scoring"
                ray.kill(actor, no_restart=False)  # hung: restart it, so later calls do not wait behind this one
            except ActorUnavailableError as err:
                # Died under the call or restarting: Ray brings it back; try the next one without using up a retry
                # (until the overall deadline), so that a restart of every verifier at once fails nothing.
                why = f"verifier unavailable ({str(err).splitlines()[0] if str(err) else 'restarting'})"
                await record_async(self.registry, "verifier_retries", f"scoring {n} solutions: {why}; retrying",
                                   self.record_s)
                if loop.time() < deadline:
                    await asyncio.sleep(0.1)
                    continue
            except Exception as err:  # noqa: BLE001 - a dead verifier or a scoring error: retry, then fail the items
                why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            else:
                return await self._sanitized(scores, n)
            finally:
                self._free.put_nowait(actor)
            failures += 1
            if failures > self.retries:
                break
            await record_async(self.registry, "verifier_retries", f"scoring {n} solutions: {why}; retrying",
                               self.record_s)
        msg = f"{n} solutions could not be verified after {failures} failed attempts ({why}); left out of the loss"
        await record_async(self.registry, "verifier_failures", msg, self.record_s, n)
        return [None] * n

    async def _sanitized(self, scores, n: int) -> list[float | None]:
        out, reasons = sanitize_scores(scores, n)
        if reasons:
            msg = f"{len(reasons)} non-finite or malformed rewards left out: {'; '.join(reasons[:3])}"
            await record_async(self.registry, "nonfinite_rewards", msg, self.record_s, len(reasons))
        return out
