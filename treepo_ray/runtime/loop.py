"""The asynchronous training loop: a producer thread grows batches ahead of the learner, the caller trains them.

    producer:  take a slot -> bring the engines up to date -> (evaluate) -> grow a batch in a thread of its own
    consumer:  next batch, in step order -> learner step -> publish the new policy version -> return the slot -> yield

The loop owns the policy version: the training steps done, whose weights it publishes after each step. With
max_staleness = s the producer may run up to s batches ahead: while the learner trains on batch k, batch k+1 grows
(s >= 1) with weights at most s versions old. s = 0 is the synchronous loop (grow, train, grow, ...). With engines
that take new weights between two steps while sequences run (the hf engine), batch k+1 starts as soon as its weights
exist and batch k has taken its prompts: its first round fills the engines while batch k's last one (DAPO's refill)
finishes, and batch k's last tokens come from the newer weights. A batch's version is the engines' when it starts.

The batches waiting in the queue when a checkpoint is taken are saved with it (`waiting`) and trained first when the
run resumes (`steps(queued=...)`), instead of being grown again with newer weights. Every wait here ends: the
consumer waits for a batch at most the deadline of its rounds of growth and its engine sync (runtime.deadlines), and
a failed batch fails the consumer's wait at once.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_until_done
from typing import Callable, Iterator

from treepo_ray.data.prompts import PromptStream
from treepo_ray.runtime.batches import BatchBuilder, RolloutBatch
from treepo_ray.job.faults import report
from treepo_ray.runtime.liveness import DeadlineExceeded
from treepo_ray.runtime.weights import sync_metrics


class BatchQueue:
    """Batches grown ahead of the learner, handed out in step order. Back-pressure and the staleness bound in one
    place: a slot is taken before a batch starts growing and returned once it is trained and the new version
    published; with s + 1 slots, batch k starts only after batch k - s - 1 was trained, so with weights of version
    k - s or newer."""

    def __init__(self, slots: int, first_step: int):
        self._cond = threading.Condition()
        self._free, self._next = slots, first_step
        self._ready: dict[int, RolloutBatch] = {}
        self._error: BaseException | None = None
        self._closed = False

    def reserve(self) -> bool:
        """Take a slot for the next batch (False once closed). Waits while the learner is behind: its own calls
        have deadlines, and the consumer closes the queue when it stops."""
        with self._cond:
            self._cond.wait_for(lambda: self._free > 0 or self._closed)
            self._free -= not self._closed
            return not self._closed

    def put(self, batch: RolloutBatch) -> None:
        with self._cond:
            self._ready[batch.step] = batch
            self._cond.notify_all()

    def fail(self, err: BaseException) -> None:
        with self._cond:
            self._error = self._error or err
            self._cond.notify_all()

    def get(self, timeout_s: float) -> RolloutBatch:
        """The next step's batch; the producer's error instead, or DeadlineExceeded after `timeout_s`."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._next in self._ready or self._error, timeout_s):
                raise DeadlineExceeded(f"the batch of step {self._next}: not grown within {timeout_s:g}s "
                                       "(runtime.deadlines.grow_s per round, and one more for the engines' sync)")
            if self._next not in self._ready:
                raise self._error
            self._next += 1
            return self._ready.pop(self._next - 1)

    def release(self) -> None:
        with self._cond:
            self._free += 1
            self._cond.notify_all()

    def waiting(self) -> list[RolloutBatch]:
        """The grown batches of the next steps, oldest first, up to the first still growing."""
        with self._cond:
            out, step = [], self._next
            while step in self._ready:
                out.append(self._ready[step])
                step += 1
            return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class Loop:
    """The loop of one run (module docstring) over a supervisor's actors, a batch builder and an evaluator."""

    def __init__(self, cfg, supervisor, builder: BatchBuilder, evaluator):
        self.cfg, self.supervisor, self.builder, self.evaluator = cfg, supervisor, builder, evaluator
        self.version = 0
        """The policy version: training steps done (and published)."""
        self._published: tuple[int, object] = (0, None)  # the newest version's payload for the engines (weights.py)
        self._queue: BatchQueue | None = None
        algo, dl = cfg.algo, cfg.runtime.deadlines
        rounds = 1 + (algo.max_extra_rounds if algo.filters_groups else 0)
        self.batch_deadline_s = (rounds + 1) * dl.grow_s

    def start_at(self, version: int) -> None:
        """Continue from `version` (a learner that loaded a checkpoint, or a new one at the base weights): publish
        its weights and load them into every engine, even over newer ones."""
        self.version = version
        self._published = (version, self.supervisor.learner.publish(version))
        self.supervisor.pool.load_weights(self._published[1], version)

    def sync_engines(self, min_version: int = 0) -> dict:
        """Load the newest published weights into every engine if they run older ones; the sync's figures."""
        t0 = time.perf_counter()
        version, weights = self._published
        # Invariant (guaranteed by the queue's slots): a version the batch may use is published.
        assert version >= min_version, f"weights v{version} published, batch needs v{min_version} or newer"
        pool = self.supervisor.pool
        loaded = weights is not None and version > pool.weights_version
        if loaded:
            pool.load_weights(weights, version)  # engines that join later load these first
        return {**sync_metrics(weights if loaded else None), "timing_s/update_weights": time.perf_counter() - t0}

    def kept_weights(self):
        """The newest published weights, as something the pool can load after the learner is gone."""
        return self.supervisor.learner.kept_copy(self._published[1])

    def waiting(self) -> list[RolloutBatch]:
        """The batches grown for the next steps, waiting for the learner (a checkpoint keeps them)."""
        queue = self._queue
        return queue.waiting() if queue is not None else []

    def steps(self, start: int, end: int, stream: PromptStream, queued: list[RolloutBatch] = (),
              eval_every: int = 0, progress: Callable[[int], float] | None = None, trees_logged: int = 0,
              max_staleness: int | None = None) -> Iterator[tuple[RolloutBatch, dict]]:
        """Train steps [start, end), yielding each trained step's batch and metrics (close the iterator to stop
        early). `queued`: batches of the first steps grown before a restart; `stream` continues after them. Every
        `eval_every` steps the producer evaluates the weights it has just loaded. `progress(step)` (0 to 1) is where
        training is on scheduled sampler settings (default: step / (trainer.steps - 1))."""
        s = self.cfg.runtime.max_staleness if max_staleness is None else max_staleness
        if [b.step for b in queued] != list(range(start, start + len(queued))):
            raise ValueError(f"queued batches of steps {[b.step for b in queued]} do not start at step {start}")
        last_step = max(1, self.cfg.trainer.steps - 1)
        progress = progress or (lambda step: step / last_step)
        self._queue = queue = BatchQueue(s + 1, start)
        self.builder.engine_figures()  # the first batch's engine figures count from here
        producer = threading.Thread(target=self._produce, name="rollout-producer", daemon=True,
                                    args=(queue, start, end, stream, list(queued), eval_every, progress, trees_logged,
                                          s))
        producer.start()
        last = time.perf_counter()
        try:
            for step in range(start, end):
                t_wait = time.perf_counter()
                batch = queue.get(self.batch_deadline_s)
                t_train = time.perf_counter()
                queued = len(queue.waiting())  # batches grown ahead of this one: rollout's lead (the scaling policy)
                staleness = step - batch.version
                # Invariant: every batch is trained at most max_staleness versions after the weights that grew it.
                assert batch.step == step and 0 <= staleness <= s, (batch.step, step, staleness)
                learner = self.supervisor.learner
                metrics = ({f"actor/{k}": v for k, v in learner.train_step(batch.samples).items()}
                           if batch.num_samples else {"actor/skipped": 1.0})
                t_pub = time.perf_counter()
                self._published = (step + 1, learner.publish(step + 1))
                self.version = step + 1
                queue.release()
                now = time.perf_counter()
                # Fault events are drained here, not when the batch was grown: a batch dropped unseen (its learner
                # was lost) would take its events with it.
                metrics.update(batch.metrics)
                metrics.update(self.supervisor.fault_metrics())
                metrics.update(self.supervisor.scale(t_train - t_wait, now - last, queued,
                                                     batch.metrics.get("perf/engine_busy_s")))
                metrics.update({"perf/staleness": float(staleness), "perf/policy_version": float(self.version),
                                "timing_s/update_actor": t_pub - t_train, "timing_s/publish": now - t_pub,
                                "timing_s/wait": t_train - t_wait, "timing_s/step": now - last})
                last = now
                yield batch, metrics
        finally:
            self._queue = None
            queue.close()
            producer.join(timeout=self.batch_deadline_s)  # a batch still growing finishes (its deadlines bound it)
            if producer.is_alive():
                report(f"the rollout producer did not stop within {self.batch_deadline_s:g}s; left behind")

    def _produce(self, queue: BatchQueue, start: int, end: int, stream: PromptStream, queued: list,
                 eval_every: int, progress: Callable[[int], float], trees_logged: int, s: int) -> None:
        growing: list[Future] = []  # batches started and maybe not done yet
        taken = threading.Event()
        taken.set()
        with ThreadPoolExecutor(max_workers=s + 1, thread_name_prefix="rollout-batch") as threads:
            try:
                for step in range(start, end):
                    if not queue.reserve():
                        return
                    if queued:  # grown before the restart, with the weights of its own time
                        queue.put(queued.pop(0))
                        continue
                    evaluating = eval_every and step > start and step % eval_every == 0
                    # Engines that take new weights only between two batches, and an evaluation, need the batches
                    # before done; any other batch starts as soon as the last one has taken its prompts (so that
                    # one batch's prompts are one run of the stream: the position its checkpoint records).
                    if evaluating or not self.supervisor.swaps_in_flight:
                        wait_until_done(growing, timeout=self.batch_deadline_s)
                    growing = [f for f in growing if not f.done()]
                    extra = self.sync_engines(min_version=step - s)
                    if evaluating:
                        extra.update(self.evaluator.evaluate())
                        self.builder.engine_figures()  # the evaluation's engine work is no batch's
                    taken.wait(self.batch_deadline_s)  # the batch before took its prompts (set when it fails too)
                    taken = threading.Event()
                    growing.append(threads.submit(self._grow, queue, step, stream, progress(step), trees_logged,
                                                  taken, extra))
            except BaseException as err:  # surfaces in the consumer's next wait
                queue.fail(err)

    def _grow(self, queue: BatchQueue, step: int, stream: PromptStream, progress: float, trees_logged: int,
              taken: threading.Event, extra: dict) -> None:
        try:
            batch = self.builder.make(step, stream, progress, trees_logged, taken)
        except BaseException as err:
            queue.fail(err)
            return
        batch.metrics.update(extra)
        queue.put(batch)
