"""The job's inputs as the user named them: the model, the prompts and the reward function, checked before anything
slow starts (so that a mistake is one UserError line, not a traceback after the base model and Ray are up) and then
loaded. Every data row is read and checked before the model is resolved (data/datasets.py read_records), and
`treepo-ray train` loads the job before it creates the run directory or starts Ray (runtime/train.py), so a bad
input leaves nothing behind. Shared by `treepo-ray train` and `treepo-ray eval` (job/evaluate.py)."""

from __future__ import annotations

from dataclasses import dataclass

from treepo_ray.config import UserError, origin_of
from treepo_ray.data.datasets import (SYNTHETIC_TEST_ROWS, SYNTHETIC_TRAIN_ROWS, WORD_PROBLEMS, PromptBudget, Splits,
                                     encode_records, file_exists, read_records)
from treepo_ray.data.prompts import Prompt
from treepo_ray.engines.hub import model_context_length, resolve_model_path
from treepo_ray.job.config import TrainConfig
from treepo_ray.job.logs import check_tensorboard
from treepo_ray.rewards.custom import check_reward_function


def check_inputs(cfg: TrainConfig) -> None:
    """What can be checked in a moment: the temperatures agree, the custom reward function imports, the data files
    and the model exist. Each failure is one UserError naming the key."""
    if abs(cfg.learner.temperature - cfg.rollout.temperature) > 1e-9:
        raise UserError(f"learner.temperature = {cfg.learner.temperature} but rollout.temperature = "
                        f"{cfg.rollout.temperature}; the learner's log-probs must use the sampling temperature")
    if cfg.custom_reward_function.enabled:
        check_reward_function(cfg.custom_reward_function)
    if cfg.data.name == WORD_PROBLEMS and not cfg.data.train_files and not cfg.model.path:
        raise UserError("data.name = 'word_problems' is English text, beyond the tiny base model (model.path is "
                        "empty): set model.path, e.g. `treepo-ray train smollm2_cpu` (SmolLM2-135M-Instruct)")
    if cfg.data.train_files or cfg.data.name != "synthetic":
        train, test = cfg.data.files(cfg.model.cache_dir, (SYNTHETIC_TRAIN_ROWS, SYNTHETIC_TEST_ROWS))
        for key, files in (("data.train_files", train), ("data.val_files", test)):
            for f in files:
                if not file_exists(f):  # a local path or an s3:// / gs:// URI
                    raise UserError(f"{key}: {str(f)!r} does not exist")
    if cfg.model.path:
        resolve_model_path(cfg.model.path, model_cache=cfg.model.cache_dir)
    if cfg.log.tensorboard:
        check_tensorboard()


def resolve_model(cfg: TrainConfig) -> str:
    """The policy's local directory: model.path (a directory, `~` expanded, or a hub id in the local Hugging Face
    cache), or the tiny base model (built and cached on first use)."""
    if cfg.model.path:
        return resolve_model_path(cfg.model.path, model_cache=cfg.model.cache_dir)
    from treepo_ray.data.pretrain import base_model_config, prepare_base_model

    return str(prepare_base_model(cfg.model.cache_dir, seed=cfg.data.seed, cfg=base_model_config(cfg.data.name)))


def read_prompts(cfg: TrainConfig) -> Splits:
    """Every row of the training and held-out data read and checked, with no model needed (decoding, fields,
    ground truths, extra_info; without a custom reward function, the built-in scorers)."""
    return read_records(cfg.data, cfg.model.cache_dir, (SYNTHETIC_TRAIN_ROWS, SYNTHETIC_TEST_ROWS),
                        custom_reward=cfg.custom_reward_function.enabled)


def load_prompts(cfg: TrainConfig, model_path: str, tokenizer, splits: Splits | None = None
                 ) -> tuple[list[Prompt], list[Prompt]]:
    """The training and held-out prompts (of `splits`, else read now), each checked against the model's context
    (less the response budget)."""
    budget = PromptBudget(model_context_length(model_path), cfg.sampler_config.response_limit())
    limit = budget.context_limit()
    if limit is not None and limit < 1:  # said with the keys that set the response budget and where they came from
        key = f"rollout.{cfg.algo.spec.sampler}"
        origins = getattr(cfg, "_key_origins", {})
        said = "; ".join(f"{key}.{k} = {getattr(cfg.sampler_config, k)} ({origin_of(f'{key}.{k}', origins)})"
                         for k in ("max_response_len", "max_depth", "segment_len", "step_len")
                         if hasattr(cfg.sampler_config, k))
        raise UserError(f"model.path's context of {budget.context_tokens} tokens leaves no room for a prompt after "
                        f"the {budget.response_tokens}-token response budget [{said}]; set {key}.max_response_len "
                        f"below {budget.context_tokens}")
    return encode_records(cfg.data, read_prompts(cfg) if splits is None else splits, tokenizer, budget)


@dataclass
class Job:
    """What every run of the job starts from (the training job, and the benchmarks that run it)."""

    cfg: TrainConfig
    model_path: str
    tokenizer: object
    train_set: list[Prompt]
    test_set: list[Prompt]
    """Held-out prompts, at most trainer.eval_size of them."""


def load_job(cfg: TrainConfig) -> Job:
    """The inputs checked and every row read, then the model (the tiny base model is built first: it uses every
    core), its tokenizer and the task's prompts."""
    from transformers import AutoTokenizer

    check_inputs(cfg)
    splits = read_prompts(cfg)  # a bad row is named before the base model is built or the tokenizer loaded
    model_path = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    train_set, test_set = load_prompts(cfg, model_path, tokenizer, splits)
    return Job(cfg, model_path, tokenizer, train_set, test_set[: cfg.trainer.eval_size])
