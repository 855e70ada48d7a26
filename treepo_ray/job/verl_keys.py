"""verl's config keys and the keys here that do their jobs: the one table behind docs/verl-migration.md
(`markdown_table`) and behind the error a verl key gets on the command line (`explain`, called by job/config.py).

A verl key is never translated silently: where the two differ (a size here a count, per GPU here per rank, a flag
here a coefficient) the value would mean something else, so the user is told the key and the difference instead.
"""

from __future__ import annotations

from typing import NamedTuple


class VerlKey(NamedTuple):
    here: tuple[str, ...]
    """The key(s) here that do the job (none: no equivalent)."""
    meaning: str
    """What the key sets, in a few words."""
    differs: str = ""
    """Where the meaning here differs from verl's (or, with no key here, why there is none)."""
    default: str = ""
    """The default here when it is not one key's dataclass default (read from TrainConfig otherwise)."""


A = "actor_rollout_ref."
VERL_KEYS: dict[str, VerlKey] = {
    "data.train_files": VerlKey(("data.train_files",), "training files, parquet or jsonl, a path or a list",
                                "same; also `s3://` / `gs://` URIs"),
    "data.val_files": VerlKey(("data.val_files",), "held-out files", "same"),
    "data.train_batch_size": VerlKey(("trainer.prompts_per_step",), "prompts per training step, all ranks together",
                                     "same unit (prompts, not responses)"),
    "data.max_prompt_length": VerlKey(("data.prompt.max_prompt_tokens",), "longest prompt in tokens",
                                      "a longer prompt is dropped and counted (data.prompt.overlong=filter); verl's "
                                      "truncation=error is overlong=error"),
    "data.max_response_length": VerlKey(
        ("rollout.treepo.max_response_len", "rollout.sequential.max_response_len",
         "rollout.treerpo.max_response_len"), "response token limit",
        "one key per sampler: treepo (algo treepo, treepo_flat), sequential (grpo, dapo), treerpo (treerpo, catpo); "
        "empty = max_depth x segment_len (treerpo: max_depth x step_len)"),
    "data.shuffle": VerlKey(("data.shuffle",), "shuffle the training prompts", "same, reshuffled every epoch"),
    "data.prompt_key": VerlKey(("data.prompt_key",), "the row's prompt field", "same"),
    "data.reward_fn_key": VerlKey(("data.reward_fn_key",), "the row's field that picks the reward function", "same"),
    A + "model.path": VerlKey(("model.path",), "the policy model", "a local directory or a hub id already in the "
                              "local Hugging Face cache (no download at run time); empty = the tiny demo model"),
    A + "model.lora_rank": VerlKey(("model.lora_rank",), "LoRA adapter rank (0 = full fine-tuning)",
                                   "same (peft); the learner trains only the adapters, the engines load the merged "
                                   "weights, checkpoints hold the adapter (learner.save_merged: the merged model too)"),
    A + "model.lora_alpha": VerlKey(("model.lora_alpha",), "LoRA scale: updates times lora_alpha / lora_rank",
                                    "same"),
    A + "model.target_modules": VerlKey(("model.target_modules",), "modules that get LoRA adapters",
                                        "same: all-linear or a list of module names", "all-linear"),
    A + "model.enable_gradient_checkpointing": VerlKey(("learner.gradient_checkpointing",),
                                                       "recompute activations in backward", "same"),
    A + "actor.optim.lr": VerlKey(("learner.lr",), "AdamW learning rate", "same"),
    A + "actor.optim.weight_decay": VerlKey(("learner.weight_decay",), "AdamW weight decay", "verl's default 0.01"),
    A + "actor.optim.lr_warmup_steps": VerlKey(("learner.lr_warmup_steps",), "linear warmup, then constant",
                                               "training steps, as in verl (its scheduler steps once per "
                                               "training step); logged as actor/lr"),
    A + "actor.grad_clip": VerlKey(("learner.grad_clip",), "global gradient-norm clip", "same"),
    A + "actor.strategy": VerlKey(("learner.strategy",), "data parallelism of the learner",
                                  "fsdp2 or deepspeed (ZeRO 1/2); no megatron"),
    A + "actor.ppo_mini_batch_size": VerlKey(
        ("learner.mini_batches",), "optimizer steps per batch",
        "a COUNT here, a SIZE in verl: learner.mini_batches = data.train_batch_size / ppo_mini_batch_size"),
    A + "actor.ppo_micro_batch_size_per_gpu": VerlKey(
        ("learner.micro_batch_tokens", "learner.micro_batch_size"), "gradient accumulation (memory only)",
        "tokens per micro-batch per learner rank with tree packing (the default), or trajectories per rank with "
        "learner.packing=none", default="the longest path (at least 4096); 4"),
    A + "actor.ppo_max_token_len_per_gpu": VerlKey(("learner.micro_batch_tokens",), "tokens per micro-batch",
                                                   "per learner rank; always the budget with tree packing",
                                                   default="the longest path (at least 4096)"),
    A + "actor.ppo_epochs": VerlKey(("learner.ppo_epochs",), "passes over each batch", "same"),
    A + "actor.use_kl_loss": VerlKey(("learner.loss.kl_coef",), "KL loss to the reference model",
                                     "no flag here: learner.loss.kl_coef > 0 turns it on (and keeps a reference "
                                     "model)"),
    A + "actor.kl_loss_coef": VerlKey(("learner.loss.kl_coef",), "weight of the KL loss",
                                      "0 = off (verl's 0.001 applies only with use_kl_loss)"),
    A + "actor.kl_loss_type": VerlKey(("learner.loss.kl_estimator",), "KL estimator",
                                      "k1, k2, k3 (verl's low_var_kl is k3)"),
    A + "actor.entropy_coeff": VerlKey(("learner.loss.entropy_coef",), "entropy bonus weight", "same sign (a bonus)"),
    A + "actor.clip_ratio": VerlKey(("learner.loss.clip_low", "learner.loss.clip_high"), "PPO clip range",
                                    "two keys here"),
    A + "actor.clip_ratio_low": VerlKey(("learner.loss.clip_low",), "ratio clipped at 1 - clip_low", "same"),
    A + "actor.clip_ratio_high": VerlKey(("learner.loss.clip_high",), "ratio clipped at 1 + clip_high",
                                         "default 0.28 (DAPO's clip-higher); each algorithm presets its loss "
                                         "(algo.loss_preset), keys you set win"),
    A + "actor.loss_agg_mode": VerlKey(("learner.loss.aggregation",), "how token losses are averaged",
                                       "token-mean = token-mean, seq-mean-token-mean = seq-mean; no "
                                       "seq-mean-token-sum; node-mean for trees (treerpo, catpo)"),
    A + "rollout.n": VerlKey(
        ("rollout.treepo.width", "rollout.sequential.group_size", "rollout.treerpo.n_children"),
        "responses per prompt",
        "one key per sampler: treepo.width = trajectories per tree (treepo, treepo_flat), sequential.group_size "
        "(grpo, dapo), treerpo.n_children = children of each node, n_children ** max_depth leaves (treerpo, catpo)"),
    A + "rollout.temperature": VerlKey(("rollout.temperature",), "sampling temperature",
                                       "learner.temperature must equal it (checked)"),
    A + "rollout.top_p": VerlKey(("rollout.top_p",), "nucleus sampling", "same"),
    A + "rollout.top_k": VerlKey(("rollout.top_k",), "top-k sampling", "0 = off (verl: -1)"),
    A + "rollout.name": VerlKey(("model.engine",), "generation backend", "hf or vllm; no sglang"),
    A + "rollout.tensor_model_parallel_size": VerlKey(
        ("model.engine_kwargs.tensor_parallel_size",), "GPUs per vLLM engine",
        "passed to vLLM's EngineArgs; engines: runtime.num_engines", default="vLLM's (1)"),
    A + "rollout.gpu_memory_utilization": VerlKey(
        ("model.engine_kwargs.gpu_memory_utilization",), "vLLM's share of GPU memory",
        ("of the engine's GPU; where the learner shares it (fractional runtime.engine_gpus / learner_gpus, as in "
        "gsm8k_1gpu) leave the learner room"),
        default="vLLM's (0.9)"),
    A + "rollout.val_kwargs.n": VerlKey(("trainer.eval_samples",), "answers per held-out problem", "pass@1 is "
                                        "their mean"),
    A + "rollout.val_kwargs.temperature": VerlKey(("trainer.eval_temperature",), "held-out sampling temperature",
                                                  "0 = greedy"),
    "algorithm.adv_estimator": VerlKey(("algo.name",), "the algorithm",
                                       "grpo, dapo, treepo, treepo_flat, treerpo or catpo; verl's DAPO is "
                                       "grpo + filter_groups, here algo.name=dapo"),
    "algorithm.use_kl_in_reward": VerlKey((), "KL penalty in the reward",
                                          "KL enters only as a loss term (learner.loss.kl_coef)"),
    "algorithm.norm_adv_by_std_in_grpo": VerlKey(("algo.grpo.scale",), "divide by the group's std",
                                                 "same (false = Dr. GRPO)"),
    "algorithm.filter_groups.enable": VerlKey(("algo.dynamic_sampling",), "drop groups with equal rewards",
                                              "empty = the algorithm's own (on for dapo, treepo)"),
    "reward_model.overlong_buffer.enable": VerlKey(("algo.overlong.enable",), "DAPO's overlong penalty", "same"),
    "reward_model.overlong_buffer.len": VerlKey(("algo.overlong.buffer_len",), "its buffer in tokens", "same"),
    "trainer.total_epochs": VerlKey((), "passes over the data",
                                    "set trainer.steps instead (an epoch is the number of training prompts / "
                                    "trainer.prompts_per_step steps)"),
    "trainer.total_training_steps": VerlKey(("trainer.steps",), "training steps", "same"),
    "trainer.save_freq": VerlKey(("trainer.save_every",), "checkpoint every this many steps",
                                 "0 = only at the end (verl: -1 = never)"),
    "trainer.test_freq": VerlKey(("trainer.eval_every",), "evaluate every this many steps",
                                 "0 = before and after training only; trainer.eval_size problems"),
    "trainer.val_before_train": VerlKey(("trainer.eval_size",), "evaluate before training",
                                        "always when trainer.eval_size > 0"),
    "trainer.n_gpus_per_node": VerlKey(
        ("runtime.learner_gpus", "runtime.engine_gpus"), "GPUs of the job",
        "asked per actor: runtime.learner_ranks x learner_gpus and runtime.num_engines x engine_gpus, placed by "
        "Ray on whatever nodes the cluster has; learner and engines do not share GPUs"),
    "trainer.nnodes": VerlKey((), "nodes of the job",
                              "Ray places the actors on the cluster named by runtime.address"),
    "trainer.project_name": VerlKey(("log.wandb_project",), "W&B project", "same"),
    "trainer.experiment_name": VerlKey(("trainer.run_dir",), "the run's name",
                                       "the run directory; its folder name is the W&B run's name",
                                       default="<storage_path>/<algo>-<time>"),
    "trainer.logger": VerlKey(("log.wandb", "log.tensorboard"), "where metrics go",
                              "two flags; metrics.jsonl and the console always"),
    "trainer.default_local_dir": VerlKey(("trainer.storage_path",), "where checkpoints go",
                                         "holds the run directories; every node must reach it (a shared mount, "
                                         "s3:// or gs://)"),
    "trainer.resume_mode": VerlKey(("trainer.resume",), "resume a run", "'auto' is the same; '' = fresh"),
    "custom_reward_function.path": VerlKey(("custom_reward_function.path",), "your reward function's file",
                                           "same signature, compute_score(data_source, solution_str, "
                                           "ground_truth, extra_info)"),
    "custom_reward_function.name": VerlKey(("custom_reward_function.name",), "its function name", "same"),
    "critic.model.path": VerlKey((), "the PPO critic", "no critic here (GRPO-family algorithms only)"),
}
VERL_SECTIONS = ("actor_rollout_ref", "algorithm", "critic", "reward_model", "ray_init", "ray_kwargs")
"""Top-level sections only verl has: a key under one of them is verl's even when the table above lacks it."""
DOC = "docs/verl-migration.md"


