"""The trainer: one training run as plain Python. It owns where the run stands (TrainerState), what it logs, when it
evaluates and checkpoints, how it resumes, and how it goes on after a lost learner; the runtime (runtime/: Ray
actors) does the work it asks for, through three objects:

    loop        runtime/loop.py: `steps(...)` yields each trained step; `waiting()`, the batches grown ahead of the
                learner; `start_at(version)`, the engines brought to a version's weights; `builder.from_record`
    evaluator   runtime/evaluator.py: `evaluate()`, held-out accuracy of the weights the engines hold
    supervisor  runtime/supervisor.py: `learner.save_checkpoint` / `load_checkpoint`, `replace_learner()`,
                `fault_metrics()`, `pool.size`, and runtime.chaos while training runs (`start_chaos`,
                `after_step`, `stop_chaos`)

One step: the loop yields (batch, metrics) -> the trainer logs them (metrics.jsonl, W&B, the console, trees.jsonl and
samples.jsonl, also for a step that trained on nothing), counts faults and tree mechanisms, and every
trainer.save_every steps writes a checkpoint in run storage with the batches waiting for the learner beside it
(job/rundir.py) -> the loop goes on. A learner lost (LearnerLost) is rebuilt from the newest checkpoint, at most
runtime.faults.max_learner_restarts times: the steps trained after that checkpoint are trained again, from the same
prompts (the stream is rewound to the checkpoint's data position), so each step of the final weights' history is
trained once, and the log says so (a step logged twice). A write to run storage that fails (a checkpoint, its
waiting batches, a log line) is said, counted (fault/storage_errors) and tried again at every step; once
trainer.storage_retry_s has passed without a checkpoint going through, the run stops with one line.
"""

from __future__ import annotations

import contextlib
import json
import math
import time

from treepo_ray import config as config_io
from treepo_ray import storage
from treepo_ray.data.prompts import Prompt, PromptStream
from treepo_ray.job.faults import LearnerLost, RunStopped, report
from treepo_ray.job.rundir import LogMirror, RunLock, RunRecord, load_pending, prune_run, save_pending, write_config
from treepo_ray.job.state import TrainerState
from treepo_ray.learner.checkpoint import checkpoint_dir, latest_checkpoint, step_of


