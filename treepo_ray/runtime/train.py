"""`treepo-ray train [config.yaml] [key.sub=value ...]`: the RL training job on Ray.

With no arguments it runs jobs/configs/cpu.yaml: local Ray on this machine's CPUs, the tiny base model and the
synthetic task, TreePO; `algo.name=grpo` runs the baseline the same way. It evaluates the base model and the final
policy on held-out problems (pass@1: the mean accuracy of trainer.eval_samples answers per problem sampled at
trainer.eval_temperature, 4 at 1.0 by default; eval_temperature=0 decodes greedily), and writes
`<run_dir>/summary.json`.

The run directory lives in run storage (trainer.storage_path: a local or shared path, or an object store), which every
node reaches: the learner ranks write checkpoints there, this driver lists, prunes and restores from there
(job/rundir.py: the lock, the run record, which run `resume=auto` continues). A driver killed at any moment (even by
SIGKILL) is resumed with `trainer.resume=auto`: the same step, data position and W&B run, and the batches that were
waiting for the learner at the checkpoint are trained as they were grown.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass

from treepo_ray import config as config_io
from treepo_ray import storage
from treepo_ray.data.prompts import Prompt, PromptStream
from treepo_ray.job.config import TrainConfig, parse_config, print_config
from treepo_ray.job.inputs import check_inputs, load_prompts, resolve_model
from treepo_ray.job.rundir import (LogMirror, RunLock, RunRecord, prune_run, resolve_run, save_pending,
                                   write_config)
from treepo_ray.job.state import TrainerState


def init_ray(cfg: TrainConfig) -> None:
    """Join the configured cluster (runtime.address or RAY_ADDRESS), else start a local Ray; reuse a live one."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    if ray.is_initialized():
        return
    address = cfg.runtime.address or os.environ.get("RAY_ADDRESS") or None
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(num_cpus=cfg.runtime.num_cpus or os.cpu_count(), include_dashboard=None)




@dataclass
class Job:
    """What every run of the pipeline starts from (the training job, and the benchmarks that run it)."""

    cfg: TrainConfig
    model_path: str
    tokenizer: object
    train_set: list[Prompt]
    test_set: list[Prompt]
    """Held-out prompts, at most trainer.eval_size of them."""


def set_up(cfg: TrainConfig) -> Job:
    """The model (the tiny base model is built first, before Ray: it uses every core), its tokenizer, the task's
    prompts, and Ray (a local one unless the config names a cluster). A mistake in the inputs is a UserError before
    anything slow starts."""
    from transformers import AutoTokenizer

    check_inputs(cfg)
    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_set, test_set = load_prompts(cfg, model_path, tokenizer)
    init_ray(cfg)
    return Job(cfg, model_path, tokenizer, train_set, test_set[: cfg.trainer.eval_size])


METRIC_TAGS = ("run", "algorithm")
"""Tags of every Ray metric, so that runs sharing a cluster (`cluster/submit.sh all`) stay separate series."""


def gauge_name(key: str) -> str:
    """The Ray metric of a metric key: `treepo_` + the key with every character outside [a-zA-Z0-9_] as `_`
    (Prometheus names; Ray's exporter adds its own `ray_` prefix: critic/score/mean -> ray_treepo_critic_score_mean)."""
    return "treepo_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def ray_gauges(run: str, algorithm: str):
    """A RunLogger sink exporting each metric as a ray.util.metrics Gauge tagged with the run and the algorithm."""
    from ray.util.metrics import Gauge

    gauges: dict = {}
    tags = {"run": run, "algorithm": algorithm}

    def sink(step: int, values: dict) -> None:
        for key, v in values.items():
            name = gauge_name(key)
            if name not in gauges:
                gauges[name] = Gauge(name, description=key, tag_keys=METRIC_TAGS)
                gauges[name].set_default_tags(tags)
            gauges[name].set(v)

    return sink


def _sees(_actor, location: str) -> tuple[bool, str]:
    import ray

    return storage.exists(location), ray.util.get_node_ip_address()


def check_storage_shared(run_dir: str, actors: list, timeout_s: float) -> None:
    """Stop at once, saying why, when the run storage is not one place for every node: the driver writes a file into
    the run directory and every actor given (the learner ranks, which write the checkpoints) must see it. A local
    path that is not a shared mount fails here on a multi-node cluster, instead of a lost learner later restarting
    from the base weights because its checkpoints are on another node's disk."""
    from treepo_ray.runtime.liveness import get

    probe = storage.join(run_dir, f".storage-probe-{os.getpid()}")
    storage.write_text(probe, "")
    try:
        seen = get([a.__ray_call__.remote(_sees, probe) for a in actors], timeout_s, "checking the run storage")
    finally:
        storage.delete(probe)
    blind = [f"learner rank {i} (node {node})" for i, (ok, node) in enumerate(seen) if not ok]
    if blind:
        raise RuntimeError(f"the run storage {run_dir} is not reachable from {', '.join(blind)}: every node must see "
                           "trainer.storage_path at the same path (a shared mount: cluster/README.md) or use an "
                           "s3:// or gs:// URI")


