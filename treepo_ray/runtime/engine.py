"""The engine actor: one generation engine (engines/: the `Engine` protocol) behind Ray, batching continuously
across every caller.

Callers reach it through an engine router (router.py), which sends a tree's requests to one engine (its prefix cache
lives there); the generator pool (pool.py) starts engines and brings them their weights, the supervisor
(supervisor.py) replaces those that are lost or stuck.

A vLLM engine with tensor_parallel_size > 1 runs in a placement group of one bundle per GPU on one node
(`engine_placement`): the actor takes bundle 0's CPUs and no GPU, and captures its child tasks, so vLLM's Ray
executor (which uses the placement group its caller runs in) starts one GPU worker per bundle.
"""

from __future__ import annotations

import asyncio
import os

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from treepo_ray.engines.base import SegmentRequest, SegmentResult


def tensor_parallel_size(engine: str, engine_kwargs: dict) -> int:
    """GPUs one engine spans (vLLM's tensor_parallel_size; 1 for every other engine)."""
    return int(engine_kwargs.get("tensor_parallel_size", 1) or 1) if engine == "vllm" else 1


def engine_placement(tp: int, num_cpus: float, resources: dict):
    """The placement group of a tensor-parallel engine: `tp` bundles of one GPU each, all on one node, the engine's
    custom resources split evenly over them, bundle 0 also holding the engine actor's CPUs (vLLM's Ray executor
    accepts at most one GPU per bundle and puts worker i in bundle i)."""
    bundles = [{"GPU": 1.0, **{k: float(v) / tp for k, v in resources.items()}} for _ in range(tp)]
    if num_cpus:
        bundles[0]["CPU"] = float(num_cpus)
    return placement_group(bundles, strategy="STRICT_PACK")


def release_placement(group) -> None:
    """Remove a placement group (None: nothing to do); quietly when it is gone already or Ray is shutting down."""
    if group is not None and ray.is_initialized():
        try:
            remove_placement_group(group)
        except Exception:  # noqa: BLE001
            pass


def limit_threads(n: int) -> None:
    """Pin torch (and the BLAS pools) of this process to `n` threads, so an actor uses the CPUs it reserved;
    and keep model loading quiet (one progress bar per actor would bury the job's own output)."""
    import torch
    from transformers.utils import logging as hf_logging

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    torch.set_num_threads(n)
    hf_logging.disable_progress_bar()


@ray.remote
class EngineActor:
    """One engine. `generate` may be called concurrently: every caller's requests join the running batch."""

    def __init__(self, engine: str, model_path: str, engine_kwargs: dict, torch_threads: int):
        limit_threads(torch_threads)
        import torch

        from treepo_ray.engines import make_engine
        from treepo_ray.learner.strategy import require_usable_cuda

        require_usable_cuda(f"engine {engine}")  # a GPU given by Ray must be used, never a silent CPU fallback
        if engine == "hf" and "device" not in engine_kwargs and torch.cuda.is_available():
            engine_kwargs = {**engine_kwargs, "device": "cuda"}  # an actor given a GPU (Ray set its visibility) uses it
        self.engine = make_engine(engine, model_path, **engine_kwargs)
        self._waiting: dict[str, asyncio.Future] = {}
        self._stepper: asyncio.Task | None = None

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

    async def load_weights(self, state_dict, version: int) -> int:
        """Load `state_dict` (name -> tensor), or a payload of weights.py that loads itself into the engine (an
        object-store copy, or this engine's part of a broadcast)."""
        # The swap happens between two decode steps. An engine that can swap under running sequences (hf) does so
        # at once, so the next batch grows while the last one finishes (loop.py); any other first lets the
        # running sequences finish on the weights they started with.
        while not self.engine.loads_weights_while_running and self._stepper is not None and not self._stepper.done():
            await asyncio.wait([self._stepper])
        if isinstance(state_dict, dict):
            self.engine.load_weights(state_dict, version)
        else:
            await state_dict.load_into(self.engine, version)
        return version

    async def describe(self) -> dict:
        """What the runtime plans with: `weights_dtype` (what the learner exports for the engines) and
        `loads_weights_while_running` (the next batch may start before the last one is done: loop.py)."""
        return {"weights_dtype": self.engine.weights_dtype,
                "loads_weights_while_running": self.engine.loads_weights_while_running}

    async def release(self, keys: list[str]) -> None:
        self.engine.release(keys)

    async def score(self, prefix_ids: list[int], token_ids: list[int], temperature: float) -> list[float]:
        """Log-probs of `token_ids` after `prefix_ids` under the current weights at `temperature`, one
        teacher-forced forward run between two decode steps (CATPO: the grafted branches' log-probs, given the
        tree's own prefix, at the tree's sampling temperature)."""
        return self.engine.score(prefix_ids, token_ids, temperature)

    async def stats(self) -> dict:
        """The engine's counters, `weights_version` (the weights it runs) among them."""
        return self.engine.stats()
