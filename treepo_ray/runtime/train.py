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
import sys
import time
from pathlib import Path

from treepo_ray import config as config_io
from treepo_ray.runtime.config import DEFAULT_CONFIG, TrainConfig, load_config


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


def load_task(cfg: TrainConfig, tokenizer) -> tuple[list[dict], list[dict]]:
    """Training and held-out records {id, prompt_text, prompt_ids, ground_truth, data_source}."""
    from treepo_ray.data import load_records

    return load_records(cfg.data, tokenizer, cache_dir=cfg.model.cache_dir, cfg=cfg.data.prompt)


def resolve_model(cfg: TrainConfig) -> str:
    if cfg.model.path:
        if not Path(cfg.model.path).is_dir():
            raise ValueError(f"model.path = {cfg.model.path!r} is not a model directory")
        return cfg.model.path
    from treepo_ray.data import prepare_base_model

    return str(prepare_base_model(cfg.model.cache_dir, seed=cfg.data.seed))


def run(cfg: TrainConfig) -> dict:
    """Train as configured; returns (and writes to <run_dir>/summary.json) the run's summary."""
    if abs(cfg.learner.temperature - cfg.rollout.temperature) > 1e-9:
        raise ValueError(f"learner.temperature = {cfg.learner.temperature} but rollout.temperature = "
                         f"{cfg.rollout.temperature}; the learner's log-probs must use the sampling temperature")
    started = time.time()
    from transformers import AutoTokenizer
    from tqdm import tqdm

    from treepo_ray.learner import checkpoint_dir, prune_checkpoints
    from treepo_ray.runtime.faults import save_checkpoint_or_report, train_with_restarts
    from treepo_ray.runtime.logs import RunLogger
    from treepo_ray.runtime.pipeline import Pipeline, PromptStream

    model_path = resolve_model(cfg)  # before Ray: building the base model uses every core
    run_dir, resume_from = resolve_run_dir(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_set, test_set = load_task(cfg, tokenizer)
    test_set = test_set[: cfg.trainer.eval_size]
    init_ray(cfg)
    tr = cfg.trainer
    eval_args = dict(max_new_tokens=tr.eval_max_new_tokens or cfg.sampler_config.response_limit(),
                     samples=tr.eval_samples, temperature=tr.eval_temperature)
    eval_method = (f"pass@1, mean of {tr.eval_samples} samples per problem at temperature {tr.eval_temperature}"
                   if tr.eval_temperature > 0 else "greedy decoding, one answer per problem")

    pipe = Pipeline(cfg, model_path, tokenizer)
    state: dict = {"step": 0, "data_position": 0, "elapsed_s": 0.0, "trajectories": 0}
    if resume_from is not None:
        state.update(pipe.learner.load_checkpoint(str(resume_from)))
        print(f"resuming {run_dir} from {resume_from.name}: step {state['step']}, "
              f"data position {state['data_position']}")
    start = state["step"]
    logger = RunLogger(run_dir, cfg.log, config_io.to_dict(cfg), name=run_dir.name, resume_step=start)
    (run_dir / "config.yaml").write_text(__import__("yaml").safe_dump(config_io.to_dict(cfg), sort_keys=False))
    if start:  # the engines were built from the base model; bring them to the checkpoint's weights
        pipe.publish(start)
        pipe.sync_weights(start)
    if "base_eval" not in state:
        state["base_eval"] = pipe.evaluate(test_set, **eval_args)
        if state["base_eval"]:
            print(f"base model: held-out accuracy {state['base_eval']['eval/accuracy']:.3f} "
                  f"on {len(test_set)} problems ({eval_method})")
            logger.log(0, state["base_eval"])

    stream = PromptStream(train_set, tr.seed, cfg.data.shuffle, position=state["data_position"])
    end = tr.steps if not tr.stop_after else min(tr.steps, start + tr.stop_after)
    bar = tqdm(total=tr.steps, initial=start, desc=f"{cfg.algo.name} train", unit="step", dynamic_ncols=True)
    pipe.eval_set, pipe.eval_args = test_set, eval_args
    elapsed0, loop_start = state["elapsed_s"], time.time()

    faults: dict[str, float] = {}  # fault/* totals of this invocation (not rewound by a learner restart)

    def save(step: int, data_position: int) -> None:
        state.update(step=step, data_position=data_position, elapsed_s=elapsed0 + time.time() - loop_start)
        error = save_checkpoint_or_report(pipe.learner, checkpoint_dir(run_dir, step), dict(state, seed=tr.seed))
        if error:  # e.g. a full disk: the previous checkpoint is intact, training goes on (counted in fault/*)
            pipe.generators.registry.record.remote("checkpoint_errors", error)
            return
        prune_checkpoints(run_dir, tr.keep_checkpoints)

    def on_restart(restored: dict, error: BaseException, redone: int) -> None:
        state.update(restored)  # trajectories and data position as of the checkpoint the learner restarts from
        faults["fault/steps_redone"] = faults.get("fault/steps_redone", 0.0) + redone
        bar.n = int(restored["step"])
        bar.refresh()

    def on_step(batch, metrics: dict) -> bool:
        step = batch.step + 1
        for key, value in metrics.items():
            if key.startswith("fault/"):
                faults[key] = faults.get(key, 0.0) + value
        state["trajectories"] += int(metrics.get("rollout/trajectories", 0))
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
        # A lost learner is rebuilt from the newest checkpoint and training goes on from there (faults.py).
        done = train_with_restarts(pipe, start, end, stream, on_step, run_dir, on_restart,
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
               "trajectories": state["trajectories"],
               "eval_method": eval_method, "eval_problems": len(test_set),
               "faults": faults, "pool_size": pipe.generators.size}
    summary["trajectories_per_s"] = state["trajectories"] / max(summary["train_time_s"], 1e-9)
    base = state["base_eval"].get("eval/accuracy")
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
