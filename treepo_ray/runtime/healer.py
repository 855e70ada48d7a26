"""Phases an algorithm runs on a tree right after it is verified (algo/spec.py), and the healer actor that heals
dead-wrong trees for CATPO (phase 3): a thin shell over healing.critique.CritiqueHealer.

    TreeScheduler ──verified tree──▶ verified_phases: score ──needs healing──▶ HealerActor.heal
                                                                               │ critique + k continuations
                                                                               ▼   on the engines (a router)
                                        healed tree, scored again ◀── grafted, verified, rewards re-propagated

The scheduler awaits the healer without blocking its event loop, so a tree's healing overlaps the growth of the
other trees of the batch. The healer's generation is ordinary segment requests on the engines, and the log-probs
of the grafted tokens come from one teacher-forced forward on the same engine (EngineActor.score), given the
original prefix (see healing/critique.py for why).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import threading

import ray

from treepo_ray.engines.decode import safe_decode
from treepo_ray.healing.critique import CritiqueHealer
from treepo_ray.runtime.liveness import get, on_this_node, within
from treepo_ray.runtime.verifier import verified
from treepo_ray.tree.tree import Tree


class HealRefused(ValueError):
    """An engine refused a healing request as bad input (e.g. a critique prompt longer than the model's context)."""


@ray.remote
class HealerActor:
    """Heals dead-wrong trees; `heal` calls run concurrently in threads (one router, which is thread-safe), each
    mostly waiting on an engine."""

    def __init__(self, router, verifiers, model_path: str, healing, wait_s: float):
        """`healing`: HealingConfig with step_len and logprob_temperature filled in (make_healer); `wait_s`: the
        deadline of one verification (runtime.deadlines.grow_s)."""
        from transformers import AutoTokenizer

        self.router, self.verifiers, self.cfg, self.wait_s = router, verifiers, healing, wait_s
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self._local = threading.local()
        self._calls = itertools.count()  # next() is atomic: threads draw distinct numbers

    def _tokenizer(self):
        # One copy per thread: a fast tokenizer used from two threads at once can fail ("Already borrowed").
        if not hasattr(self._local, "tokenizer"):
            self._local.tokenizer = copy.deepcopy(self.tokenizer)
        return self._local.tokenizer

    def _call(self, key: str, method: str, *args):
        """`engine.<method>(*args)` on the engine `key` is routed to; a request the engine refuses as bad input
        raises HealRefused."""
        try:
            return self.router.call_sync(key, method, *args)  # re-sent to another engine if this one fails
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, ValueError):
                raise HealRefused(str(err.cause)) from None
            raise

    def heal(self, tree: Tree, seed: int):
        """(healed tree, HealResult). The caller keeps its own copy of the tree, so a failure leaves it intact."""
        # Its own route (critique prompts share no cache with the tree), and request ids unique to this call: a
        # heal of the same tree may still run here from a shard that failed and is being grown again.
        call = next(self._calls)
        key = f"{tree.query_id}/heal#{call}"
        cache_keys: list[str] = []

        def generate(requests):
            requests = [dataclasses.replace(r, request_id=f"{r.request_id}#{call}") for r in requests]
            results = self._call(key, "generate", requests)
            cache_keys.extend(c.cache_key for r in results for c in r.children if c.cache_key)
            return results

        def logprobs(prefix_ids, token_ids):
            return self._call(key, "score", prefix_ids, token_ids, self.cfg.logprob_temperature)

        tokenizer = self._tokenizer()

        def score(t: Tree, node: int) -> float:
            solution = safe_decode(tokenizer, t.response_ids(node), skip_special_tokens=True)
            item = (t.meta.get("data_source", ""), solution, t.meta["ground_truth"], t.meta.get("extra_info", {}))
            reward = get(self.verifiers.score([item]), self.wait_s, f"verifying a graft of {t.query_id}")[0]
            if not verified(reward):  # never graft a branch scored as wrong because it has no reward
                raise HealRefused(f"a graft of {t.query_id} could not be verified")
            return reward

        healer = CritiqueHealer(tokenizer, generate, logprobs, score, self.cfg)
        try:
            result = healer.heal(tree, seed)
        finally:
            self.router.finish(key, cache_keys)  # nothing continues from the critique or the grafts
        return tree, result


def make_healer(router, verifiers, model_path: str, cfg):
    """The healer actor of a run whose algorithm heals (`cfg`: the job's config); None when it does not. Grafts are
    cut to the tree's step length and scored at the tree's sampling temperature unless healing sets its own. Like the
    schedulers it lives on the driver's node (same failure domain); a lost one is replaced (supervisor.py)."""
    settings = cfg.algo.spec.healing(cfg.algo)
    if settings is None:
        return None
    healing = settings.healing
    if not healing.step_len:
        healing = dataclasses.replace(healing, step_len=cfg.sampler_config.step_len)
    if not healing.logprob_temperature:
        healing = dataclasses.replace(healing, logprob_temperature=cfg.rollout.temperature)
    return HealerActor.options(num_cpus=0, max_concurrency=settings.heal_concurrency,
                               scheduling_strategy=on_this_node(), max_restarts=0, max_task_retries=0).remote(
        router, verifiers, model_path, healing, cfg.runtime.deadlines.grow_s)


async def verified_phases(tree: Tree, algo, healer, seed: int, wait_s: float) -> Tree:
    """The algorithm's phases for one verified tree (`algo`: the job's algo section): score it; if it needs
    healing and a healer runs, heal it and score it again.

    A healing request an engine refuses as bad input (HealRefused, e.g. a critique prompt longer than the model's
    context) is recorded in the tree (CATPO: tree.meta["catpo"]["heal"]["error"], counted per step as
    catpo/heal_errors); the tree is then trained as sampled. Any other failure stops the run.
    """
    spec = algo.spec
    spec.score(tree, algo)
    if healer is None or not spec.needs_healing(tree):
        return tree
    try:
        healed, result = await within(healer.heal.remote(tree, seed), wait_s, f"healing {tree.query_id}")
    except HealRefused as err:  # Ray re-raises the healer's HealRefused as a subclass of it
        message = f"healing tree {tree.query_id!r} failed: {getattr(err, 'cause', err)}"
        print(f"{spec.name}: {message}; it is trained as sampled", flush=True)
        spec.record_heal(tree, None, error=message)
        return tree
    spec.record_heal(healed, result)
    spec.score(healed, algo)
    return healed