def run(cfg: TrainConfig, observe=None) -> dict:
    """Train as configured; returns (and writes to <run_dir>/summary.json) the run's summary. `observe(batch,
    metrics)`, if given, sees every trained step (the chaos benchmark compares runs with it)."""
    started = time.time()
    from treepo_ray.runtime.pipeline import Pipeline

    run_dir, resume_from = resolve_run(cfg)
    with contextlib.ExitStack() as cleanup:
        # One run per run directory: a second one is refused here, before any work, naming the holder.
        lock = RunLock(run_dir, storage.name_of(run_dir), cfg.trainer.lock_stale_s).acquire()
        cleanup.callback(lock.release)
        job = set_up(cfg)
        pipe = Pipeline(cfg, job.model_path, job.tokenizer)
        cleanup.callback(pipe.shutdown)
        check_storage_shared(run_dir, pipe.learner.ranks, cfg.runtime.deadlines.call_s)
        return _train(cfg, job, pipe, run_dir, resume_from, lock, observe, started)


def _train(cfg: TrainConfig, job: Job, pipe, run_dir: str, resume_from: str | None, lock: RunLock, observe,
           started: float) -> dict:
    from tqdm import tqdm

    from treepo_ray.job.logs import RunLogger
    from treepo_ray.learner import checkpoint_dir
    from treepo_ray.runtime.recovery import resume_point, save_checkpoint_or_report, train_with_recovery

    test_set = job.test_set
    tr = cfg.trainer
    eval_args = dict(max_new_tokens=tr.eval_max_new_tokens or cfg.sampler_config.response_limit(),
                     samples=tr.eval_samples, temperature=tr.eval_temperature)
    eval_method = (f"pass@1, mean of {tr.eval_samples} samples per problem at temperature {tr.eval_temperature}"
                   if tr.eval_temperature > 0 else "greedy decoding, one answer per problem")
    record = RunRecord.load_or_create(run_dir)
    logs = LogMirror(run_dir, cfg.model.cache_dir)  # the logger's folder (a local copy when run_dir is a URI)
    state, queued, position = TrainerState(seed=tr.seed), [], 0
    if resume_from is not None:
        logs.download()
        state = TrainerState.from_dict(pipe.learner.load_checkpoint(resume_from))
        queued, position = resume_point(pipe, storage.parent_of(resume_from), state)  # its pending file is beside it
        waiting = f", then the {len(queued)} batches grown before it stopped" if queued else ""
        print(f"resuming {run_dir} from {storage.name_of(resume_from)}: step {state.step}, data position "
              f"{state.data_position}{waiting}")
    start = state.step
    logger = RunLogger(logs.local, cfg.log, config_io.to_dict(cfg), name=record.name, resume_step=start,
                       sinks=[ray_gauges(record.name, cfg.algo.name)] if cfg.log.ray_metrics else [],
                       run_id=record.wandb_id)
    write_config(run_dir, config_io.to_dict(cfg), resume_from, start)
    if start:  # the engines were built from the base model; bring them to the checkpoint's weights
        pipe.learner.publish(start)
        pipe.sync_weights(start)
    if state.base_eval is None:
        state.base_eval = pipe.evaluate(test_set, **eval_args)
        if state.base_eval:
            print(f"base model: held-out accuracy {state.base_eval['eval/accuracy']:.3f} "
                  f"on {len(test_set)} problems ({eval_method})")
            logger.log(0, state.base_eval)

    stream = PromptStream(job.train_set, tr.seed, cfg.data.shuffle, position=position)
    end = tr.steps if not tr.stop_after else min(tr.steps, start + tr.stop_after)
    bar = tqdm(total=tr.steps, initial=start, desc=f"{cfg.algo.name} train", unit="step", dynamic_ncols=True)
    pipe.eval_set, pipe.eval_args = test_set, eval_args
    elapsed0, loop_start = state.elapsed_s, time.time()

    faults: dict[str, float] = {}  # fault/* totals of this invocation (not rewound by a learner restart)
    counters: dict[str, float] = {}  # growth/* totals of this invocation: what the tree growers did

    def save(step: int, data_position: int) -> None:
        state.step, state.data_position = step, data_position
        state.elapsed_s = elapsed0 + time.time() - loop_start
        # Batches already grown for the next steps are saved with the checkpoint: a resumed run trains them as they
        # were grown instead of growing them again with newer weights. The file is written before the checkpoint
        # that names it (a checkpoint that is not written leaves it behind, for prune_run).
        waiting = pipe.queued_batches()
        state.pending = save_pending(run_dir, step, [b.to_record() for b in waiting]) if waiting else None
        error = save_checkpoint_or_report(pipe.learner, checkpoint_dir(run_dir, step), state.to_dict())
        if error:  # e.g. a full disk: the previous checkpoint is intact, training goes on (counted in fault/*)
            pipe.pool.registry.record.remote("checkpoint_errors", error)
            return
        prune_run(run_dir, tr.keep_checkpoints)
        logs.upload()

    def on_restart(restored: TrainerState, error: BaseException, redone: int) -> None:
        # trajectories and data position as of the checkpoint the learner restarts from
        state.step, state.data_position, state.trajectories = (restored.step, restored.data_position,
                                                               restored.trajectories)
        faults["fault/steps_redone"] = faults.get("fault/steps_redone", 0.0) + redone
        bar.n = restored.step
        bar.refresh()

    def on_step(batch, metrics: dict) -> bool:
        if lock.lost:  # another run took the run directory over (this one looked dead): stop before writing more
            raise RuntimeError(lock.lost)
        step = batch.step + 1
        if observe is not None:
            observe(batch, metrics)
        for key, value in metrics.items():
            if key.startswith("fault/"):
                faults[key] = faults.get(key, 0.0) + value
            elif key.startswith("growth/"):
                counters[key[len("growth/"):]] = counters.get(key[len("growth/"):], 0.0) + value
        state.trajectories += int(metrics.get("rollout/trajectories", 0))
        line = logger.log(step, metrics)
        if cfg.log.trees_per_step:
            logger.save_trees(step, batch.trees)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics.get('critic/score/mean', float('nan')):.3f}",
                        stale=int(metrics["perf/staleness"]))
        if line:
            bar.write(line)
        if step == end or (tr.save_every and step % tr.save_every == 0):
            save(step, batch.data_position)
        return step < end

    try:
        # A lost learner is rebuilt from the newest checkpoint and training goes on from there (recovery.py). The
        # producer runs ahead as far as trainer.steps even when stop_after ends this invocation earlier, so that
        # the last checkpoint keeps the batches grown for the steps after it, as an interruption would.
        done = train_with_recovery(pipe, start, tr.steps, stream, on_step, run_dir, on_restart, queued=queued,
                                   trees_per_step=cfg.log.trees_per_step, eval_every=tr.eval_every)
    except BaseException:
        logger.close()  # W&B run and the curve of what was trained, then the error
        logs.upload()
        raise
    finally:
        bar.close()
    for key, value in pipe.fault_metrics().items():  # events after the last step's metrics were taken
        if key.startswith("fault/"):
            faults[key] = faults.get(key, 0.0) + value
    loop_s = time.time() - loop_start
    completed = done >= tr.steps
    summary = {"algorithm": cfg.algo.name, "steps": done, "completed": completed, "run_dir": run_dir,
               "max_staleness": cfg.runtime.max_staleness, "wall_time_s": time.time() - started,
               "train_time_s": elapsed0 + loop_s,
               "trajectories": state.trajectories,
               "eval_method": eval_method, "eval_problems": len(test_set),
               "faults": faults, "tree_counters": counters, "pool_size": pipe.pool.size,
               "wandb_run_id": record.wandb_id}
    summary["trajectories_per_s"] = state.trajectories / max(summary["train_time_s"], 1e-9)
    base = state.base_eval.get("eval/accuracy")
    summary["base_accuracy"] = base
    if completed and test_set:
        pipe.sync_weights(done)  # the consumer published the final weights after the last step
        final = pipe.evaluate(test_set, **eval_args)
        logger.log(done, final)
        summary["final_accuracy"] = final["eval/accuracy"]
        summary["improvement_points"] = 100 * (final["eval/accuracy"] - base) if base is not None else None
    logger.summary({f"summary/{k}": v for k, v in summary.items() if isinstance(v, (int, float))})
    curve = logger.close()
    summary["training_curve"] = str(curve) if curve else None
    (logs.local / "summary.json").write_text(json.dumps(summary, indent=2))
    logs.upload()
    print(format_summary(summary))
    return summary


