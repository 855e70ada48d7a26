"""What the runtime tests share: small runs of the default job, set up exactly as `treepo-ray train` sets them up
(job.config.load_config, then runtime.train.set_up)."""

from pathlib import Path

from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.runtime.train import Job, set_up

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "treepo-ray"  # synthetic task files, written once


def small(tiny: str, *extra: str) -> list[str]:
    """A seconds-long run: 4 prompts x 4 paths of at most 2 x 8 tokens, one optimizer step per training step."""
    return ["model.path=" + tiny, f"model.cache_dir={CACHE}", "trainer.eval_size=8",
            "rollout.treepo.width=4", "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8",
            "rollout.sequential.group_size=4", "rollout.sequential.max_depth=2", "rollout.sequential.segment_len=8",
            "algo.dynamic_sampling=false",
            "trainer.prompts_per_step=4", "learner.lr=1e-3", "log.trees_per_step=1", "log.wandb=false", *extra]


def two_engines(tiny: str, *extra: str) -> list[str]:
    """4 prompts x 4 paths of at most 2 x 8 tokens per step; two engines of half a CPU each (room for one
    replacement as soon as one dies), the learner on the other CPU."""
    return ["model.path=" + tiny, f"model.cache_dir={CACHE}", "trainer.eval_size=4",
            "rollout.treepo.width=4", "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8",
            "trainer.prompts_per_step=4", "learner.lr=1e-3", "log.wandb=false", "runtime.num_engines=2",
            "runtime.engine_cpus=0.5", "runtime.elastic.poll_s=0.2", "algo.dynamic_sampling=false", *extra]


def job(overrides: list[str], config: Path = DEFAULT_CONFIG) -> Job:
    """The config, tokenizer and prompts of a run (Ray is already up: set_up joins it)."""
    return set_up(load_config(config, overrides))