def find(key: str) -> tuple[str, VerlKey] | None:
    """The verl key `key` names: itself, or a dotted tail of one (`rollout.n` for actor_rollout_ref.rollout.n);
    a leading `+` (Hydra's "add a key") is ignored."""
    key = key.lstrip("+")
    if key in VERL_KEYS:
        return key, VERL_KEYS[key]
    tails = [k for k in VERL_KEYS if key.count(".") >= 1 and k.endswith("." + key)]
    return (tails[0], VERL_KEYS[tails[0]]) if len(tails) == 1 else None


def explain(key: str) -> str | None:
    """One line for a verl key: the key(s) here that do its job and where they differ, or that none does; None when
    `key` is not verl's."""
    found = find(key)
    if found is None:
        if key.lstrip("+").split(".")[0] in VERL_SECTIONS:
            return f"verl's key, with no equivalent here ({DOC} lists the verl keys that have one)"
        return None
    name, entry = found
    whose = "verl's key" if name == key.lstrip("+") else f"verl's {name}"
    if not entry.here:
        return f"{whose}, with no equivalent here: {entry.differs}"
    return f"{whose}; here: {' or '.join(entry.here)} ({entry.differs})"


def default_of(entry: VerlKey, cfg_dict: dict) -> str:
    """The default here, from the config's own defaults."""
    if entry.default:
        return entry.default
    values = []
    for key in entry.here:
        node = cfg_dict
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        values.append("empty" if node in (None, "", [], {}) else str(node))
    return ", ".join(values) if values else "-"


def markdown_table(defaults: dict) -> str:
    """The migration table of docs/verl-migration.md, from VERL_KEYS and `defaults` (TrainConfig's, as a dict)."""
    rows = ["| verl key | key here | meaning | default here | how it differs |", "| --- | --- | --- | --- | --- |"]
    for name, entry in VERL_KEYS.items():
        here = ", ".join(f"`{k}`" for k in entry.here) or "none"
        default = f"`{default_of(entry, defaults)}`" if entry.here else "-"
        rows.append(f"| `{name}` | {here} | {entry.meaning} | {default} | {entry.differs} |")
    return "\n".join(rows) + "\n"
