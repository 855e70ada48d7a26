"""The Ray actors of the pipeline: thin shells over the plain classes of the layers below.

    EngineActor     one generation engine, batching continuously across every caller
    GeneratorPool   N engine actors; a tree's requests stay on one engine (its prefix cache), new trees go to
                    the least-loaded engine
    TreeScheduler   owns the growers of a shard of prompts; sends every ready ask to the pool, scores finished trees
    VerifierPool    CPU actors running the rewards layer's scorer with timeouts
    LearnerGroup    Learner ranks as actors (torch.distributed inside: gloo on CPU, nccl on GPU)

Only token ids, small metadata and ObjectRefs travel between them; weights go through the object store once.
"""

from __future__ import annotations

import asyncio
import os
import socket

import ray

from treepo_ray.engines.base import SamplingParams, SegmentRequest, SegmentResult
from treepo_ray.engines.driver import TreeTracker
from treepo_ray.runtime.healing import score_and_heal
from treepo_ray.tree import SequentialGrower, Tree, TreePOGrower, TreeRPOGrower

GROWERS = {"sequential": SequentialGrower, "treepo": TreePOGrower, "treerpo": TreeRPOGrower}


def limit_threads(n: int) -> None:
    """Pin torch (and the BLAS pools) of this process to `n` threads, so an actor uses the CPUs it reserved;
    and keep model loading quiet (one progress bar per actor would bury the job's own output)."""
    import torch
    from transformers.utils import logging as hf_logging

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    torch.set_num_threads(n)
    hf_logging.disable_progress_bar()


# ---------------------------------------------------------------------------------------------- generation


@ray.remote
class EngineActor:
    """One engine. `generate` may be called concurrently: every caller's requests join the running batch."""

    def __init__(self, engine: str, model_path: str, engine_kwargs: dict, torch_threads: int = 1):
        limit_threads(torch_threads)
        import torch

        from treepo_ray.engines import make_engine

        if engine == "hf" and "device" not in engine_kwargs and torch.cuda.is_available():
            engine_kwargs = {**engine_kwargs, "device": "cuda"}  # an actor given a GPU (Ray set its visibility) uses it
        self.engine = make_engine(engine, model_path, **engine_kwargs)
        self._waiting: dict[str, asyncio.Future] = {}
        self._stepper: asyncio.Task | None = None
        self.version = 0

    async def generate(self, requests: list[SegmentRequest]) -> list[SegmentResult]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in requests]
        for req, fut in zip(requests, futures):
            self._waiting[req.request_id] = fut
        self.engine.add_requests(requests)
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.create_task(self._run())
        return list(await asyncio.gather(*futures))

    async def _run(self) -> None:
        # Continuous batching: one decode step at a time, yielding to the event loop in between so that requests
        # of other callers (and weight updates) slip in between two steps, never inside one.
        try:
            while self.engine.has_unfinished():
                for result in self.engine.step():
                    self._waiting.pop(result.request_id).set_result(result)
                await asyncio.sleep(0)
        except Exception as err:  # a failed step fails its callers loudly instead of leaving them waiting
            for fut in self._waiting.values():
                if not fut.done():
                    fut.set_exception(err)
            self._waiting.clear()
            raise

    async def load_weights(self, state_dict: dict, version: int) -> int:
        # Sequences already running finish on the weights they started with (the pipeline only swaps weights
        # between batches, so this rarely waits); the swap itself happens between two decode steps.
        while self._stepper is not None and not self._stepper.done():
            await asyncio.wait([self._stepper])
        self.engine.load_weights(state_dict, version)
        self.version = version
        return version

    async def release(self, keys: list[str]) -> None:
        self.engine.release(keys)

    async def score(self, prefix_ids: list[int], token_ids: list[int]) -> list[float]:
        """Log-probs of `token_ids` after `prefix_ids` under the current weights, one teacher-forced forward run
        between two decode steps (CATPO: the grafted branches' log-probs, given the tree's own prefix)."""
        from treepo_ray.healing.logprobs import engine_logprobs

        return engine_logprobs(self.engine, prefix_ids, token_ids)

    async def stats(self) -> dict:
        return {**self.engine.stats(), "version": self.version}


