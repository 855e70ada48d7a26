"""The engine actor: one generation engine (engines/) behind Ray, batching continuously across every caller.

Schedulers reach it through the generator pool (pool.py), which routes a tree's requests to one engine (its prefix
cache lives there) and replaces engines that are lost.
"""

from __future__ import annotations

import asyncio
import os

import ray

from treepo_ray.engines.base import SegmentRequest, SegmentResult


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

    def __init__(self, engine: str, model_path: str, engine_kwargs: dict, torch_threads: int = 1):
        limit_threads(torch_threads)
        import torch

        from treepo_ray.engines import make_engine

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

    async def load_weights(self, state_dict: dict, version: int) -> int:
        # Sequences already running finish on the weights they started with (the pipeline only swaps weights
        # between batches, so this rarely waits); the swap itself happens between two decode steps.
        while self._stepper is not None and not self._stepper.done():
            await asyncio.wait([self._stepper])
        self.engine.load_weights(state_dict, version)
        return version

    async def release(self, keys: list[str]) -> None:
        self.engine.release(keys)

    async def score(self, prefix_ids: list[int], token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """Log-probs of `token_ids` after `prefix_ids` under the current weights at `temperature`, one
        teacher-forced forward run between two decode steps (CATPO: the grafted branches' log-probs, given the
        tree's own prefix, at the tree's sampling temperature)."""
        from treepo_ray.healing.logprobs import engine_logprobs

        return engine_logprobs(self.engine, prefix_ids, token_ids, temperature)

    async def stats(self) -> dict:
        """The engine's counters, `weights_version` (the weights it runs) among them."""
        return self.engine.stats()
