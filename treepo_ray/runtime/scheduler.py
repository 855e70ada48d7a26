"""The tree scheduler actor: grows and scores the trees of a shard of prompts, each tree at its own pace.

For each prompt it runs a grower (tree/), sends every ask the tree has ready to the engines at once through its
engine router (engines batch them with everyone else's), hands results back to the grower, and when the tree is done
verifies its trajectories (those that fail verification are left out) and runs the algorithm's phases after
verification (algo/spec.py: CATPO scores the tree and has it healed if dead-wrong). It owns the tree state, so it
lives on the driver's node. A lost or stuck scheduler is replaced by the supervisor, and its prompts grown again on
the new one: the prompts' seeds make the new trees the ones the lost scheduler was growing.
"""

from __future__ import annotations

import asyncio

import ray

from treepo_ray.data.prompts import Prompt
from treepo_ray.engines.base import SamplingParams
from treepo_ray.engines.decode import safe_decode
from treepo_ray.engines.driver import TreeTracker
from treepo_ray.runtime.healer import verified_phases
from treepo_ray.runtime.liveness import within
from treepo_ray.runtime.router import EngineRouter
from treepo_ray.runtime.verifier import VerifierPool, leave_out_unverified
from treepo_ray.tree import SequentialGrower, Tree, TreePOGrower, TreeRPOGrower, scheduled

GROWERS = {"sequential": SequentialGrower, "treepo": TreePOGrower, "treerpo": TreeRPOGrower}


@ray.remote
class TreeScheduler:
    """Grows and scores the trees of the prompts it is given (one grower per prompt, all concurrently)."""

    def __init__(self, router: EngineRouter, verifiers: VerifierPool, model_path: str, cfg, healer):
        """`cfg`: the job's config (its algorithm, sampler and sampling settings; runtime.deadlines.grow_s bounds
        each verification and healing call); `healer`: the HealerActor of a run that heals, else None."""
        from transformers import AutoTokenizer

        self.router, self.verifiers, self.healer = router, verifiers, healer
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.algo = cfg.algo
        self.grower_cls, self.sampler_cfg = GROWERS[cfg.algo.spec.sampler], cfg.sampler_config
        r = cfg.rollout
        self.tracker = TreeTracker(SamplingParams(r.temperature, r.top_p, r.top_k, entropy=r.entropy))  # asks <-> requests
        self.wait_s = cfg.runtime.deadlines.grow_s

    def set_healer(self, healer) -> None:
        """The replacement of a lost healer (supervisor.py)."""
        self.healer = healer

    def decode(self, ids: list[int]) -> str:
        return safe_decode(self.tokenizer, ids, skip_special_tokens=True)  # a bad model output must not raise

    async def grow(self, prompts: list[Prompt], progress: float) -> list[Tree]:
        """Trees of `prompts` (ids unique over the run) with their rewards set, grown concurrently: a tree branches
        as soon as its own paths are back. `progress` (0 at the first training step, 1 at the last) sets scheduled
        sampler settings (tree/treepo.py `scheduled`)."""
        cfg = scheduled(self.sampler_cfg, progress)
        tasks = [asyncio.ensure_future(self._grow_one(p, cfg)) for p in prompts]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            # One failed tree fails the shard, which the supervisor may grow again from its start on this scheduler:
            # its other trees stop first, so none runs on beside its regrown copy (same query id, seeds and
            # route) or heals on a replacement healer meanwhile.
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _grow_one(self, prompt: Prompt, cfg) -> Tree:
        qid = prompt.id
        tree = Tree(prompt_ids=list(prompt.prompt_ids), query_id=qid)
        grower = self.grower_cls(tree, cfg, eos_token_id=self.tokenizer.eos_token_id,
                                 decode=self.decode, seed=prompt.seed)
        pending: set[asyncio.Future] = set()
        grown = False
        try:
            while True:
                requests = self.tracker.to_requests(grower)
                if requests:  # every ask the tree has ready goes out now, in one call
                    pending.add(asyncio.ensure_future(self.router.generate(qid, requests)))
                if not pending:
                    break
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    for result in fut.result():
                        self.tracker.deliver(result)
            grown = True
        finally:
            for fut in pending:  # a tree given up midway (a failed call, its shard failed): caches and route freed
                fut.cancel()
            self.router.finish(qid, self.tracker.release(grower, abandon=not grown))
        if not grower.done():
            raise RuntimeError(f"the grower of {qid!r} stopped asking before its tree was done")
        # Node ids followed the order the engine returned segments in, which depends on what else it ran; the same
        # seed must give the learner the same tree (its packing, and the float sums over it, follow node order).
        tree.renumber(grower.depth_first_order())
        solutions = [self.decode(tree.response_ids(n)) for n in tree.trajectories]
        items = [(prompt.data_source, s, prompt.ground_truth, prompt.extra_info) for s in solutions]
        rewards = await within(self.verifiers.score(items), self.wait_s, f"verifying {qid}") if items else []
        tree = leave_out_unverified(tree, rewards)
        tree.meta.update(ground_truth=prompt.ground_truth, data_source=prompt.data_source,
                         extra_info=prompt.extra_info)
        return await verified_phases(tree, self.algo, self.healer, prompt.seed, self.wait_s)