def format_summary(s: dict) -> str:
    # train_time_s counts the steps; wall_time_s also the start (Ray, base model, base evaluation) before them
    lines = [f"== {s['algorithm']}: {s['steps']} steps in {s['train_time_s']:.0f}s of training "
             f"({s['trajectories_per_s']:.1f} trajectories/s, max_staleness {s['max_staleness']}), "
             f"{s['wall_time_s']:.0f}s since the job started"]
    if s.get("base_accuracy") is not None:
        lines.append(f"   held-out accuracy ({s['eval_problems']} problems, {s['eval_method']}): base {s['base_accuracy']:.3f}"
                     + (f" -> final {s['final_accuracy']:.3f} ({s['improvement_points']:+.1f} points)"
                        if s.get("final_accuracy") is not None else ""))
    if s.get("tree_counters"):
        lines.append("   tree growth: " + ", ".join(f"{k} {v:.0f}" for k, v in s["tree_counters"].items()))
    lines.append(f"   run directory: {s['run_dir']} (summary.json, metrics.jsonl, trees.jsonl, training_curve.png)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("usage: treepo-ray train [config.yaml] [key.sub=value ...]   (default config: jobs/configs/cpu.yaml)")
        return 0
    cfg = parse_config(argv, "train")
    print_config(cfg)
    summary = run(cfg)  # a run directory held by a live run, or of another config, is a UserError (RunDirError)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