class GeneratorPool:
    """Routes segment requests to engine actors. Picklable: each scheduler holds its own copy of the routing table.

    A tree's requests all go to the engine its first request went to (sticky: its prefix cache lives there);
    a new tree goes to the engine with the fewest live trees of this pool copy.
    """

    def __init__(self, engines: list):
        if not engines:
            raise ValueError("GeneratorPool needs at least one engine actor")
        self.engines = list(engines)
        self._home: dict[str, int] = {}
        self._live = [0] * len(engines)

    def engine_of(self, query_id: str) -> int:
        if query_id not in self._home:
            home = min(range(len(self.engines)), key=self._live.__getitem__)
            self._home[query_id] = home
            self._live[home] += 1
        return self._home[query_id]

    def generate(self, query_id: str, requests: list[SegmentRequest]):
        """ObjectRef of the results of `requests`, all of one tree."""
        return self.engines[self.engine_of(query_id)].generate.remote(requests)

    def finish(self, query_id: str, cache_keys: list[str]) -> None:
        """The tree is complete: free its caches on its engine and forget its route."""
        home = self._home.pop(query_id, None)
        if home is not None:
            self._live[home] -= 1
            if cache_keys:
                self.engines[home].release.remote(cache_keys)

    def load_weights(self, state_ref, version: int) -> None:
        """Send one object-store copy of the weights (an ObjectRef, resolved by each actor) to every engine."""
        ray.get([e.load_weights.remote(state_ref, version) for e in self.engines])

    def stats(self) -> list[dict]:
        return ray.get([e.stats.remote() for e in self.engines])


# ---------------------------------------------------------------------------------------------- verification


@ray.remote
class VerifierActor:
    """Scores (data_source, solution, ground_truth) triples with the rewards layer; never executes model output."""

    def __init__(self, timeout_s: float):
        from treepo_ray.rewards import BatchScorer

        self.scorer = BatchScorer(timeout_s=timeout_s)  # routes each item by its data_source

    def score(self, items: list[tuple[str, str, str]]) -> list[float]:
        return self.scorer.score_batch(items)


class VerifierPool:
    """Spreads scoring over the verifier actors, round robin by call."""

    def __init__(self, verifiers: list):
        if not verifiers:
            raise ValueError("VerifierPool needs at least one verifier actor")
        self.verifiers = list(verifiers)
        self._next = 0

    def score(self, items: list[tuple[str, str, str]]):
        """ObjectRef of one reward per item."""
        actor = self.verifiers[self._next % len(self.verifiers)]
        self._next += 1
        return actor.score.remote(items)


# ---------------------------------------------------------------------------------------------- tree growth


