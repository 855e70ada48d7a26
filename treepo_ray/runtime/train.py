"""`treepo-ray train [config.yaml | NAME] [key.sub=value ...]`: the RL training job on Ray.

A config is a YAML file's path or the name of one the package ships (treepo_ray/configs/, also jobs/configs/ in the
checkout): `treepo-ray train treepo_paper`. With no arguments it runs cpu.yaml: local Ray on this machine's CPUs, the
tiny base model and the synthetic task, TreePO; `algo.name=grpo` runs the baseline the same way. It evaluates the base model and the final
policy on held-out problems (pass@1: the mean accuracy of trainer.eval_samples answers per problem sampled at
trainer.eval_temperature; eval_temperature=0 decodes greedily), and writes `<run_dir>/summary.json`.

The run directory lives in run storage (trainer.storage_path: a local or shared path, or an object store), which every
node reaches: the learner ranks write checkpoints there, this driver lists, prunes and restores from there
(job/rundir.py: the lock, the run record, which run `resume=auto` continues). A driver killed at any moment (even by
SIGKILL) is resumed with `trainer.resume=auto`: the same step, data position and W&B run, and the batches that were
waiting for the learner at the checkpoint are trained as they were grown.

    run:  inputs (job/inputs.py: checked and loaded) -> run directory and its lock -> Ray (cluster.py) -> the run's
          actors (supervisor.py) -> the loop over them (loop.py: batches from batches.py, evaluations from
          evaluator.py) -> the trainer (job/trainer.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import NamedTuple

import yaml

from treepo_ray import config as config_io
from treepo_ray import storage
from treepo_ray.job.config import TrainConfig, config_names, parse_config, print_config
from treepo_ray.job.inputs import Job, load_job
from treepo_ray.job.redact import redacted
from treepo_ray.job.rundir import RunLock, RunRecord, resolve_run
from treepo_ray.job.trainer import Trainer
from treepo_ray.runtime.cluster import init_ray, ray_gauges


class Runtime(NamedTuple):
    """A run's rooms: its actors (supervisor), the loop over them, its batches and its evaluations."""

    supervisor: object
    loop: object
    evaluator: object


def start_runtime(cfg: TrainConfig, job: Job) -> Runtime:
    """The actors of a run and the loop over them (the job's, and every benchmark's that trains); call
    `supervisor.shutdown()` when done."""
    from treepo_ray.runtime.batches import BatchBuilder
    from treepo_ray.runtime.evaluator import Evaluator
    from treepo_ray.runtime.loop import Loop
    from treepo_ray.runtime.supervisor import Supervisor

    supervisor = Supervisor(cfg, job.model_path)
    evaluator = Evaluator(cfg, supervisor, job.tokenizer, job.test_set)
    return Runtime(supervisor, Loop(cfg, supervisor, BatchBuilder(cfg, supervisor, job.tokenizer), evaluator), evaluator)


def run(cfg: TrainConfig, observe=None) -> dict:
    """Train as configured; returns (and writes to <run_dir>/summary.json) the run's summary. `observe(batch,
    metrics)`, if given, sees every trained step (the chaos benchmark compares runs with it)."""
    run_dir, resume_from = resolve_run(cfg)
    # The inputs before the run directory: a bad path, row or value is one line that leaves nothing behind.
    job = load_job(cfg)
    with contextlib.ExitStack() as cleanup:
        # One run per run directory: a second one is refused here, before Ray and any actor, naming the holder.
        lock = RunLock(run_dir, storage.name_of(run_dir), cfg.trainer.lock_stale_s).acquire()
        cleanup.callback(lock.release)
        init_ray(cfg)
        rt = start_runtime(cfg, job)
        cleanup.callback(rt.supervisor.shutdown)
        rt.supervisor.learner.check_storage(run_dir)
        record = RunRecord.load_or_create(run_dir)
        sinks = [ray_gauges(record.name, cfg.algo.name)] if cfg.log.ray_metrics else []
        trainer = Trainer(cfg, run_dir, record, resume_from, lock, rt.loop, rt.evaluator, rt.supervisor, sinks)
        return trainer.fit(job.train_set, observe)


PRINT_CONFIG_HELP = """
  --print-config [KEY ...]  print the resolved config as YAML (only the given dotted keys or sections) and stop,
                            before Ray and the model. Every key and its default: `treepo-ray train --print-config`;
                            what each means: the docstring under it in its section's dataclass; verl's keys and the
                            keys here: docs/verl-migration.md.
  sections: {sections}"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        print("usage: treepo-ray train [config.yaml | NAME] [key.sub=value ...]   (default config: cpu)")
        print(f"packaged configs (NAME): {', '.join(config_names())}")
        print(PRINT_CONFIG_HELP.format(sections=", ".join(f.name for f in dataclasses.fields(TrainConfig))))
        return 0
    if "--print-config" in argv:  # the words after it without '=' are the keys to print
        at = argv.index("--print-config")
        keys = [a for a in argv[at + 1:] if "=" not in a]
        cfg = parse_config(argv[:at] + [a for a in argv[at + 1:] if "=" in a], "train")
        shown = config_io.select(TrainConfig, redacted(config_io.to_dict(cfg)), keys)
        print(yaml.safe_dump(shown, sort_keys=False), end="")
        return 0  # before the run directory, Ray and the model
    cfg = parse_config(argv, "train")
    print_config(cfg)
    summary = run(cfg)  # a run directory held by a live run, or of another config, is a UserError (RunDirError)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
