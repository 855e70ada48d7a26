"""`treepo-ray eval [config.yaml] [key.sub=value ...]`: Pass@1 / Major@k / pass@k of a model on a dataset, with the
training job's config keys (a training config file works as is) plus an `eval` section.

From the training keys: model.path / engine / engine_kwargs (the model; empty = the tiny base model), data.*
(verl's train_files / val_files / prompt_key / reward_fn_key, or data.name), custom_reward_function.*,
trainer.eval_samples (answers per problem), trainer.eval_temperature (0 = greedy), trainer.eval_size (problems),
trainer.eval_max_new_tokens (length cap; 0 = the sampler's response limit), trainer.seed, rollout.top_p, the
sampler's segment_len, runtime.verifier_timeout_s and runtime.torch_threads. Its own (data/evaluate.py EvalConfig):
eval.split, eval.sampler, eval.divergence, eval.k, eval.resamples, eval.sweep_divergence, eval.sweep_rollouts,
eval.out. Examples:

    treepo-ray eval                                          # the tiny base model on the synthetic task's test split
    treepo-ray eval model.path=runs/x/checkpoint-40 data.train_files=a.parquet data.val_files=b.parquet \\
        trainer.eval_samples=16 eval.k=[1,4,16] eval.sampler=treepo eval.divergence=4
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from treepo_ray.config import UserError
from treepo_ray.data.evaluate import evaluate_records
from treepo_ray.data.sampling import SampleSettings
from treepo_ray.job.config import EvalJobConfig, parse_config, print_config
from treepo_ray.job.inputs import check_inputs, load_prompts, resolve_model


def settings_of(cfg: EvalJobConfig) -> SampleSettings:
    """How answers are sampled, from the training keys and the eval section."""
    tr, sampler_cfg = cfg.trainer, cfg.sampler_config
    return SampleSettings(sampler=cfg.eval.sampler, n=tr.eval_samples, temperature=tr.eval_temperature,
                          top_p=cfg.rollout.top_p,
                          max_new_tokens=tr.eval_max_new_tokens or sampler_cfg.response_limit(),
                          segment_len=sampler_cfg.segment_len, divergence=cfg.eval.divergence, seed=tr.seed)


def run_eval(cfg: EvalJobConfig) -> dict:
    """Evaluate as configured; returns the report (also written to <eval.out>/eval.json)."""
    from transformers import AutoTokenizer

    from treepo_ray.engines import make_engine
    from treepo_ray.rewards.router import BatchScorer

    check_inputs(cfg)
    model = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model)
    train, test = load_prompts(cfg, model, tokenizer)
    records = test if cfg.eval.split == "test" else train
    if not records:
        raise UserError(f"eval.split = {cfg.eval.split!r}: the data has no such split (set data.val_files)")
    if cfg.trainer.eval_size:
        records = records[: cfg.trainer.eval_size]
    out = Path(cfg.eval.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    kwargs = dict(cfg.model.engine_kwargs)
    if cfg.model.engine == "hf":
        kwargs = {"num_threads": cfg.runtime.torch_threads, "seed": cfg.trainer.seed, **kwargs}
    engine = make_engine(cfg.model.engine, model, **kwargs)
    data_name = ",".join(cfg.data.val_files if cfg.eval.split == "test" and cfg.data.val_files
                         else cfg.data.train_files) or cfg.data.name
    with BatchScorer(timeout_s=cfg.runtime.verifier_timeout_s, reward_function=cfg.custom_reward_function) as scorer:
        return evaluate_records(records, engine, tokenizer, scorer, settings_of(cfg), cfg.eval, out, str(model),
                                data_name)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cfg = parse_config(argv, "eval", EvalJobConfig)
    print_config(cfg)
    run_eval(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
