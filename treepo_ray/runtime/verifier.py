"""Verification on Ray: verifier actors (CPU) running the rewards layer's scorer, behind one front that retries.

    VerifierActor   scores (data_source, solution, ground_truth) triples; restarted in place by Ray when lost
    VerifierFront   a small async actor on the driver's node: a call goes to a free verifier (its time limit counts
                    from the start of scoring), is retried on the next one, then fails (Unverified rewards)
    VerifierPool    what schedulers, the healer and the driver hold: `score(items)` -> ObjectRef of the rewards
    Unverified      the reward of a solution that has none (the reward function raised, timed out or returned NaN,
                    or the verifiers failed), with its cause and reason
    leave_out_unverified, verification_metrics
                    unverified trajectories are left out of the tree (never trained on as wrong) and counted per
                    step and cause; past runtime.faults.max_verify_failed_share the run stops naming the first reason
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from typing import NamedTuple

import ray
from ray.exceptions import ActorUnavailableError

from treepo_ray.job.faults import RunStopped, report
from treepo_ray.runtime.liveness import on_this_node
from treepo_ray.runtime.registry import record_async
from treepo_ray.tree import Tree


class Unverified(NamedTuple):
    """No reward for a solution, and why: `cause` is "error" (the reward function raised or returned something that
    is not a score), "timeout" (past its CPU-time limit), "nonfinite" (NaN or infinite) or "verifier" (the verifier
    actors failed the call); `why` is the first reason, in words."""

    cause: str
    why: str


CAUSE_METRICS = {"error": "reward/errors", "timeout": "reward/timeouts", "nonfinite": "reward/nonfinite",
                 "verifier": "verify/verifier_failures"}
"""The per-step metric that counts each cause (verify/failed counts them all)."""


def verified(reward) -> bool:
    """Whether a reward from VerifierPool.score is a reward (a number), not Unverified."""
    return not isinstance(reward, Unverified)


@ray.remote
class VerifierActor:
    """Scores (data_source, solution, ground_truth) triples with the rewards layer; never executes model output."""

    def __init__(self, timeout_s: float, reward_function=None):
        from treepo_ray.rewards import BatchScorer

        # routes each item by its data_source, or to the custom reward function (RewardFunctionConfig) when set
        self.scorer = BatchScorer(timeout_s=timeout_s, reward_function=reward_function)

    def score(self, items: list[tuple]) -> list[float | Unverified]:
        """One score per (data_source, solution, ground_truth, extra_info), Unverified where none was computed."""
        return [Unverified(d["failed"], d["error"]) if "failed" in d else d["score"]
                for d in self.scorer.score_details(items)]


class VerifierPool:
    """What schedulers, the healer and the driver hold (picklable): `score(items)` is an ObjectRef of one reward per
    item, Unverified where there is none, from the VerifierFront. `verifiers` are the actors behind it."""

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
        """ObjectRef of one finite reward per item, or Unverified where there is none."""
        return self.front.score.remote(items)

    def actors(self) -> list:
        return [*self.verifiers, self.front]


def sanitize_scores(scores, n: int) -> list[float | Unverified]:
    """`n` rewards out of a verifier's answer: numbers and Unverified as they are, anything else (NaN, a string)
    Unverified("nonfinite"); a wrong count or type makes all `n` Unverified("verifier")."""
    try:
        values = list(scores)
    except TypeError:
        return [Unverified("verifier", f"verifier returned {type(scores).__name__}, not a list of {n} scores")] * n
    if len(values) != n:
        return [Unverified("verifier", f"verifier returned {len(values)} scores for {n} solutions")] * n
    out: list[float | Unverified] = []
    for i, v in enumerate(values):
        if isinstance(v, Unverified):
            out.append(v)
            continue
        try:
            x = float(v)
        except (TypeError, ValueError):
            x = math.nan
        out.append(x if math.isfinite(x) else Unverified("nonfinite", f"score {i} is {v!r}"))
    return out


def leave_out_unverified(tree: Tree, rewards: list[float | Unverified]) -> Tree:
    """Set the verified trajectories' rewards; trajectories without a reward are left out of the tree (so out of
    the loss: they are never trained on as wrong answers), counted by cause in tree.meta["unverified"] with the
    first reason in tree.meta["unverified_why"]."""
    ok = [i for i, r in enumerate(rewards) if verified(r)]
    if len(ok) < len(rewards):
        tree = tree.keep_trajectories(ok)
        failed = [r for r in rewards if not verified(r)]
        tree.meta["unverified"] = dict(Counter(r.cause for r in failed))
        tree.meta["unverified_why"] = f"{failed[0].cause}: {failed[0].why}"
    tree.set_trajectory_rewards([rewards[i] for i in ok])
    return tree


def verification_metrics(trees: list[Tree], max_failed_share: float) -> dict[str, float]:
    """verify/failed (trajectories left out), verify/failed_share and the count of each cause (CAUSE_METRICS) of
    one step's trees; raises RunStopped, naming the first reason, when the share is above `max_failed_share`
    (runtime.faults.max_verify_failed_share): the reward is broken, and training on what is left would be training
    on a biased sample."""
    causes: Counter = Counter()
    for t in trees:
        causes.update(t.meta.get("unverified", {}))
    failed = sum(causes.values())
    total = failed + sum(len(t.trajectories) for t in trees)
    share = failed / total if total else 0.0
    if share > max_failed_share:
        first = next(t.meta["unverified_why"] for t in trees if "unverified_why" in t.meta)
        raise RunStopped(f"{failed} of {total} trajectories of this step have no reward ({share:.0%} > "
                         f"runtime.faults.max_verify_failed_share = {max_failed_share:.0%}); the first: {first}")
    return {"verify/failed": float(failed), "verify/failed_share": share,
            **{metric: float(causes.get(cause, 0)) for cause, metric in CAUSE_METRICS.items()}}


@ray.remote(num_cpus=0)
class VerifierFront:
    """Scoring with retries, in one small async actor in front of the verifier actors (so that callers get an
    ObjectRef, which an async scheduler awaits and a thread ray.get()s alike). It lives on the driver's node.

    Calls wait here for a verifier that is free and only then go to it, so a call's time limit, `call_timeout_s`,
    counts from the start of its scoring, never from its time in a queue. A call whose verifier raises or runs past
    the limit is retried on the next free verifier, at most `retries` times; a verifier that dies under a call (or
    is restarting) does not use up a retry while the call's overall deadline, call_timeout_s x (retries + 1) from
    its first attempt, lasts. After that its solutions come back Unverified("verifier"), the reason logged and counted
    (fault/verifier_failures). A solution the reward could not score (an error, a timeout, NaN) comes back
    Unverified too, counted as fault/reward_<cause>, its first reason of each kind printed. The caller leaves those
    trajectories out (leave_out_unverified). A timed-out verifier is killed and restarted in place: verifiers
    hold no state, so Ray's in-place restart (max_restarts=-1) is the right tool for them; they run with
    max_task_retries=0 because the retry here goes to the next verifier instead of waiting for the restart.
    """

    def __init__(self, verifiers: list, registry, rt):
        self.verifiers, self.registry = list(verifiers), registry
        self.retries, self.call_timeout_s = rt.faults.verifier_retries, rt.faults.verifier_call_timeout_s
        self.record_s = rt.deadlines.call_s
        self._free: asyncio.Queue | None = None  # made in the actor's event loop, on the first call
        self._printed: set[str] = set()  # causes whose first reason was printed

    async def score(self, items: list[tuple[str, str, str]]) -> list[float | Unverified]:
        """One reward per (data_source, solution, ground_truth), Unverified where there is none; never raises."""
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
        return [Unverified("verifier", msg)] * n

    async def _sanitized(self, scores, n: int) -> list[float | Unverified]:
        out = sanitize_scores(scores, n)
        failed = [r for r in out if not verified(r)]
        for cause, count in Counter(r.cause for r in failed).items():
            first = next(r.why for r in failed if r.cause == cause)
            if cause not in self._printed:  # the first of each cause on the console; every one counted
                self._printed.add(cause)
                report(f"a solution has no reward ({cause}: {first}); left out of the loss, counted as "
                       f"{CAUSE_METRICS[cause]} (further ones are counted, not printed)")
            await record_async(self.registry, f"reward_{cause}", first, self.record_s, count)
        return out