@ray.remote
class TreeScheduler:
    """Grows and scores the trees of the prompts it is given (one grower per prompt, all concurrently)."""

    def __init__(self, pool: GeneratorPool, verifiers: VerifierPool, model_path: str, sampler: str,
                 sampler_cfg, sampling: SamplingParams, catpo=None, healer=None):
        from transformers import AutoTokenizer

        if sampler not in GROWERS:
            raise ValueError(f"sampler {sampler!r} is not one of {sorted(GROWERS)}")
        self.pool, self.verifiers = pool, verifiers
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.grower_cls, self.sampler_cfg = GROWERS[sampler], sampler_cfg
        self.tracker = TreeTracker(sampling)  # asks <-> engine requests, with each node's engine cache key
        self.catpo, self.healer = catpo, healer  # CatpoConfig and HealerActor of a CATPO run, else None

    def decode(self, ids: list[int]) -> str:
        from treepo_ray.runtime.faults import safe_decode  # here: faults imports this module

        return safe_decode(self.tokenizer, ids, skip_special_tokens=True)  # a bad model output must not raise

    async def grow(self, prompts: list[dict]) -> list[Tree]:
        """Trees of `prompts` ({id, prompt_ids, ground_truth, data_source, seed}; ids unique over the run) with
        their rewards set, grown concurrently: a tree branches as soon as its own paths are back."""
        return list(await asyncio.gather(*(self._grow_one(p) for p in prompts)))

    async def _grow_one(self, prompt: dict) -> Tree:
        qid = str(prompt["id"])
        tree = Tree(prompt_ids=list(prompt["prompt_ids"]), query_id=qid)
        grower = self.grower_cls(tree, self.sampler_cfg, eos_token_id=self.tokenizer.eos_token_id,
                                 decode=self.decode, seed=int(prompt["seed"]))
        pending: set[asyncio.Future] = set()
        try:
            while True:
                requests = self.tracker.to_requests(grower)
                if requests:  # every ask the tree has ready goes out now, in one call
                    pending.add(asyncio.ensure_future(self.pool.generate(qid, requests)))
                if not pending:
                    break
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    for result in fut.result():
                        self.tracker.deliver(result)
        finally:
            for fut in pending:
                fut.cancel()
            if not pending:
                self.pool.finish(qid, self.tracker.release(grower))
        if not grower.done():
            raise RuntimeError(f"the grower of {qid!r} stopped asking before its tree was done")
        solutions = [self.decode(tree.response_ids(n)) for n in tree.trajectories]
        triples = [(prompt.get("data_source", ""), s, prompt["ground_truth"]) for s in solutions]
        tree.set_trajectory_rewards(await self.verifiers.score(triples) if triples else [])
        tree.meta.update(ground_truth=prompt["ground_truth"], data_source=prompt.get("data_source", ""))
        if self.catpo is not None:  # CATPO phases 2-3: score the tree, heal it if dead-wrong (runtime/healing.py)
            tree = await score_and_heal(tree, self.catpo, self.healer, int(prompt["seed"]))
        return tree


# ---------------------------------------------------------------------------------------------- learning


@ray.remote
class LearnerActor:
    """One rank of the learner."""

    def __init__(self, rank: int, world_size: int, torch_threads: int = 1):
        limit_threads(torch_threads)
        self.rank, self.world_size = rank, world_size
        self.learner = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0 picks the address and a free port of the process group."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, model_path: str, cfg, master_addr: str, master_port: int) -> int:
        from treepo_ray.learner import Learner

        self.learner = Learner(model_path, cfg, self.rank, self.world_size, master_addr, master_port)
        return self.learner.version

    def train_step(self, samples: list) -> dict:
        # Each rank trains on its own interleaved shard; the Learner all-reduces gradients and metrics.
        return self.learner.train_step(samples[self.rank::self.world_size])

    def export_weights(self) -> dict:
        return self.learner.export_weights()

    def save_checkpoint(self, directory: str, trainer_state: dict) -> str:
        return str(self.learner.save_checkpoint(directory, trainer_state))

    def load_checkpoint(self, directory: str) -> dict:
        return self.learner.load_checkpoint(directory)

    def version(self) -> int:
        return self.learner.version


class LearnerGroup:
    """`world_size` learner ranks acting as one learner; every call goes to all ranks, rank 0's answer returned."""

    def __init__(self, model_path: str, cfg, world_size: int = 1, num_cpus: float = 1, num_gpus: float = 0,
                 resources: dict | None = None, torch_threads: int = 1):
        opts = dict(num_cpus=num_cpus, num_gpus=num_gpus, resources=resources or None)
        self.ranks = [LearnerActor.options(**opts).remote(r, world_size, torch_threads) for r in range(world_size)]
        addr, port = ray.get(self.ranks[0].rendezvous.remote())
        ray.get([r.setup.remote(model_path, cfg, addr, port) for r in self.ranks])

    def train_step(self, samples_ref) -> dict:
        """Start one step on every rank (`samples_ref`: an ObjectRef of the whole batch); returns rank 0's ref."""
        return [r.train_step.remote(samples_ref) for r in self.ranks][0]

    def export_weights(self):
        """ObjectRef of the full weights (rank 0 gathers them; every rank must take part)."""
        return [r.export_weights.remote() for r in self.ranks][0]

    def save_checkpoint(self, directory: str, trainer_state: dict) -> str:
        return ray.get([r.save_checkpoint.remote(directory, trainer_state) for r in self.ranks])[0]

    def load_checkpoint(self, directory: str) -> dict:
        return ray.get([r.load_checkpoint.remote(directory) for r in self.ranks])[0]
