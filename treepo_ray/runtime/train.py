"""`treepo-ray train [config.yaml] [key.sub=value ...]`: the RL training job on Ray.

With no arguments it runs jobs/configs/cpu.yaml: local Ray on this machine's CPUs, the tiny base model and the
synthetic task, TreePO; `algo.name=grpo` runs the baseline the same way. It evaluates the base model and the final
policy on held-out problems (pass@1: the mean accuracy of trainer.eval_samples answers per problem sampled at
trainer.eval_temperature, 4 at 1.0 by default; eval_temperature=0 decodes greedily), and writes
`<run_dir>/summary.json`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from treepo_ray import config as config_io
from treepo_ray.data.prompts import Prompt, PromptStream
from treepo_ray.job.config import DEFAULT_CONFIG, TrainConfig, load_config
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


def resolve_run_dir(cfg: TrainConfig) -> tuple[Path, Path | None]:
    """The run directory and the checkpoint to resume from (None for a fresh run)."""
    from treepo_ray.learner import latest_checkpoint

    resume, run_dir = cfg.trainer.resume, cfg.trainer.run_dir
    if resume not in ("", "auto"):
        ckpt = Path(resume)
        return Path(run_dir) if run_dir else ckpt.parent, ckpt
    if not run_dir:
        if resume == "auto":  # the newest run of this algorithm that has a checkpoint
            runs = sorted(Path("runs").glob(f"{cfg.algo.name}-*"), key=lambda p: p.stat().st_mtime)
            for candidate in reversed(runs):
                if latest_checkpoint(candidate) is not None:
                    return candidate, latest_checkpoint(candidate)
        run_dir = f"runs/{cfg.algo.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = Path(run_dir)
    return run_dir, (latest_checkpoint(run_dir) if resume == "auto" else None)


def resolve_model(cfg: TrainConfig) -> str:
    if cfg.model.path:
        if not Path(cfg.model.path).is_dir():
            raise ValueError(f"model.path = {cfg.model.path!r} is not a model directory")
        return cfg.model.path
    from treepo_ray.data.pretrain import base_model_config, prepare_base_model

    return str(prepare_base_model(cfg.model.cache_dir, seed=cfg.data.seed, cfg=base_model_config(cfg.data.name)))


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
    prompts, and Ray (a local one unless the config names a cluster)."""
    from transformers import AutoTokenizer

    from treepo_ray.data.datasets import load_records

    if abs(cfg.learner.temperature - cfg.rollout.temperature) > 1e-9:
        raise ValueError(f"learner.temperature = {cfg.learner.temperature} but rollout.temperature = "
                         f"{cfg.rollout.temperature}; the learner's log-probs must use the sampling temperature")
    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_set, test_set = load_records(cfg.data, tokenizer, cache_dir=cfg.model.cache_dir, cfg=cfg.data.prompt)
    init_ray(cfg)
    return Job(cfg, model_path, tokenizer, train_set, test_set[: cfg.trainer.eval_size])


def ray_gauges():
    """A RunLogger sink exporting each metric as a ray.util.metrics Gauge (visible on the Ray dashboard)."""
    from ray.util.metrics import Gauge

    gauges: dict = {}

    def sink(values: dict) -> None:
        for key, v in values.items():
            name = "treepo_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)  # Prometheus names: [a-zA-Z_][a-zA-Z0-9_]*
            if name not in gauges:
                gauges[name] = Gauge(name, description=key)
            gauges[name].set(v)

    return sink


