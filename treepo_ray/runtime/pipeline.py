"""The asynchronous training loop: the actors of one run and the two driver threads that keep them busy.

    producer:  take a slot -> bring the generators up to date -> grow + score trees -> credit -> queue.put(batch)
    consumer:  queue.get() -> learner step -> publish weights -> return the slot -> log, checkpoint

With max_staleness = s the producer may run up to s batches ahead of the learner: while the learner trains on
batch k the schedulers already grow batch k+1 (s >= 1) with weights at most s versions old. s = 0 is the fully
synchronous loop (grow, train, grow, ...). Each batch grows in a thread of its own, and with engines that take new
weights between two steps while sequences run (the hf engine), batch k+1 starts as soon as its weights exist and
batch k has taken its prompts, not when batch k is done: its first round fills the engines while batch k's last
one (DAPO's refill) finishes, and batch k's last tokens come from the newer weights. A batch's version is the
pool's when it starts, the oldest that wrote any of its tokens. The queue carries token ids and metadata with an ObjectRef of the
scored trees (learner/batch.py: TrainTree, with their credit and the engines' sampled log-probs); weights travel
in the engines' dtype by broadcast from learner rank 0 or as one object-store copy (weights.py).

Growing a batch survives its actors: a scheduler that is lost or stuck (runtime/liveness.py's heartbeat), or whose
prompts failed because the CATPO healer was lost, is replaced and its prompts grown again on the new one with the
same seeds, so the batch is the one the lost actor was growing (`grow`). The batches waiting in the queue when a
checkpoint is taken are saved with it (`queued_batches`, job/rundir.py) and trained first when the run resumes
(`train(queued=...)`), instead of being grown again with newer weights.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_until_done
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import ray
from ray.exceptions import RayActorError

from treepo_ray.algo.catpo import catpo_metrics, catpo_weights, sampled_tokens
from treepo_ray.algo.credit import advantage_metrics, keep_tree, tree_metrics
from treepo_ray.data.prompts import Prompt, PromptStream
from treepo_ray.engines.base import SamplingParams, SegmentRequest
from treepo_ray.engines.decode import safe_decode
from treepo_ray.job.config import TrainConfig
from treepo_ray.learner.batch import train_trees
from treepo_ray.runtime.healer import make_healer
from treepo_ray.runtime.learner import LearnerGroup
from treepo_ray.runtime.liveness import DeadlineExceeded, Heartbeat, get, started
from treepo_ray.runtime.pool import EngineSpec, GeneratorPool
from treepo_ray.runtime.registry import actor_lost, brief, event_metrics, on_this_node, ping, report
from treepo_ray.runtime.scheduler import TreeScheduler
from treepo_ray.runtime.verifier import VerifierPool, verification_metrics
from treepo_ray.runtime.weights import WeightSync, sync_metrics
from treepo_ray.tree import Tree

DONE = None  # end-of-stream sentinel on the batch queue


def validation_metrics(sources: list[str], rewards: np.ndarray, correct_threshold: float, k: int) -> dict:
    """verl's validation figures per data source, for `k` samples per problem: val-core/<source>/acc/mean@k (the
    mean correctness of all samples, reward >= correct_threshold) and val-aux/<source>/reward/mean@k."""
    out = {}
    for source in sorted(set(sources)):
        r = rewards[[s == source for s in sources]]
        out[f"val-core/{source}/acc/mean@{k}"] = float((r >= correct_threshold).mean())
        out[f"val-aux/{source}/reward/mean@{k}"] = float(r.mean())
    return out


@dataclass
class RolloutBatch:
    """One step's training batch as it waits in the queue: metadata plus an ObjectRef of the samples."""

    step: int
    """Training step (0-based) this batch is for."""
    version: int
    """Weights version (training steps done) the generators ran while growing it."""
    samples: object
    """ObjectRef of the batch's list[TrainTree] in the object store."""
    num_samples: int
    """Trajectories in the batch (0: every prompt was filtered out; the step trains on nothing)."""
    data_position: int
    """Prompts of the training stream consumed once this batch is trained on (saved in checkpoints)."""
    metrics: dict = field(default_factory=dict)
    trees: list[dict] = field(default_factory=list)
    """A few of the batch's trees with decoded texts, for trees.jsonl."""
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


