"""The asynchronous training loop: the actors of one run and the two driver threads that keep them busy.

    producer:  take a slot -> bring the generators up to date -> grow + score trees -> credit -> queue.put(batch)
    consumer:  queue.get() -> learner step -> publish weights -> return the slot -> log, checkpoint

With max_staleness = s the producer may run up to s batches ahead of the learner: while the learner trains on
batch k the schedulers already grow batch k+1 (s >= 1) with weights at most s versions old. s = 0 is the fully
synchronous loop (grow, train, grow, ...). The queue carries token ids and metadata with an ObjectRef of the
samples; weights travel as one ObjectRef (one object-store copy) to every engine.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import ray

from treepo_ray.algo.catpo import catpo_metrics, catpo_weights, sampled_tokens
from treepo_ray.algo.credit import keep_tree, tree_metrics
from treepo_ray.data.prompts import Prompt, PromptStream
from treepo_ray.engines.base import SamplingParams, SegmentRequest
from treepo_ray.engines.decode import safe_decode
from treepo_ray.job.config import TrainConfig
from treepo_ray.learner.batch import samples_from_trees
from treepo_ray.runtime.healer import make_healer
from treepo_ray.runtime.learner import LearnerGroup
from treepo_ray.runtime.pool import EngineSpec, GeneratorPool
from treepo_ray.runtime.registry import event_metrics, on_this_node, report
from treepo_ray.runtime.scheduler import TreeScheduler
from treepo_ray.runtime.verifier import VerifierPool
from treepo_ray.tree import Tree

DONE = None  # end-of-stream sentinel on the batch queue


@dataclass
class RolloutBatch:
    """One step's training batch as it waits in the queue: metadata plus an ObjectRef of the samples."""

    step: int
    """Training step (0-based) this batch is for."""
    version: int
    """Weights version (training steps done) the generators ran while growing it."""
    samples: object
    """ObjectRef of list[TrainSample] in the object store."""
    num_samples: int
    """Samples in the batch (0: every prompt was filtered out; the step trains on nothing)."""
    data_position: int
    """Prompts of the training stream consumed once this batch is trained on (saved in checkpoints)."""
    metrics: dict = field(default_factory=dict)
    trees: list[dict] = field(default_factory=list)
    """A few of the batch's trees with decoded texts, for trees.jsonl."""