class Trainer:
    """One run of `cfg` in `run_dir` (held by `lock`; `record`: its run.json), resumed from the checkpoint
    `resume_from` when given."""

    def __init__(self, cfg, run_dir: str, record: RunRecord, resume_from: str | None, lock: RunLock, loop, evaluator,
                 supervisor, sinks: tuple = ()):
        """`sinks`: more places every step's metrics go (job/logs.py RunLogger; the runtime's Ray gauges)."""
        self.cfg, self.run_dir, self.record, self.resume_from, self.lock = cfg, run_dir, record, resume_from, lock
        self.loop, self.evaluator, self.supervisor, self.sinks = loop, evaluator, supervisor, list(sinks)
        self.state = TrainerState(seed=cfg.trainer.seed)
        self.faults: dict[str, float] = {}  # fault/* totals of this invocation (not rewound by a learner restart)
        self.counters: dict[str, float] = {}  # growth/* totals of this invocation: what the tree growers did
        self.logs = LogMirror(run_dir, cfg.model.cache_dir)  # the logger's folder (a local copy when run_dir is a URI)
        self.logger = self.bar = None
        self.storage_failing_since: float | None = None
        """When run storage began to fail (time.monotonic()); None once a checkpoint has gone through."""
        self.end = 0
        """The last step of this invocation (trainer.stop_after may end it before trainer.steps)."""

    def fit(self, train_set: list[Prompt], observe=None) -> dict:
        """Train as configured; returns (and writes to <run_dir>/summary.json) the run's summary. `observe(batch,
        metrics)`, if given, sees every trained step (the chaos benchmark compares runs with it)."""
        from tqdm import tqdm

        started, tr = time.time(), self.cfg.trainer
        queued, position = self._resume() if self.resume_from is not None else ([], 0)
        self._start_logging()
        if self.state.base_eval is None:
            self.state.base_eval = self.evaluator.evaluate()
            if self.state.base_eval:
                print(f"base model: held-out accuracy {self.state.base_eval['eval/accuracy']:.3f} on "
                      f"{len(self.evaluator.problems)} problems ({self.evaluator.method})")
                self.logger.log(0, self.state.base_eval)
        stream = PromptStream(train_set, tr.seed, self.cfg.data.shuffle, position=position)
        self.end = tr.steps if not tr.stop_after else min(tr.steps, self.state.step + tr.stop_after)
        self.bar = tqdm(total=tr.steps, initial=self.state.step, desc=f"{self.cfg.algo.name} train", unit="step",
                        dynamic_ncols=True)
        elapsed0, loop_start = self.state.elapsed_s, time.time()
        self.supervisor.start_chaos()
        try:
            done = self._train(stream, queued, observe, elapsed0, loop_start)
        except BaseException:
            self._close_logs_after_error()  # W&B run and the curve of what was trained, then the error
            raise
        finally:
            self.supervisor.stop_chaos()
            self.bar.close()
        return self._finish(done, started, elapsed0 + time.time() - loop_start)

    def _resume(self) -> tuple[list, int]:
        """The state of the checkpoint being resumed, loaded into the learner and the engines; the batches that
        waited at it and the data position after them."""
        self.logs.download()
        self.state = TrainerState.from_dict(self._load_resumed())
        self.loop.start_at(self.state.step)
        queued, position = self._waiting_at(storage.parent_of(self.resume_from))
        waiting = f", then the {len(queued)} batches grown before it stopped" if queued else ""
        print(f"resuming {self.run_dir} from {storage.name_of(self.resume_from)}: step {self.state.step}, data "
              f"position {self.state.data_position}{waiting}")
        return queued, position

    def _load_resumed(self) -> dict:
        """The trainer state of the checkpoint resumed, loaded into the learner. Under trainer.resume=auto, one the
        learner cannot read is passed over for the one before it, said; one named by trainer.resume must load."""
        while True:
            try:
                return self.supervisor.learner.load_checkpoint(self.resume_from)
            except LearnerLost:
                raise
            except Exception as err:  # noqa: BLE001 - the learner's own error reading a damaged checkpoint
                auto = self.cfg.trainer.resume == "auto"
                older = latest_checkpoint(self.run_dir, before=step_of(self.resume_from)) if auto else None
                if older is None:
                    raise
                report(f"{storage.name_of(self.resume_from)} cannot be read ({one_line(err)}); resuming from "
                       f"{storage.name_of(older)}, the checkpoint before it")
                self.resume_from = older

    def _waiting_at(self, run_dir: str) -> tuple[list, int]:
        """The batches that waited in the queue at the checkpoint of self.state, ready to train, and the prompt
        stream's position after them."""
        records = load_pending(run_dir, self.state.pending) if self.state.pending else []
        records = within_staleness(records, self.cfg.runtime.max_staleness)
        queued = [self.loop.builder.from_record(r) for r in records]
        return queued, (queued[-1].data_position if queued else self.state.data_position)

    def _start_logging(self) -> None:
        from treepo_ray.job.logs import RunLogger

        cfg = self.cfg
        self.logger = RunLogger(self.logs.local, cfg.log, config_io.to_dict(cfg), name=self.record.name,
                                resume_step=self.state.step, sinks=self.sinks, run_id=self.record.wandb_id)
        write_config(self.run_dir, config_io.to_dict(cfg), self.resume_from, self.state.step)

    def _train(self, stream: PromptStream, queued: list, observe, elapsed0: float, loop_start: float) -> int:
        """Steps up to trainer.steps (the loop runs ahead that far even when stop_after ends this invocation sooner,
        so the last checkpoint keeps the batches grown for the steps after it, as an interruption would), across
        learner restarts; returns the steps completed."""
        cfg, restarts = self.cfg, 0
        while True:
            steps = self.loop.steps(self.state.step, cfg.trainer.steps, stream, queued, cfg.trainer.eval_every,
                                    trees_logged=cfg.log.trees_per_step)
            try:
                with contextlib.closing(steps):
                    for batch, metrics in steps:
                        if not self._after_step(batch, metrics, observe, elapsed0, loop_start):
                            break
                return self.loop.version
            except LearnerLost as err:
                while True:  # the new learner can be lost while it is restored, too
                    if restarts >= cfg.runtime.faults.max_learner_restarts:
                        raise
                    restarts += 1
                    report(f"{err}; learner restart {restarts} of {cfg.runtime.faults.max_learner_restarts}")
                    try:
                        queued, position = self._restore_learner()
                        break
                    except LearnerLost as again:
                        err = again  # noqa: PLW2901 - the newest loss is the one to report
                stream = stream.rewound(position)  # the same prompts in the same order as before the loss

    def _restore_learner(self) -> tuple[list, int]:
        """A new learner group from the newest complete checkpoint (the base weights when there is none; run
        storage, so the new ranks may be on another node), the engines brought to exactly those weights. The
        trainer state goes back to that checkpoint's; the faults and counters of this invocation stay."""
        redone = self.loop.version
        self.supervisor.replace_learner()
        ckpt = latest_checkpoint(self.run_dir)
        restored = (TrainerState.from_dict(self.supervisor.learner.load_checkpoint(str(ckpt))) if ckpt is not None
                    else TrainerState())
        self.loop.start_at(restored.step)
        s = self.state
        s.step, s.data_position, s.trajectories, s.pending = (restored.step, restored.data_position,
                                                              restored.trajectories, restored.pending)
        redone -= restored.step
        self._count("fault/learner_restarts", 1)
        self._count("fault/steps_redone", redone)
        report(f"learner rebuilt from the checkpoint of step {s.step} (data position {s.data_position}); the "
               f"{redone} steps trained after it are trained again")
        self.bar.n = s.step
        self.bar.refresh()
        return self._waiting_at(self.run_dir)

    def _count(self, key: str, value: float) -> None:
        self.faults[key] = self.faults.get(key, 0.0) + value

    def _after_step(self, batch, metrics: dict, observe, elapsed0: float, loop_start: float) -> bool:
        """Log a trained step, and checkpoint it when due; False once this invocation's last step is done."""
        if self.lock.lost:  # another run took the run directory over (this one looked dead): stop before writing more
            raise RunStopped(self.lock.lost)
        step = batch.step + 1
        if observe is not None:
            observe(batch, metrics)
        for key, value in metrics.items():
            if key.startswith("fault/"):
                self._count(key, value)
            elif key.startswith("growth/"):
                self.counters[key[len("growth/"):]] = self.counters.get(key[len("growth/"):], 0.0) + value
        self.state.trajectories += int(metrics.get("rollout/trajectories", 0))
        line = self.logger.log(step, metrics)
        if self.cfg.log.trees_per_step:  # a step that trained on nothing (all rewards equal) logs its trees too
            self.logger.save_trees(step, batch.trees)
        if self.logger.write_error:  # its lines are kept, and written with the next ones
            self._storage_failed(self.logger.write_error)
            self.logger.write_error = ""
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{metrics.get('critic/score/mean', float('nan')):.3f}",
                             stale=int(metrics["perf/staleness"]))
        if line:
            self.bar.write(line)
        tr = self.cfg.trainer
        retry = self.storage_failing_since is not None  # a write failed: tried again at every step
        if step == self.end or (tr.save_every and step % tr.save_every == 0) or retry:
            self._save_or_retry(step, batch.data_position, elapsed0 + time.time() - loop_start)
        self.supervisor.after_step(step)
        return step < self.end

    def _save_or_retry(self, step: int, data_position: int, elapsed_s: float) -> None:
        """A checkpoint of `step`. On the last step of this invocation there is no next step to try again at: it is
        tried again here until it is written or trainer.storage_retry_s has passed (the run stops)."""
        while not self._save(step, data_position, elapsed_s) and step == self.end:
            time.sleep(min(30.0, self.cfg.trainer.storage_retry_s / 10))

    def _save(self, step: int, data_position: int, elapsed_s: float) -> bool:
        """A checkpoint of `step`; False when it could not be written. The log lines kept from failed writes go first
        (a checkpoint never gets ahead of its logs). Batches already grown for the next steps are saved with it: a
        resumed run trains them as they were grown instead of growing them again with newer weights (the file is
        written before the checkpoint that names it: a checkpoint that is not written leaves it behind, for
        prune_run). A failed write is a storage failure (`_storage_failed`): the previous checkpoint is intact."""
        s = self.state
        s.step, s.data_position, s.elapsed_s = step, data_position, elapsed_s
        directory = str(checkpoint_dir(self.run_dir, step))
        try:
            self.logger.flush()
            waiting = self.loop.waiting()
            s.pending = save_pending(self.run_dir, step, [b.to_record() for b in waiting]) if waiting else None
            self.supervisor.learner.save_checkpoint(directory, s.to_dict())
        except LearnerLost:
            raise
        except Exception as err:  # noqa: BLE001 - run storage (a full disk, an object store away); not the learner
            self._storage_failed(f"checkpoint {storage.name_of(directory)} not written: {one_line(err)}")
            return False
        self.storage_failing_since = None
        try:  # the checkpoint is written: what is left is tidying, tried again after the next one
            prune_run(self.run_dir, self.cfg.trainer.keep_checkpoints)
            self.logs.upload()
        except OSError as err:
            self._count("fault/storage_errors", 1)
            report(f"after checkpoint {storage.name_of(directory)}: {err}; tried again after the next checkpoint")
        return True

    def _storage_failed(self, what: str) -> None:
        """A write to run storage failed (`what`: which, and why): said and counted (fault/storage_errors), and tried
        again at the next step. Once run storage has failed for trainer.storage_retry_s with no checkpoint going
        through, the run stops with one line (trainer.resume=auto continues from the newest checkpoint written)."""
        now, limit = time.monotonic(), self.cfg.trainer.storage_retry_s
        if self.storage_failing_since is None:
            self.storage_failing_since = now
        self._count("fault/storage_errors", 1)
        failing = now - self.storage_failing_since
        if failing >= limit:
            raise RunStopped(f"run storage has failed for {failing:.0f}s with no checkpoint written "
                             f"(trainer.storage_retry_s = {limit:g}): {what}")
        report(f"{what}; tried again at the next step (the run stops if run storage still fails "
               f"{limit - failing:.0f}s from now)")

    def _close_logs_after_error(self) -> None:
        """Close the logger (W&B, the curve) and upload the logs as far as run storage lets, so that the error that
        stopped the run is the one raised."""
        try:
            self.logger.close()
            self.logs.upload()
        except OSError as err:
            report(f"the logs could not be closed or uploaded: {err}")

    def _finish(self, done: int, started: float, train_s: float) -> dict:
        """The final evaluation and the run's summary (logged, written to summary.json and printed)."""
        cfg, tr = self.cfg, self.cfg.trainer
        for key, value in self.supervisor.fault_metrics().items():  # events after the last step's metrics
            if key.startswith("fault/"):
                self._count(key, value)
        completed = done >= tr.steps
        summary = {"algorithm": cfg.algo.name, "steps": done, "completed": completed, "run_dir": self.run_dir,
                   "max_staleness": cfg.runtime.max_staleness, "wall_time_s": time.time() - started,
                   "train_time_s": train_s, "trajectories": self.state.trajectories,
                   "trajectories_per_s": self.state.trajectories / max(train_s, 1e-9),
                   "eval_method": self.evaluator.method, "eval_problems": len(self.evaluator.problems),
                   "faults": self.faults, "tree_counters": self.counters, "pool_size": self.supervisor.pool.size,
                   "wandb_run_id": self.record.wandb_id}
        base = self.state.base_eval.get("eval/accuracy")
        summary["base_accuracy"], summary["base_accuracy_se"] = base, self.state.base_eval.get("eval/accuracy_se")
        if completed and self.evaluator.problems:
            self.loop.sync_engines()  # the weights published after the last step
            final = self.evaluator.evaluate()
            self.logger.log(done, final)
            summary["final_accuracy"] = final["eval/accuracy"]
            summary["final_accuracy_se"] = final["eval/accuracy_se"]
            summary["improvement_points"] = 100 * (final["eval/accuracy"] - base) if base is not None else None
            if base is not None and summary["base_accuracy_se"] is not None:  # the two evaluations' errors add
                summary["improvement_se_points"] = 100 * math.hypot(summary["base_accuracy_se"],
                                                                    final["eval/accuracy_se"])
        self.logger.summary({f"summary/{k}": v for k, v in summary.items() if isinstance(v, (int, float))})
        curve = self.logger.close()
        summary["training_curve"] = str(curve) if curve else None
        (self.logs.local / "summary.json").write_text(json.dumps(summary, indent=2))
        self.logs.upload()
        print(format_summary(summary))
        return summary