class Pipeline:
    """The actors of one run (generator pool, schedulers, verifiers, learner group) and the loop over them."""

    def __init__(self, cfg: TrainConfig, model_path: str, tokenizer, train: bool = True):
        """`train=False`: only the generator pool and the verifiers, for evaluating weights handed to the pool
        (`pool.load_weights`); no schedulers, healer or learner."""
        rt = cfg.runtime
        self.cfg, self.tokenizer = cfg, tokenizer
        self.model_path = model_path
        # The generator pool replaces lost engines and grows where Ray reports room (pool.py); verifiers are
        # retried and what still fails is left out of the loss (verifier.py). Both report to one registry of faults.
        spec = EngineSpec.of(cfg, model_path)
        self.pool = GeneratorPool(spec, rt.num_engines, rt.elastic.max_engines, rt.elastic.poll_s,
                                  rt.faults.max_resends, rt.faults.engine_wait_s, rt.elastic.startup_timeout_s,
                                  deadlines=rt.deadlines, max_engine_errors=rt.faults.max_engine_errors)
        self.verifiers: VerifierPool | None = None
        self.schedulers: list = []
        self.healers: list = []
        self.learner: LearnerGroup | None = None
        self._sampling = SamplingParams(cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k)
        self._catpo = cfg.algo.catpo if cfg.algo.name == "catpo" else None
        # Of the schedulers and the healer, while growing; a replacement still starting is given start_s.
        self._heartbeat = Heartbeat(rt.deadlines.heartbeat_s, rt.deadlines.start_s)
        self._batches: queue.Queue | None = None  # the queue of the running train() (queued_batches reads it)
        self.weight_sync: WeightSync | None = None
        self.sync_metrics: dict = {}
        """The last weight sync's `weights/*` figures (path, bytes), logged with the batch it preceded."""
        self.eval_set: list[Prompt] = []
        self.eval_args: dict = {}  # max_new_tokens, samples, temperature of evaluate()
        self.progress: Callable[[int], float] = lambda step: step / max(1, cfg.trainer.steps - 1)
        """How far training is (0 to 1) when step `step`'s batch starts: the clock of the log-prob temperature
        schedule (tree/treepo.py `scheduled`). A budgeted run (`compare`) gives the share of its budget spent."""
        # Batches grow in threads of their own (train), which share the actor bookkeeping below.
        self._lock = threading.RLock()
        self._swaps_in_flight = False
        """The engines take new weights between two steps while sequences run (the next batch may start early)."""
        self._last_batch: tuple[dict, float] = ({}, time.perf_counter())  # engine counters when a batch was done
        try:
            self.verifiers = VerifierPool.start(rt.num_verifiers, rt.verifier_cpus, rt.verifier_timeout_s,
                                                self.pool.registry, rt.faults, cfg.custom_reward_function)
            started([(f"verifier {i}", v, {"CPU": rt.verifier_cpus} if rt.verifier_cpus else {})
                     for i, v in enumerate(self.verifiers.verifiers)], rt.deadlines.start_s)
            # CATPO: the schedulers score each verified tree and send dead-wrong ones to the healer (its generation
            # runs on the same engines); like the schedulers it mostly waits, so it reserves no CPU.
            if train:
                self.healers = [self._start_healer()] if self._catpo is not None and self._catpo.heal else []
                self.schedulers = [self._start_scheduler() for _ in range(rt.num_schedulers)]
                started([(f"scheduler {i}", a, {}) for i, a in enumerate(self.schedulers)]
                        + [("healer", a, {}) for a in self.healers], rt.deadlines.start_s)
                # How weights reach the engines (path, the engines' dtype): asked of a running engine, before any
                # export.
                self.weight_sync = WeightSync.for_run(cfg, self.pool.engines()[0])
                self._swaps_in_flight = ray.get(self.pool.engines()[0].loads_weights_while_running.remote())
                print(self.weight_sync.describe(), flush=True)
                self.learner = self.build_learner()
        except BaseException:
            self.shutdown()  # a run that cannot start leaves no actor behind
            raise
        self.pool.start()  # only now: growth takes free room, which the actors above needed first

    @classmethod
    def evaluator(cls, cfg: TrainConfig, model_path: str, tokenizer, settle_s: float = 10.0) -> "Pipeline":
        """Engines and verifiers only (`train=False`), as many engines as the cluster has room for: after a run,
        the learner's CPUs or GPUs evaluate too. A pipeline just shut down gives its room back within seconds
        (its actors exit asynchronously): up to `settle_s` is waited for the free room to reach the whole cluster's,
        then what is free is taken."""
        rt = cfg.runtime
        demand = EngineSpec.of(cfg, model_path).demand()

        def fitting(room: dict) -> int:
            room = {**room, "CPU": room.get("CPU", 0.0) - rt.num_verifiers * rt.verifier_cpus}
            fits = [int(room.get(k, 0.0) // v) for k, v in demand.items() if v > 0]
            return min(fits) if fits else rt.num_engines

        end = time.monotonic() + settle_s
        while fitting(ray.available_resources()) < fitting(ray.cluster_resources()) and time.monotonic() < end:
            time.sleep(0.5)
        runtime = replace(rt, num_engines=max(1, fitting(ray.available_resources())),
                          elastic=replace(rt.elastic, max_engines=0))
        return cls(replace(cfg, runtime=runtime), model_path, tokenizer, train=False)

    def build_learner(self) -> LearnerGroup:
        """A new learner group with the base weights (also what replaces a lost one, see recovery.py)."""
        rt = self.cfg.runtime
        old = getattr(self, "learner", None)
        if old is not None:  # a lost group: its ranks go, and its placement group's room goes to the new one
            old.close()
        return LearnerGroup(self.model_path, self.cfg.learner, rt.learner_ranks, rt.learner_cpus, rt.learner_gpus,
                            rt.learner_resources, rt.torch_threads, weights=self.weight_sync,
                            deadlines=rt.deadlines)

    def _start_scheduler(self):
        """A tree scheduler. Schedulers mostly wait on engines and verifiers, so they reserve no CPU. They hold the
        tree state, so they live on the driver's node (same failure domain), never on a spot generator node that
        can vanish; a lost one is replaced by the pipeline, not restarted by Ray (`grow`)."""
        cfg = self.cfg
        return TreeScheduler.options(num_cpus=0, scheduling_strategy=on_this_node(), max_restarts=0,
                                     max_task_retries=0).remote(
            self.pool, self.verifiers, self.model_path, cfg.algo.sampler, cfg.sampler_config, self._sampling,
            self._catpo, (self.healers or [None])[0], cfg.runtime.deadlines.grow_s)

    def _start_healer(self):
        return make_healer(self.pool, self.verifiers, self.model_path, self._catpo, self.cfg.sampler_config.step_len,
                           self.cfg.runtime.deadlines.grow_s, self.cfg.rollout.temperature)

    def shutdown(self) -> None:
        """Kill this pipeline's actors (their resources return to the cluster)."""
        self.pool.close()  # the engines, pending ones too, and the registry
        if self.learner is not None:
            self.learner.close()  # the ranks and their placement group
        for actor in (self.verifiers.actors() if self.verifiers else []) + self.schedulers + self.healers:
            ray.kill(actor)

    # ------------------------------------------------------------------------------------------ weights

    def sync_weights(self, min_version: int = 0, force: bool = False) -> float:
        """Load the learner's newest published weights into every engine if they run older ones (or, with `force`,
        whatever they run); returns seconds spent."""
        t0 = time.perf_counter()
        version, weights = self.learner.published
        # Invariant (guaranteed by the slots in `train`): the learner has published a version the batch may use.
        assert version >= min_version, f"weights v{version} published, batch needs v{min_version} or newer"
        loaded = weights is not None and (force or version > self.pool.weights_version)
        if loaded:
            self.pool.load_weights(weights, version)  # engines that join later load these first
        seconds = time.perf_counter() - t0
        self.sync_metrics = sync_metrics(weights if loaded else None)
        return seconds

    # ------------------------------------------------------------------------------------------ rollouts

    def grow(self, prompts: list[Prompt], progress: float = 0.0) -> list[Tree]:
        """Grow and score the trees of `prompts`, sharded over the schedulers; trees come back in prompt order.

        A shard whose scheduler is lost, or stuck (heartbeat), or whose trees failed because the healer was lost,
        is grown again from its start on a replacement (runtime.faults.max_regrows times per batch at most). Its
        prompts carry their seeds, so the new trees are those the lost scheduler was growing. Any other failure of
        a shard stops the batch."""
        rt = self.cfg.runtime
        k = len(self.schedulers)
        shards = {i: prompts[i::k] for i in range(k) if prompts[i::k]}
        healer = lambda: (self.healers or [None])[0]  # noqa: E731 - the healer a shard's trees are sent to
        def start(i: int) -> tuple:
            actor = self.schedulers[i]
            return actor.grow.remote(shards[i], progress), (i, actor, healer())

        running = dict(start(i) for i in shards)
        results: dict[int, list[Tree]] = {}
        regrows, deadline = 0, time.monotonic() + rt.deadlines.grow_s
        while running:
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"growing {len(prompts)} prompts: no answer within {rt.deadlines.grow_s:g}s "
                                       "(runtime.deadlines.grow_s)")
            done, _ = ray.wait(list(running), num_returns=len(running), timeout=rt.elastic.poll_s)
            self._kill_stuck()
            for ref in done:
                i, actor, its_healer = running.pop(ref)
                try:
                    results[i] = ray.get(ref)
                    continue
                except Exception as err:  # noqa: BLE001 - recovered below if an actor was lost, else raised
                    if not self._replace_lost(i, actor, err, its_healer):
                        raise
                    regrows += 1
                    if regrows > rt.faults.max_regrows:
                        raise RuntimeError(f"a batch's prompts were grown again {regrows - 1} times and their "
                                           "actors keep failing (runtime.faults.max_regrows)") from err
                self.pool.registry.record.remote("regrown_prompts", f"{len(shards[i])} prompts grown again on a new "
                                                 "scheduler, with the same seeds", len(shards[i]))
                ref, shard_of = start(i)
                running[ref] = shard_of
        out: list[Tree] = [None] * len(prompts)  # type: ignore[list-item]
        for i, shard in results.items():
            out[i::k] = shard
        return out

    def _kill_stuck(self) -> None:
        """Heartbeat of the schedulers and the healer: a stuck one is killed, so that its calls fail and `grow`
        replaces it like a lost one (a dead one is found the same way, through its failed call)."""
        with self._lock:  # batches growing at once share the heartbeat
            self._kill_stuck_locked()

    def _kill_stuck_locked(self) -> None:
        actors = {f"scheduler {i}": a for i, a in enumerate(self.schedulers)}
        actors.update({"healer": a for a in self.healers})
        _, stuck = self._heartbeat.check(actors)
        for name in stuck:
            ray.kill(actors[name])
            self._heartbeat.forget(name)
            msg = (f"{name} did not answer a ping for {self.cfg.runtime.deadlines.heartbeat_s:g}s "
                   "(runtime.deadlines.heartbeat_s): killed and replaced")
            report(msg)
            self.pool.registry.record.remote("schedulers_stuck" if name != "healer" else "healers_stuck", msg)

    def _replace_lost(self, i: int, actor, err: BaseException, its_healer) -> bool:
        """Scheduler `i`'s shard failed with `err` on `actor`: replace what was lost (the scheduler itself, or
        `its_healer`, the healer its trees were sent to) and return True; False when nothing was lost (the error is
        the shard's own). A replacement is not waited for: one that is lost before it runs fails the shard's next
        call in turn, and is replaced like any other. Batches growing at once replace each loss once."""
        with self._lock:
            return self._replace_lost_locked(i, actor, err, its_healer)

    def _replace_lost_locked(self, i: int, actor, err: BaseException, its_healer) -> bool:
        if isinstance(err, RayActorError) and actor_lost(err):
            if self.schedulers[i] is not actor:
                return True  # another batch's shard on it found the loss first
            msg = f"scheduler {i} lost ({brief(err)}); a new one grows its prompts again"
            report(msg)
            self.pool.registry.record.remote("schedulers_lost", msg)
            self._heartbeat.forget(f"scheduler {i}")
            self.schedulers[i] = self._start_scheduler()
            return True
        if its_healer is not None and its_healer is not self.healers[0]:
            return True  # another shard's failure replaced that healer already
        if self.healers and not self._answers(self.healers[0]):
            msg = f"the CATPO healer was lost ({brief(err)}); a new one takes over"
            report(msg)
            self.pool.registry.record.remote("healers_lost", msg)
            ray.kill(self.healers[0])
            self._heartbeat.forget("healer")
            self.healers = [self._start_healer()]
            for scheduler in self.schedulers:  # before the shard it is sent again: calls run in the order sent
                scheduler.set_healer.remote(self.healers[0])
            return True
        return False

    def _answers(self, actor) -> bool:
        try:
            get(ping(actor), self.cfg.runtime.deadlines.call_s, "ping")
        except (RayActorError, DeadlineExceeded):
            return False
        return True

    def make_batch(self, step: int, stream: PromptStream, num_trees_logged: int = 0,
                   prompts_taken: threading.Event | None = None) -> RolloutBatch:
        """Grow, score and credit one step's batch (DAPO dynamic sampling: refill filtered prompts). Its prompts
        are one run of `stream`; `prompts_taken` is set once the last of them is taken (the next batch may then
        take its own). The batch's version is the pool's when it starts: every token in it was sampled by those
        weights or newer ones (engines may take newer weights while it grows)."""
        cfg, algo = self.cfg, self.cfg.algo
        need = cfg.trainer.prompts_per_step
        t0 = time.perf_counter()
        version = self.pool.weights_version
        grown: list[Tree] = []
        kept: list[Tree] = []
        rounds = 1 + (algo.max_extra_rounds if algo.filters_groups else 0)
        progress = self.progress(step)
        try:
            for rnd in range(rounds):
                missing = need - len(kept)
                n = math.ceil(missing * algo.oversample) if algo.filters_groups else missing
                prompts, position = stream.take(n), stream.position
                if rnd == rounds - 1 and prompts_taken is not None:
                    prompts_taken.set()
                trees = self.grow(prompts, progress=progress)
                grown += trees
                trees = [t for t in trees if t.trajectories]  # none left when every verification of a tree failed
                kept += [t for t in trees if keep_tree(t)] if algo.filters_groups else trees
                if len(kept) >= need:
                    break
        finally:
            if prompts_taken is not None:
                prompts_taken.set()
        if len(kept) > need:  # DAPO keeps a random subset of the over-sampled groups
            pick = np.random.default_rng([cfg.trainer.seed, step]).choice(len(kept), need, replace=False)
            kept = [kept[i] for i in sorted(pick)]
        t_grow = time.perf_counter()
        samples, credit, weights = self.credit(kept)
        t_credit = time.perf_counter()

        metrics = tree_metrics(grown, algo.correct_threshold, cfg.sampler_config.response_limit())
        metrics.update(advantage_metrics(kept, [c.trajectories for c in credit], weights))
        metrics.update(verification_metrics(grown, cfg.runtime.faults.max_verify_failed_share))
        metrics["rollout/sampled_tokens"] = float(sampled_tokens(grown))  # healing's generation included
        if algo.name == "catpo":
            metrics.update(catpo_metrics(grown, weights))
        # Engine figures since the previous batch was done: batches may grow at the same time, so what the engines
        # ran cannot be told apart by batch; summed over a run, each figure is the run's total.
        since, seconds = self._since_last_batch()
        fwd = sum(c.get("forward_tokens", 0) for c in since.values())
        unique = metrics.get("tree/unique_tokens", 0.0)
        trajectories = sum(len(t.trajectories) for t in grown)
        metrics.update({
            "rollout/kept_prompts": float(len(kept)),
            "rollout/progress": progress,
            "rollout/rounds": float(rnd + 1),
            "tree/forward_tokens": float(fwd),
            "tree/forward_per_unique": fwd / unique if unique else math.nan,
            "perf/engine_busy_s": float(sum(v for c in since.values() for k, v in c.items() if k.startswith("time_"))),
            "perf/engine_rows": sum(c.get("step_sequences", 0) for c in since.values()) / max(
                sum(c.get("steps", 0) for c in since.values()), 1),
            "perf/traj_per_s": trajectories / max(seconds, 1e-9),
            "timing_s/gen": t_grow - t0,
            "timing_s/adv": t_credit - t_grow,
        })
        return RolloutBatch(step, version, ray.put(samples), sum(len(t.trajectories) for t in samples), position,
                            metrics, [self.tree_record(t) for t in kept[:num_trees_logged]], kept, (t0, t_grow))

    def credit(self, kept: list[Tree]) -> tuple[list, list, list[float] | None]:
        """The learner's trees of the kept trees (learner/batch.py: TrainTree), their credit and, under CATPO, the
        tree weights they were scaled by (phase 4; phases 2-3 ran in the schedulers): w(T) = F / mean F."""
        algo = self.cfg.algo
        weights = catpo_weights(kept) if algo.name == "catpo" and algo.catpo.weighting else None
        credit = algo.credit(kept)
        return train_trees(kept, credit, weights), credit, weights

    def batch_from_record(self, record: dict) -> RolloutBatch:
        """A batch saved with a checkpoint while it waited in the queue (RolloutBatch.to_record), ready to train."""
        kept = [Tree.from_dict(t) for t in record["kept"]]
        samples, _, _ = self.credit(kept)
        return RolloutBatch(record["step"], record["version"], ray.put(samples), sum(len(t.trajectories) for t in samples),
                            record["data_position"], dict(record["metrics"]), list(record["trees"]), kept)

    def queued_batches(self) -> list[RolloutBatch]:
        """The batches waiting in the running train()'s queue for the learner, oldest first (a checkpoint keeps
        them)."""
        if self._batches is None:
            return []
        with self._batches.mutex:
            items = list(self._batches.queue)
        out = []
        for item in items:  # the grown ones, up to the first still growing (or failed)
            if isinstance(item, Future):
                if not item.done() or item.exception() is not None:
                    break
                item = item.result()
            if not isinstance(item, RolloutBatch):
                break
            out.append(item)
        return out

    def _since_last_batch(self) -> tuple[dict, float]:
        """The engines' counters (per engine id) and the seconds since the previous batch was done, or since the
        pipeline started: an engine that joins counts from zero, one that dies is left out."""
        now = {s["engine_id"]: {k: v for k, v in s.items() if isinstance(v, (int, float))} for s in self.pool.stats()}
        t1 = time.perf_counter()
        with self._lock:
            (before, t0), self._last_batch = self._last_batch, (now, t1)
        return {e: {k: v - before.get(e, {}).get(k, 0) for k, v in c.items()} for e, c in now.items()}, t1 - t0

    def _engine_work_not_counted(self, run):
        """`run()` on engines that nothing else uses meanwhile, with their work during it (and its seconds) left out
        of the next batch's figures."""
        try:
            return run()
        finally:
            self._since_last_batch()  # the next batch counts from here

    def fault_metrics(self) -> dict:
        """pool/size and the fault events since the last call (fault/<kind> totals), each reason logged once."""
        events = self.pool.drain_events()
        for _, kind, detail, _ in events:
            if kind.startswith(("engines_", "engine_errors", "chaos")):
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
        items = [(p.data_source, safe_decode(self.tokenizer, c.token_ids, skip_special_tokens=True),
                  p.ground_truth, p.extra_info) for p, r in zip(problems, results) for c in r.children]
        scored = get(self.verifiers.score(items), self.cfg.runtime.deadlines.grow_s, "verifying the evaluation")
        verified = [(p.data_source, r) for (p, _), r in zip(
            ((p, c) for p, res in zip(problems, results) for c in res.children), scored) if r is not None]
        sources = [src for src, _ in verified]  # a failed verification is left out, not scored as wrong
        rewards = np.array([r for _, r in verified], dtype=np.float64)
        lengths = [len(c.token_ids) for r in results for c in r.children]
        return {"eval/accuracy": float((rewards >= self.cfg.algo.correct_threshold).mean()) if rewards.size else 0.0,
                "eval/reward": float(rewards.mean()) if rewards.size else 0.0,
                "eval/response_len": float(np.mean(lengths)), "eval/verify_failed": float(len(scored) - rewards.size),
                "eval/problems": float(len(problems)), "eval/version": float(version),
                **validation_metrics(sources, rewards, self.cfg.algo.correct_threshold, samples),
                "timing_s/testing": time.perf_counter() - t0}

    # ------------------------------------------------------------------------------------------ the loop

    def train(self, start_step: int, end_step: int, stream: PromptStream, on_step, trees_per_step: int = 0,
              eval_every: int = 0, max_staleness: int | None = None, queued: list[RolloutBatch] = ()) -> int:
        """Train steps [start_step, end_step); `on_step(batch, metrics) -> bool` logs and checkpoints after each
        step and returns False to stop early. With `eval_every`, the producer evaluates `self.eval_set` on the
        weights it has just loaded every that many steps (once the last batch is done, so the engines are idle).
        `max_staleness` overrides runtime.max_staleness for this call. `queued`: batches of the first steps that
        were already grown (they waited in the queue when the checkpoint being resumed was taken); they are
        trained as they are, and `stream` continues after the last of them. Returns the number of steps completed
        (the learner's new version)."""
        s = self.cfg.runtime.max_staleness if max_staleness is None else max_staleness
        queued = list(queued)
        if [b.step for b in queued] != list(range(start_step, start_step + len(queued))):
            raise ValueError(f"queued batches of steps {[b.step for b in queued]} do not start at step {start_step}")
        # Back-pressure and the staleness bound in one place: the producer takes a slot before growing a batch and
        # the consumer returns it after training on one and publishing the new weights. With s + 1 slots, batch k
        # starts only after batch k - s - 1 has been trained, i.e. when weights of version >= k - s exist.
        slots = threading.Semaphore(s + 1)
        batches: queue.Queue = queue.Queue(maxsize=s + 1)
        self._batches = batches
        stop = threading.Event()

        # Batches grow in threads of their own, so the next one can start while the last one finishes: its first
        # round fills the engines while the last round of the one before (DAPO's refill) runs.
        growing = ThreadPoolExecutor(max_workers=s + 1, thread_name_prefix="rollout-batch")

        def grow_batch(step: int, extra: dict, taken: threading.Event) -> RolloutBatch:
            batch = self.make_batch(step, stream, trees_per_step, taken)
            batch.metrics.update(extra)
            return batch

        def produce() -> None:
            growing_now: list[Future] = []  # batches started and maybe not done yet
            taken = threading.Event()
            taken.set()
            try:
                for step in range(start_step, end_step):
                    slots.acquire()
                    if stop.is_set():
                        break
                    if queued:  # grown before the restart, with the weights of its own time
                        batches.put(queued.pop(0))
                        continue
                    evaluating = eval_every and step > start_step and step % eval_every == 0
                    # Engines that take new weights only between two batches, and an evaluation, need the batches
                    # before done; any other batch starts as soon as the last one has taken its prompts (so that
                    # one batch's prompts are one run of the stream: the position its checkpoint records).
                    if evaluating or not self._swaps_in_flight:
                        wait_until_done(growing_now)
                    growing_now = [f for f in growing_now if not f.done()]
                    sync_s = self.sync_weights(min_version=step - s)
                    extra = {**self.sync_metrics, "timing_s/update_weights": sync_s}
                    if evaluating:
                        extra.update(self._engine_work_not_counted(
                            lambda: self.evaluate(self.eval_set, **self.eval_args)))
                    taken.wait()
                    taken = threading.Event()
                    growing_now.append(growing.submit(grow_batch, step, extra, taken))
                    batches.put(growing_now[-1])
            except BaseException as err:  # surfaces in the consumer, which re-raises it
                batches.put(err)
                return
            batches.put(DONE)

        self._since_last_batch()  # the first batch's engine figures count from here
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
                if isinstance(batch, Future):
                    batch = batch.result()  # a batch that failed to grow raises here
                waited = time.perf_counter() - t_wait
                staleness = step - batch.version
                # Invariant: every batch is trained at most max_staleness versions after the weights that grew it.
                assert batch.step == step and 0 <= staleness <= s, (batch.step, step, staleness)
                t_train = time.perf_counter()
                metrics = {}
                if batch.num_samples:
                    learner = get(self.learner.train_step(batch.samples), self.cfg.runtime.deadlines.train_step_s,
                                  "learner step")
                    metrics = {f"actor/{k}": v for k, v in learner.items()}
                else:
                    metrics = {"actor/skipped": 1.0}
                t_pub = time.perf_counter()
                self.learner.publish(step + 1)
                slots.release()
                now = time.perf_counter()
                metrics.update(batch.metrics)
                # Fault events are drained here, not when the batch was grown: a batch dropped unseen (its learner
                # was lost) would take its events with it.
                metrics.update(self.fault_metrics())
                metrics.update({"perf/staleness": float(staleness), "timing_s/update_actor": t_pub - t_train,
                                "timing_s/publish": now - t_pub, "timing_s/wait": waited, "timing_s/step": now - last})
                last = now
                step += 1
                if not on_step(batch, metrics):
                    break
        finally:
            self._batches = None
            stop.set()
            slots.release()  # wake a producer waiting for a slot so it sees `stop`
            while producer.is_alive():
                try:
                    batches.get(timeout=0.1)  # drain so a blocked put can finish
                except queue.Empty:
                    pass
            producer.join()
            growing.shutdown(wait=True)  # a batch still growing finishes (its actors' deadlines bound it)
        return step
