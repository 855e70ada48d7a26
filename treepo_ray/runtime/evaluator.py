"""The evaluator: held-out accuracy of the weights the engines hold now, the run's one way to evaluate (before and
after training, every trainer.eval_every steps, and `treepo-ray compare`'s kept weights).

Each problem's answers are one request of trainer.eval_samples children (one at temperature 0), at most
trainer.eval_max_new_tokens long (0: the sampler's response limit), seeded from trainer.seed and the problem's index
(data/sampling.py: request_seed): two evaluations of the same weights agree, two of different weights differ only by
the weights. The requests go through an engine router (router.py: a shard per live engine, re-sent if its engine
fails), the answers through the verifiers; a failed verification is left out, not scored as wrong.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from treepo_ray.data.prompts import Prompt
from treepo_ray.data.sampling import request_seed
from treepo_ray.engines.base import SamplingParams, SegmentRequest
from treepo_ray.engines.decode import safe_decode
from treepo_ray.runtime.liveness import get
from treepo_ray.runtime.verifier import verified


def validation_metrics(sources: list[str], rewards: np.ndarray, correct_threshold: float, k: int) -> dict:
    """verl's validation figures per data source, for `k` samples per problem: val-core/<source>/acc/mean@k (the
    mean correctness of all samples, reward >= correct_threshold) and val-aux/<source>/reward/mean@k."""
    out = {}
    for source in sorted(set(sources)):
        r = rewards[[s == source for s in sources]]
        out[f"val-core/{source}/acc/mean@{k}"] = float((r >= correct_threshold).mean())
        out[f"val-aux/{source}/reward/mean@{k}"] = float(r.mean())
    return out


def accuracy_se(problem: list[int], correct: np.ndarray) -> float:
    """Standard error of the accuracy over problems: the answers of one problem are one draw (their mean), so
    several samples per problem narrow it only as far as the problems allow (0 for fewer than 2 problems)."""
    per_problem = [correct[np.asarray(problem) == i].mean() for i in sorted(set(problem))]
    return float(np.std(per_problem, ddof=1) / np.sqrt(len(per_problem))) if len(per_problem) > 1 else 0.0


class Evaluator:
    """Evaluates `problems` on a supervisor's engines and verifiers (module docstring)."""

    def __init__(self, cfg, supervisor, tokenizer, problems: list[Prompt]):
        tr = cfg.trainer
        self.cfg, self.supervisor, self.tokenizer, self.problems = cfg, supervisor, tokenizer, problems
        self.max_new_tokens = tr.eval_max_new_tokens or cfg.sampler_config.response_limit()
        self.samples = 1 if tr.eval_temperature == 0 else tr.eval_samples
        self.method = (f"pass@1, mean of {tr.eval_samples} samples per problem at temperature {tr.eval_temperature}"
                       if tr.eval_temperature > 0 else "greedy decoding, one answer per problem")
        """How accuracy is measured, in words (the summary's eval_method)."""

    def evaluate(self) -> dict:
        """eval/* and val-core/* figures of the weights the engines hold now ({} without problems)."""
        if not self.problems:
            return {}
        t0 = time.perf_counter()
        cfg, sup = self.cfg, self.supervisor
        version = sup.pool.weights_version
        params = lambda i: SamplingParams(temperature=cfg.trainer.eval_temperature,  # noqa: E731
                                          seed=request_seed(cfg.trainer.seed, i))
        reqs = [SegmentRequest(f"eval-v{version}/{i}", list(p.prompt_ids), self.max_new_tokens, self.samples,
                               params(i)) for i, p in enumerate(self.problems)]
        results = asyncio.run(self._generate(reqs))
        answers = [(i, p, c) for i, (p, res) in enumerate(zip(self.problems, results)) for c in res.children]
        items = [(p.data_source, safe_decode(self.tokenizer, c.token_ids, skip_special_tokens=True), p.ground_truth,
                  p.extra_info) for _, p, c in answers]
        scored = get(sup.verifiers.score(items), cfg.runtime.deadlines.grow_s, "verifying the evaluation")
        scored_ok = [(i, p.data_source, r) for (i, p, _), r in zip(answers, scored) if verified(r)]
        sources = [src for _, src, _ in scored_ok]  # an answer without a reward is left out, not scored as wrong
        rewards = np.array([r for *_, r in scored_ok], dtype=np.float64)
        threshold = cfg.algo.correct_threshold
        return {"eval/accuracy": float((rewards >= threshold).mean()) if rewards.size else 0.0,
                "eval/accuracy_se": accuracy_se([i for i, *_ in scored_ok], rewards >= threshold),
                "eval/reward": float(rewards.mean()) if rewards.size else 0.0,
                "eval/response_len": float(np.mean([len(c.token_ids) for *_, c in answers])),
                "eval/verify_failed": float(len(scored) - rewards.size),
                "eval/problems": float(len(self.problems)), "eval/version": float(version),
                **validation_metrics(sources, rewards, threshold, self.samples),
                "timing_s/testing": time.perf_counter() - t0}

    async def _generate(self, requests: list[SegmentRequest]) -> list:
        """The requests through the router in one shard per engine (each shard a route of its own, so the shards
        spread over the engines, and each engine admits its shard at once); the engines' caches of the answers are
        freed as they come back."""
        router, shards = self.supervisor.router, max(1, self.supervisor.pool.size)

        async def shard(k: int) -> list:
            route = f"{requests[k].request_id}+"
            results = await router.generate(route, requests[k::shards])
            router.finish(route, [c.cache_key for r in results for c in r.children if c.cache_key])
            return results

        done = await asyncio.gather(*(shard(k) for k in range(min(shards, len(requests)))))
        by_id = {r.request_id: r for results in done for r in results}
        return [by_id[r.request_id] for r in requests]
