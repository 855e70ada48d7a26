"""The batch builder: one training step's batch, from prompts to the learner's trees.

    grow      the prompts' trees, grown, verified and scored by the schedulers (the supervisor's `grow`, which also
              replaces a lost scheduler or healer and grows its shard again)
    refill    DAPO's dynamic sampling: prompts whose trajectories all scored alike are dropped and new ones grown, in
              at most algo.max_extra_rounds more rounds; an over-full batch keeps a seeded random subset
    credit    the algorithm's (algo/<name>.py): tree weights, then each tree's credit; learner/batch.py's
              `train_trees` makes the learner's TrainTrees, which carry the engines' sampled log-probs
    metrics   the batch's trees, advantages, verification, the algorithm's own phases, the forward tokens its
              trees cost the engines (counted per request, so per tree), and the engines' busy time since the
              previous batch was done

A batch travels as a RolloutBatch: metadata plus an ObjectRef of its TrainTrees (the loop's queue never carries
tensors or trees by value), and the trees it was made from, which a checkpoint keeps while it waits in the queue.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import ray

from treepo_ray.algo.credit import advantage_metrics, keep_tree, tree_metrics
from treepo_ray.data.prompts import PromptStream
from treepo_ray.engines.decode import safe_decode
from treepo_ray.learner.batch import train_trees
from treepo_ray.runtime.verifier import verification_metrics
from treepo_ray.tree import Tree, branch_metrics


@dataclass
class RolloutBatch:
    """One step's training batch as it waits in the queue: metadata plus an ObjectRef of the samples."""

    step: int
    """Training step (0-based) this batch is for."""
    version: int
    """Policy version (training steps done) the engines ran when it started growing: the oldest that wrote any of
    its tokens."""
    samples: object
    """ObjectRef of the batch's list[TrainTree] in the object store."""
    num_samples: int
    """Trajectories in the batch (0: every prompt was filtered out; the step trains on nothing)."""
    data_position: int
    """Prompts of the training stream consumed once this batch is trained on (saved in checkpoints)."""
    metrics: dict = field(default_factory=dict)
    trees: list[dict] = field(default_factory=list)
    """A few of the batch's trees with decoded texts, for trees.jsonl and samples.jsonl (dropped ones too when too few
    were kept: BatchBuilder.logged_trees)."""
    kept: list[Tree] = field(default_factory=list)
    """The trees the samples were made from (saved with a checkpoint while the batch waits in the queue)."""
    grown: tuple[float, float] = (0.0, 0.0)
    """When its growth started and ended (time.perf_counter; batches may grow at the same time)."""

    def to_record(self) -> dict:
        """What a checkpoint keeps of a batch waiting in the queue (JSON): enough to train it after a restart."""
        return {"step": self.step, "version": self.version, "data_position": self.data_position,
                "metrics": self.metrics, "trees": self.trees, "kept": [t.to_dict() for t in self.kept]}

    def fetch(self) -> list:
        """The batch's TrainTrees, from the object store."""
        return ray.get(self.samples)


def forward_metrics(grown: list[Tree]) -> dict:
    """tree/forward_tokens and tree/forward_per_unique of a batch's grown trees (every round's, dropped ones too).

    tree/forward_tokens: summed over the batch's trees, the positions the engines ran through the model for that
    tree's own segment requests: each request's prefix less what it took from a cache, then every child's sampled
    tokens but its last (SegmentResult.forward_tokens). A tree's prompt counts in full once, even when its first
    request found it cached (by another tree, or an earlier step): a cache filled outside the tree does not make
    the figure smaller. A continuation from the tree's own cached node counts only the parent's last token; anything
    the engine recomputed (an evicted node, a prompt fed again) counts as often as it ran. Other batches growing at
    the same time and evaluations do not count here; neither does CATPO's healing (its critique and regenerated
    branch are run outside the tree's requests, yet the grafted nodes count in tree/unique_tokens). Trajectories left
    out after a failed verification still count: they were run, though they leave tree/unique_tokens.
    tree/forward_per_unique: that over tree/unique_tokens (the prompt once plus every segment once): 1.0 minus
    about one token per leaf for a perfect tree cache; more means recomputation.
    Both NaN where an engine does not count per request."""
    counts = [t.meta.get("forward_tokens") for t in grown]  # engines/driver.py count_forward
    if not grown or any(c is None for c in counts):
        return {"tree/forward_tokens": math.nan, "tree/forward_per_unique": math.nan}
    fwd = sum(counts)
    unique = sum(t.unique_tokens() for t in grown)
    return {"tree/forward_tokens": float(fwd), "tree/forward_per_unique": fwd / unique if unique else math.nan}