def one_line(err: BaseException) -> str:
    """An error as one line: the error an actor raised, not Ray's wrapper around it (which carries a traceback)."""
    cause = getattr(err, "cause", None)  # ray.exceptions.RayTaskError's original error
    text = str(cause if isinstance(cause, BaseException) else err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def within_staleness(records: list[dict], max_staleness: int) -> list[dict]:
    """The waiting batches a resumed run trains as they were saved: those whose weights are at most `max_staleness`
    versions behind their step (a run resumed with a smaller runtime.max_staleness than it saved them under). The
    first one over the bound and every one after it (the stream continues from the last one kept) are grown again
    with the current weights, said in one line."""
    for k, record in enumerate(records):
        if record["step"] - record["version"] > max_staleness:
            print(f"resume: the {len(records) - k} batches saved for steps {record['step']}-{records[-1]['step']} are "
                  f"grown again: batch {record['step']} was grown by weights {record['step'] - record['version']} "
                  f"versions behind, more than runtime.max_staleness = {max_staleness}", flush=True)
            return records[:k]
    return records


def format_summary(s: dict) -> str:
    # train_time_s counts the steps; wall_time_s also the start (Ray, base model, base evaluation) before them
    lines = [f"== {s['algorithm']}: {s['steps']} steps in {s['train_time_s']:.0f}s of training "
             f"({s['trajectories_per_s']:.1f} trajectories/s, max_staleness {s['max_staleness']}), "
             f"{s['wall_time_s']:.0f}s since the job started"]
    if s.get("base_accuracy") is not None:
        lines.append(f"   held-out accuracy ({s['eval_problems']} problems, {s['eval_method']}): base {s['base_accuracy']:.3f}"
                     + (f" (SE {s['base_accuracy_se']:.3f})" if s.get("base_accuracy_se") is not None else "")
                     + (f" -> final {s['final_accuracy']:.3f} ({s['improvement_points']:+.1f} points"
                        + (f", SE {s['improvement_se_points']:.1f})" if s.get("improvement_se_points") is not None
                           else ")")
                        if s.get("final_accuracy") is not None else ""))
    if s.get("tree_counters"):
        lines.append("   tree growth: " + ", ".join(f"{k} {v:.0f}" for k, v in s["tree_counters"].items()))
    lines.append(f"   run directory: {s['run_dir']} (summary.json, metrics.jsonl, trees.jsonl, samples.jsonl, "
                 f"training_curve.png)")
    return "\n".join(lines)