def run(cfg: TrainConfig) -> dict:
    """Train as configured; returns (and writes to <run_dir>/summary.json) the run's summary."""
    started = time.time()
    from tqdm import tqdm

    from treepo_ray.job.logs import RunLogger
    from treepo_ray.learner import checkpoint_dir, prune_checkpoints
    from treepo_ray.runtime.pipeline import Pipeline
    from treepo_ray.runtime.recovery import save_checkpoint_or_report, train_with_recovery

    job = set_up(cfg)
    run_dir, resume_from = resolve_run_dir(cfg)
    test_set = job.test_set
    tr = cfg.trainer
    eval_args = dict(max_new_tokens=tr.eval_max_new_tokens or cfg.sampler_config.response_limit(),
                     samples=tr.eval_samples, temperature=tr.eval_temperature)
    eval_method = (f"pass@1, mean of {tr.eval_samples} samples per problem at temperature {tr.eval_temperature}"
                   if tr.eval_temperature > 0 else "greedy decoding, one answer per problem")

    pipe = Pipeline(cfg, job.model_path, job.tokenizer)
    state = TrainerState(seed=tr.seed)
    if resume_from is not None:
        state = TrainerState.from_dict(pipe.learner.load_checkpoint(str(resume_from)))
        print(f"resuming {run_dir} from {resume_from.name}: step {state.step}, data position {state.data_position}")
    start = state.step
    logger = RunLogger(run_dir, cfg.log, config_io.to_dict(cfg), name=run_dir.name, resume_step=start,
                       sinks=[ray_gauges()] if cfg.log.ray_metrics else [])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config_io.to_dict(cfg), sort_keys=False))
    if start:  # the engines were built from the base model; bring them to the checkpoint's weights
        pipe.learner.publish(start)
        pipe.sync_weights(start)
    if state.base_eval is None:
        state.base_eval = pipe.evaluate(test_set, **eval_args)
        if state.base_eval:
            print(f"base model: held-out accuracy {state.base_eval['eval/accuracy']:.3f} "
                  f"on {len(test_set)} problems ({eval_method})")
            logger.log(0, state.base_eval)

    stream = PromptStream(job.train_set, tr.seed, cfg.data.shuffle, position=state.data_position)
    end = tr.steps if not tr.stop_after else min(tr.steps, start + tr.stop_after)
    bar = tqdm(total=tr.steps, initial=start, desc=f"{cfg.algo.name} train", unit="step", dynamic_ncols=True)
    pipe.eval_set, pipe.eval_args = test_set, eval_args
    elapsed0, loop_start = state.elapsed_s, time.time()

    faults: dict[str, float] = {}  # fault/* totals of this invocation (not rewound by a learner restart)
    counters: dict[str, float] = {}  # growth/* totals of this invocation: what the tree growers did

    def save(step: int, data_position: int) -> None:
        state.step, state.data_position = step, data_position
        state.elapsed_s = elapsed0 + time.time() - loop_start
        error = save_checkpoint_or_report(pipe.learner, checkpoint_dir(run_dir, step), state.to_dict())
        if error:  # e.g. a full disk: the previous checkpoint is intact, training goes on (counted in fault/*)
            pipe.pool.registry.record.remote("checkpoint_errors", error)
            return
        prune_checkpoints(run_dir, tr.keep_checkpoints)

    def on_restart(restored: TrainerState, error: BaseException, redone: int) -> None:
        # trajectories and data position as of the checkpoint the learner restarts from
        state.step, state.data_position, state.trajectories = (restored.step, restored.data_position,
                                                               restored.trajectories)
        faults["fault/steps_redone"] = faults.get("fault/steps_redone", 0.0) + redone
        bar.n = restored.step
        bar.refresh()

    def on_step(batch, metrics: dict) -> bool:
        step = batch.step + 1
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
        bar.set_postfix(reward=f"{metrics.get('rollout/reward', float('nan')):.3f}",
                        stale=int(metrics["perf/staleness"]))
        if line:
            bar.write(line)
        if step == end or (tr.save_every and step % tr.save_every == 0):
            save(step, batch.data_position)
        return True

    try:
        # A lost learner is rebuilt from the newest checkpoint and training goes on from there (recovery.py).
        done = train_with_recovery(pipe, start, end, stream, on_step, run_dir, on_restart,
                                   trees_per_step=cfg.log.trees_per_step, eval_every=tr.eval_every)
    except BaseException:
        logger.close()  # W&B run and the curve of what was trained, then the error
        raise
    finally:
        bar.close()
    for key, value in pipe.fault_metrics().items():  # events after the last step's metrics were taken
        if key.startswith("fault/"):
            faults[key] = faults.get(key, 0.0) + value
    loop_s = time.time() - loop_start
    completed = done >= tr.steps
    summary = {"algorithm": cfg.algo.name, "steps": done, "completed": completed, "run_dir": str(run_dir),
               "max_staleness": cfg.runtime.max_staleness, "wall_time_s": time.time() - started,
               "train_time_s": elapsed0 + loop_s,
               "trajectories": state.trajectories,
               "eval_method": eval_method, "eval_problems": len(test_set),
               "faults": faults, "tree_counters": counters, "pool_size": pipe.pool.size}
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
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(format_summary(summary))
    return summary


def format_summary(s: dict) -> str:
    lines = [f"== {s['algorithm']}: {s['steps']} steps in {s['wall_time_s']:.0f}s "
             f"({s['trajectories_per_s']:.1f} trajectories/s, max_staleness {s['max_staleness']})"]
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
    path: Path = DEFAULT_CONFIG
    if argv and "=" not in argv[0]:
        path, argv = Path(argv[0]), argv[1:]
    if not path.is_file():
        print(f"treepo-ray train: config file {path} does not exist", file=sys.stderr)
        return 2
    try:
        cfg = load_config(path, argv)
    except ValueError as err:
        print(f"treepo-ray train: {err}", file=sys.stderr)
        return 2
    summary = run(cfg)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