class BatchBuilder:
    """Makes the batches of one run (module docstring); batches may be made in several threads at once."""

    def __init__(self, cfg, supervisor, tokenizer):
        self.cfg, self.supervisor, self.tokenizer = cfg, supervisor, tokenizer
        self._lock = threading.Lock()
        self._last_batch: tuple[dict, float] = ({}, time.perf_counter())  # engine counters when a batch was done

    def make(self, step: int, stream: PromptStream, progress: float, trees_logged: int,
             prompts_taken: threading.Event) -> RolloutBatch:
        """Grow, score and credit step `step`'s batch. Its prompts are one run of `stream`; `prompts_taken` is set
        once the last of them is taken (the next batch may then take its own). `progress` (0 to 1) is where training
        is on scheduled sampler settings. The batch's version is the pool's when it starts: every token in it was
        sampled by those weights or newer ones (engines may take newer weights while it grows)."""
        cfg, algo = self.cfg, self.cfg.algo
        need = cfg.trainer.prompts_per_step
        t0 = time.perf_counter()
        version = self.supervisor.pool.weights_version
        grown: list[Tree] = []
        kept: list[Tree] = []
        rounds = 1 + (algo.max_extra_rounds if algo.filters_groups else 0)
        try:
            for rnd in range(rounds):
                missing = need - len(kept)
                n = math.ceil(missing * algo.oversample) if algo.filters_groups else missing
                prompts, position = stream.take(n), stream.position
                if rnd == rounds - 1:
                    prompts_taken.set()
                trees = self.supervisor.grow(prompts, progress)
                grown += trees
                trees = [t for t in trees if t.trajectories]  # none left when every verification of a tree failed
                kept += [t for t in trees if keep_tree(t)] if algo.filters_groups else trees
                if len(kept) >= need:
                    break
        finally:
            prompts_taken.set()
        if len(kept) > need:  # DAPO keeps a random subset of the over-sampled groups
            pick = np.random.default_rng([cfg.trainer.seed, step]).choice(len(kept), need, replace=False)
            kept = [kept[i] for i in sorted(pick)]
        t_grow = time.perf_counter()
        samples, credit, weights = self.credit(kept)
        t_credit = time.perf_counter()
        metrics = self._metrics(grown, kept, credit, weights)
        metrics.update({"rollout/kept_prompts": float(len(kept)), "rollout/progress": progress,
                        "rollout/rounds": float(rnd + 1), "timing_s/gen": t_grow - t0,
                        "timing_s/adv": t_credit - t_grow,
                        # over this batch's own generation time: the time since the previous batch was done is near
                        # zero when batches overlap, which read as 17,500 trajectories/s
                        "perf/traj_per_s": sum(len(t.trajectories) for t in grown) / max(t_grow - t0, 1e-9)})
        return RolloutBatch(step, version, ray.put(samples), sum(len(t.trajectories) for t in samples), position,
                            metrics, self.logged_trees(grown, kept, trees_logged), kept, (t0, t_grow))

    def logged_trees(self, grown: list[Tree], kept: list[Tree], n: int) -> list[dict]:
        """The first `n` trees of the batch for trees.jsonl (`tree_record`), the trained ones first, then those dropped
        (dynamic sampling: all rewards equal; every verification failed), so that a step that trains on nothing
        still shows what the model wrote. Each says whether it was trained."""
        trained = {id(t) for t in kept}
        dropped = [t for t in grown if id(t) not in trained]
        return ([{**self.tree_record(t), "trained": True} for t in kept[:n]]
                + [{**self.tree_record(t), "trained": False} for t in dropped[:max(0, n - len(kept))]])

    def credit(self, kept: list[Tree]) -> tuple[list, list, list[float] | None]:
        """The learner's trees of the kept trees (learner/batch.py: TrainTree), their credit and the per-tree
        weights they were scaled by (the algorithm's, or None)."""
        algo = self.cfg.algo
        weights = algo.spec.tree_weights(kept, algo)
        credit = algo.spec.credit(kept, algo)
        return train_trees(kept, credit, weights), credit, weights

    def from_record(self, record: dict) -> RolloutBatch:
        """A batch saved with a checkpoint while it waited in the queue (RolloutBatch.to_record), ready to train."""
        kept = [Tree.from_dict(t) for t in record["kept"]]
        samples, _, _ = self.credit(kept)
        return RolloutBatch(record["step"], record["version"], ray.put(samples), sum(len(t.trajectories) for t in samples),
                            record["data_position"], dict(record["metrics"]), list(record["trees"]), kept)

    def _metrics(self, grown: list[Tree], kept: list[Tree], credit: list, weights: list[float] | None) -> dict:
        cfg, algo = self.cfg, self.cfg.algo
        metrics = tree_metrics(grown, algo.correct_threshold, cfg.sampler_config.response_limit())
        metrics.update(advantage_metrics(kept, [c.trajectories for c in credit], weights))
        metrics.update(verification_metrics(grown, cfg.runtime.faults.max_verify_failed_share))
        metrics.update(algo.spec.metrics(grown, weights))
        metrics.update(forward_metrics(grown))
        metrics.update(branch_metrics(grown))
        # Engine time since the previous batch was done (the scaling policy's busy figure): batches may grow at the
        # same time, so this cannot be told apart by batch; summed over a run, it is the run's total.
        since, _ = self.engine_figures()
        steps = max(sum(c.get("steps", 0) for c in since.values()), 1)
        metrics.update({
            "perf/engine_busy_s": float(sum(v for c in since.values() for k, v in c.items() if k.startswith("time_"))),
            "perf/engine_rows": sum(c.get("step_sequences", 0) for c in since.values()) / steps,
        })
        return metrics

    def engine_figures(self) -> tuple[dict, float]:
        """The engines' counters (per engine id) and the seconds since the last call (the previous batch was done,
        or the clock was restarted): an engine that joins counts from zero, one that dies is left out. Work the
        engines did for something else (an evaluation) is left out by calling this once it is done."""
        now = {s["engine_id"]: {k: v for k, v in s.items() if isinstance(v, (int, float))}
               for s in self.supervisor.pool.stats()}
        t1 = time.perf_counter()
        with self._lock:
            (before, t0), self._last_batch = self._last_batch, (now, t1)
        return {e: {k: v - before.get(e, {}).get(k, 0) for k, v in c.items()} for e, c in now.items()}, t1 - t0

    def tree_record(self, tree: Tree) -> dict:
        """A tree as a JSON-able dict with the decoded text of its prompt and of every segment."""
        dec = lambda ids: safe_decode(self.tokenizer, ids, skip_special_tokens=False)  # noqa: E731
        return {**tree.to_dict(), "prompt_text": dec(tree.prompt_ids), "texts": [dec(t) for t in tree.tokens]}