class Pipeline:
    """The actors of one run (generator pool, schedulers, verifiers, learner group) and the loop over them."""

    def __init__(self, cfg: TrainConfig, model_path: str, tokenizer):
        rt = cfg.runtime
        self.cfg, self.tokenizer = cfg, tokenizer
        self.model_path = model_path
        # The generator pool replaces lost engines and grows where Ray reports room (pool.py); verifiers are
        # retried and their failures scored as wrong (verifier.py). Both report to one registry of fault events.
        spec = EngineSpec(cfg.model.engine, model_path, cfg.model.engine_kwargs, rt.torch_threads, rt.engine_cpus,
                          rt.engine_gpus, rt.engine_resources)
        self.pool = GeneratorPool(spec, rt.num_engines, rt.elastic.max_engines, rt.elastic.poll_s,
                                  rt.faults.max_resends, rt.faults.engine_wait_s, rt.elastic.startup_timeout_s)
        self.verifiers = VerifierPool.start(rt.num_verifiers, rt.verifier_cpus, rt.verifier_timeout_s,
                                            self.pool.registry, rt.faults)
        sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)
        # CATPO: the schedulers score each verified tree and send dead-wrong ones to the healer (its generation
        # runs on the same engines); like the schedulers it mostly waits, so it reserves no CPU.
        catpo = cfg.algo.catpo if cfg.algo.name == "catpo" else None
        self.healers = ([make_healer(self.pool, self.verifiers, model_path, catpo, cfg.sampler_config.step_len)]
                        if catpo is not None and catpo.heal else [])
        # Schedulers mostly wait on engines and verifiers, so they reserve no CPU. They hold the tree state, so they
        # live on the driver's node (same failure domain), never on a spot generator node that can vanish.
        scheduler = TreeScheduler.options(num_cpus=0, scheduling_strategy=on_this_node())
        self.schedulers = [scheduler.remote(self.pool, self.verifiers, model_path, cfg.algo.sampler,
                                            cfg.sampler_config, sampling, catpo, (self.healers or [None])[0])
                           for _ in range(rt.num_schedulers)]
        self.learner = self.build_learner()
        self.eval_set: list[Prompt] = []
        self.eval_args: dict = {}  # max_new_tokens, samples, temperature of evaluate()
        self.pool.start()  # only now: growth takes free room, which the actors above needed first

    def build_learner(self) -> LearnerGroup:
        """A new learner group with the base weights (also what replaces a lost one, see recovery.py)."""
        rt = self.cfg.runtime
        return LearnerGroup(self.model_path, self.cfg.learner, rt.learner_ranks, rt.learner_cpus, rt.learner_gpus,
                            rt.learner_resources, rt.torch_threads)

    def shutdown(self) -> None:
        """Kill this pipeline's actors (their resources return to the cluster)."""
        self.pool.close()  # the engines, pending ones too, and the registry
        actors = self.verifiers.actors() + self.schedulers + self.healers + self.learner.ranks
        for actor in actors:
            ray.kill(actor)

    # ------------------------------------------------------------------------------------------ weights

    def sync_weights(self, min_version: int = 0, force: bool = False) -> float:
        """Load the learner's newest published weights into every engine if they run older ones (or, with `force`,
        whatever they run); returns seconds spent."""
        t0 = time.perf_counter()
        version, ref = self.learner.published
        # Invariant (guaranteed by the slots in `train`): the learner has published a version the batch may use.
        assert version >= min_version, f"weights v{version} published, batch needs v{min_version} or newer"
        if ref is not None and (force or version > self.pool.weights_version):
            self.pool.load_weights(ref, version)  # engines that join later load these first
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------------------ rollouts

    def grow(self, prompts: list[Prompt], progress: float = 0.0) -> list[Tree]:
        """Grow and score the trees of `prompts`, sharded over the schedulers; trees come back in prompt order.
        `progress`: how far training is (0 to 1), for scheduled sampler settings."""
        k = len(self.schedulers)
        refs = [s.grow.remote(prompts[i::k], progress) for i, s in enumerate(self.schedulers) if prompts[i::k]]
        shards = ray.get(refs)
        out: list[Tree] = [None] * len(prompts)  # type: ignore[list-item]
        for i, shard in enumerate(shards):
            out[i::k] = shard
        return out

    def make_batch(self, step: int, stream: PromptStream, num_trees_logged: int = 0) -> RolloutBatch:
        """Grow, score and credit one step's batch (DAPO dynamic sampling: refill filtered prompts)."""
        cfg, algo = self.cfg, self.cfg.algo
        need = cfg.trainer.prompts_per_step
        t0 = time.perf_counter()
        before = self._engine_counters()
        grown: list[Tree] = []
        kept: list[Tree] = []
        for rnd in range(1 + (algo.max_extra_rounds if algo.filters_groups else 0)):
            missing = need - len(kept)
            n = math.ceil(missing * algo.oversample) if algo.filters_groups else missing
            trees = self.grow(stream.take(n), progress=step / max(1, cfg.trainer.steps - 1))
            grown += trees
            kept += [t for t in trees if keep_tree(t)] if algo.filters_groups else trees
            if len(kept) >= need:
                break
        if len(kept) > need:  # DAPO keeps a random subset of the over-sampled groups
            pick = np.random.default_rng([cfg.trainer.seed, step]).choice(len(kept), need, replace=False)
            kept = [kept[i] for i in sorted(pick)]
        t_grow = time.perf_counter()
        # CATPO phase 4 (phases 2-3 ran in the schedulers): each tree's advantages scaled by w(T) = F / mean F.
        weights = catpo_weights(kept) if algo.name == "catpo" and algo.catpo.weighting else None
        samples = samples_from_trees(kept, algo.advantages(kept), weights)
        t_credit = time.perf_counter()

        metrics = tree_metrics(grown, algo.correct_threshold)
        metrics["rollout/sampled_tokens"] = float(sampled_tokens(grown))  # healing's generation included
        if algo.name == "catpo":
            metrics.update(catpo_metrics(grown, weights))
        after = self._engine_counters()
        fwd = sum(c.get("forward_tokens", 0) - before.get(e, {}).get("forward_tokens", 0) for e, c in after.items())
        unique = metrics.get("tree/unique_tokens", 0.0)
        trajectories = sum(len(t.trajectories) for t in grown)
        metrics.update({
            "rollout/kept_prompts": float(len(kept)),
            "rollout/rounds": float(rnd + 1),
            "tree/forward_tokens": float(fwd),
            "tree/forward_per_unique": fwd / unique if unique else math.nan,
            "perf/traj_per_s": trajectories / max(t_grow - t0, 1e-9),
            "time/rollout": t_grow - t0,
            "time/credit": t_credit - t_grow,
        })
        return RolloutBatch(step, self.pool.weights_version, ray.put(samples), len(samples), stream.position, metrics,
                            [self.tree_record(t) for t in kept[:num_trees_logged]])

    def _engine_counters(self) -> dict:
        """Counters per engine id (an engine that joins mid-batch counts from zero; one that dies is left out)."""
        return {s["engine_id"]: {k: v for k, v in s.items() if isinstance(v, (int, float))} for s in self.pool.stats()}

    def fault_metrics(self) -> dict:
        """pool/size and the fault events since the last call (fault/<kind> totals), each reason logged once."""
        events = self.pool.drain_events()
        for _, kind, detail, _ in events:
            if kind in ("engines_lost", "engines_joined", "chaos_kills"):
                report(detail)  # the others were logged where they happened
        return {"pool/size": float(self.pool.size), **event_metrics(events)}

    def tree_record(self, tree: Tree) -> dict:
        """A tree as a JSON-able dict with the decoded text of its prompt and of every segment."""
        dec = lambda ids: safe_decode(self.tokenizer, ids, skip_special_tokens=False)  # noqa: E731
        return {**tree.to_dict(), "prompt_text": dec(tree.prompt_ids), "texts": [dec(t) for t in tree.tokens]}

    # ------------------------------------------------------------------------------------------ evaluation

    def evaluate(self, problems: list[Prompt], max_new_tokens: int, samples: int = 1, temperature: float = 1.0) -> dict:
        """Held-out pass@1 of the weights the engines hold now: the mean accuracy of `samples` answers per problem
        drawn at `temperature` (0 = greedy, one answer). Seeds are fixed per problem, so two evaluations of the
        same weights agree and two of different weights differ only by the weights."""
        if not problems:
            return {}
        t0 = time.perf_counter()
        samples = 1 if temperature == 0 else samples
        version = self.pool.weights_version
        reqs = [SegmentRequest(f"eval-v{version}/{i}", list(p.prompt_ids), max_new_tokens, samples,
                               SamplingParams(temperature=temperature, seed=1_000_003 * i))
                for i, p in enumerate(problems)]
        results = self.pool.generate_now(reqs)  # spread over the live engines, re-sent if one dies
        triples = [(p.data_source, safe_decode(self.tokenizer, c.token_ids, skip_special_tokens=True),
                    p.ground_truth) for p, r in zip(problems, results) for c in r.children]
        rewards = np.array(ray.get(self.verifiers.score(triples)), dtype=np.float64)
        lengths = [len(c.token_ids) for r in results for c in r.children]
        return {"eval/accuracy": float((rewards >= self.cfg.algo.correct_threshold).mean()),
                "eval/reward": float(rewards.mean()), "eval/response_len": float(np.mean(lengths)),
                "eval/problems": float(len(problems)), "eval/version": float(version),
                "time/eval": time.perf_counter() - t0}

    # ------------------------------------------------------------------------------------------ the loop

    def train(self, start_step: int, end_step: int, stream: PromptStream, on_step, trees_per_step: int = 0,
              eval_every: int = 0, max_staleness: int | None = None) -> int:
        """Train steps [start_step, end_step); `on_step(batch, metrics) -> bool` logs and checkpoints after each
        step and returns False to stop early. With `eval_every`, the producer evaluates `self.eval_set` on the
        weights it has just loaded every that many steps (between two batches, so the engines are idle).
        `max_staleness` overrides runtime.max_staleness for this call. Returns the number of steps completed
        (the learner's new version)."""
        s = self.cfg.runtime.max_staleness if max_staleness is None else max_staleness
        # Back-pressure and the staleness bound in one place: the producer takes a slot before growing a batch and
        # the consumer returns it after training on one and publishing the new weights. With s + 1 slots, batch k
        # starts only after batch k - s - 1 has been trained, i.e. when weights of version >= k - s exist.
        slots = threading.Semaphore(s + 1)
        batches: queue.Queue = queue.Queue(maxsize=s + 1)
        stop = threading.Event()

        def produce() -> None:
            try:
                for step in range(start_step, end_step):
                    slots.acquire()
                    if stop.is_set():
                        break
                    sync_s = self.sync_weights(min_version=step - s)
                    evaluated = {}
                    if eval_every and step > start_step and step % eval_every == 0:
                        evaluated = self.evaluate(self.eval_set, **self.eval_args)
                    batch = self.make_batch(step, stream, trees_per_step)
                    batch.metrics.update(evaluated, **{"time/weight_sync": sync_s})
                    batches.put(batch)
            except BaseException as err:  # surfaces in the consumer, which re-raises it
                batches.put(err)
                return
            batches.put(DONE)

        producer = threading.Thread(target=produce, name="rollout-producer", daemon=True)
        producer.start()
        step, last = start_step, time.perf_counter()
        try:
            while True:
                t_wait = time.perf_counter()
                batch = batches.get()
                if batch is DONE:
                    break
                if isinstance(batch, BaseException):
                    raise batch
                waited = time.perf_counter() - t_wait
                staleness = step - batch.version
                # Invariant: every batch is trained at most max_staleness versions after the weights that grew it.
                assert batch.step == step and 0 <= staleness <= s, (batch.step, step, staleness)
                t_train = time.perf_counter()
                metrics = {}
                if batch.num_samples:
                    learner = ray.get(self.learner.train_step(batch.samples))
                    metrics = {f"train/{k}": v for k, v in learner.items()}
                else:
                    metrics = {"train/skipped": 1.0}
                t_pub = time.perf_counter()
                self.learner.publish(step + 1)
                slots.release()
                now = time.perf_counter()
                metrics.update(batch.metrics)
                # Fault events are drained here, not when the batch was grown: a batch dropped unseen (its learner
                # was lost) would take its events with it.
                metrics.update(self.fault_metrics())
                metrics.update({"perf/staleness": float(staleness), "time/train": t_pub - t_train,
                                "time/publish": now - t_pub, "time/wait": waited, "time/step": now - last})
                last = now
                step += 1
                if not on_step(batch, metrics):
                    break
        finally:
            stop.set()
            slots.release()  # wake a producer waiting for a slot so it sees `stop`
            while producer.is_alive():
                try:
                    batches.get(timeout=0.1)  # drain so a blocked put can finish
                except queue.Empty:
                    pass
            producer.join()
        return step
