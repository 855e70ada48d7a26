"""Settings of the training step."""

from __future__ import annotations

from dataclasses import dataclass, field

from treepo_ray.algo.losses import LossConfig

STRATEGIES = ("fsdp2", "deepspeed", "none")
DTYPES = ("float32", "bfloat16", "float16")
PACKINGS = ("tree", "none")
OFF_POLICY = ("recompute", "behaviour", "decoupled")
CAP_MODES = ("mask", "truncate")
TREE_ATTENTION = ("auto", "gather", "flex", "sdpa")


@dataclass
class LearnerConfig:
    """Optimiser, batching, parallelism and loss of the learner."""

    lr: float = 1e-6
    """AdamW learning rate (1e-6 as in the papers; the tiny CPU demo uses 5e-5)."""
    lr_warmup_steps: int = 0
    """Training steps of linear learning-rate warmup, then constant (learner/schedule.py; 0 = none); as verl's,
    counted in training steps, not in the ppo_epochs x mini_batches optimizer steps of each. Logged as actor/lr."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient L2 norm to this value before each optimizer step (<= 0 disables clipping)."""
    packing: str = "tree"
    """"tree": each micro-batch holds whole trees, every distinct token once (packing.py); "none": one padded row
    per trajectory (shared prefixes computed once per path), kept for comparison and tests."""
    micro_batch_tokens: int = 4096
    """packing tree: forward tokens per micro-batch on one rank; a larger tree is split into subtrees that repeat
    their ancestors (a single path longer than this is one piece over it). A job that does not set it takes the
    longest path its rollout allows, at least this 4096 (job/config.py: default_micro_batch_tokens), and warns
    below that path."""
    micro_batch_size: int = 4
    """packing none: rows (trajectories) per forward/backward pass on one rank."""
    tree_attention: str = "auto"
    """packing tree: "gather" (depth-batched SDPA over gathered ancestor keys; CPU), "flex" (FlexAttention block
    mask; GPU), "sdpa" (dense mask), "auto" (flex on CUDA, else gather)."""
    logprob_chunk: int = 1024
    """Tokens per chunk of the output layer: log-probs and entropy never hold the full [tokens, vocabulary]
    logits (logprobs.py)."""
    off_policy: str = "recompute"
    """PPO's old log-probs: "recompute" (the current weights before the step), "behaviour" (the engines' sampled
    ones), "decoupled" (AReaL's decoupled PPO: ratio to the recomputed proximal log-probs, times the
    proximal/behaviour weight, capped). recompute/decoupled skip the recompute pass when ppo_epochs and
    mini_batches are 1 (it would equal the training pass's own log-probs). A job with runtime.max_staleness > 0
    defaults to "behaviour" (job/config.py load_config)."""
    behaviour_cap: float = 5.0
    """decoupled: cap of the proximal/behaviour importance weight (AReaL's behave_imp_weight_cap)."""
    behaviour_cap_mode: str = "mask"
    """decoupled: "mask" drops tokens whose weight exceeds the cap (AReaL's default token_mask), "truncate"
    clamps the weight to the cap (token_truncate)."""
    ppo_epochs: int = 1
    """Passes over the batch of one train_step."""
    mini_batches: int = 1
    """Optimizer steps per epoch: the (shuffled) batch is split into this many mini-batches."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss: clip ranges, aggregation, KL and entropy weights."""
    strategy: str = "fsdp2"
    """Data parallelism when world_size > 1: "fsdp2" (fully_shard per decoder layer and the root), "deepspeed"
    (ZeRO stage `zero_stage`; needs the deepspeed package) or "none" (single process only)."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage, 1 (optimizer state partitioned) or 2 (gradients too); for sharded parameters use
    fsdp2."""
    dtype: str = "float32"
    """Compute dtype of forward/backward; master weights and optimizer state stay float32 (use float32 on CPU)."""
    use_ref_model: bool | None = None
    """Keep a frozen copy of the initial model for the KL term; None means "when loss.kl_coef > 0"."""
    temperature: float = 1.0
    """Logits are divided by this before log-probs and entropy; match the generators' sampling temperature."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (saves memory, costs about one extra forward). HF checkpoints only in
    training mode, so the model's configured dropout is then active in training passes."""
    seed: int = 0
    """Seed of the mini-batch shuffle and the torch RNG."""
    lora_rank: int = 0
    """LoRA adapters of this rank (peft) on `target_modules`: only the adapters are trained (and in the optimizer),
    the engines get the merged weights W + B @ A * lora_alpha / lora_rank, checkpoints hold the adapter. 0 = off
    (full fine-tuning). Set by the job from model.lora_rank (the key users set, as in verl)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator (the update is scaled by lora_alpha / lora_rank); a job sets it from model.lora_alpha."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get adapters: [all-linear] (every linear layer but the output layer, verl's default) or module
    names (e.g. [q_proj, v_proj], or q_proj,v_proj on the command line); a job sets it from model.target_modules."""
    save_merged: bool = False
    """With LoRA: each checkpoint also holds the merged model (a Hugging Face directory under merged/), besides the
    adapter."""

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"lr = {self.lr}; it must be > 0")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps = {self.lr_warmup_steps}; it must be >= 0")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay = {self.weight_decay}; it must be >= 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas = {self.betas}; expected two numbers in [0, 1)")
        for name in ("micro_batch_size", "micro_batch_tokens", "ppo_epochs", "mini_batches", "logprob_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}; it must be >= 1")
        for name, allowed in (("packing", PACKINGS), ("off_policy", OFF_POLICY),
                              ("behaviour_cap_mode", CAP_MODES), ("tree_attention", TREE_ATTENTION)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} = {getattr(self, name)!r}; choose one of {allowed}")
        if not self.behaviour_cap > 1.0:
            raise ValueError(f"behaviour_cap = {self.behaviour_cap}; it must be > 1")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy = {self.strategy!r}; choose one of {STRATEGIES}")
        if self.zero_stage not in (1, 2):
            raise ValueError(f"zero_stage = {self.zero_stage}; DeepSpeed ZeRO stage 1 or 2 (use fsdp2 to shard "
                             "parameters)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype = {self.dtype!r}; choose one of {DTYPES}")
        if not self.temperature > 0:
            raise ValueError(f"temperature = {self.temperature}; it must be > 0")
        if self.lora_rank < 0 or not self.lora_alpha > 0:
            raise ValueError(f"lora_rank = {self.lora_rank}, lora_alpha = {self.lora_alpha}; lora_rank must be >= 0 "
                             "(0 = off) and lora_alpha > 0")
        if isinstance(self.target_modules, str):
            self.target_modules = [m for m in self.target_modules.split(",") if m]
        if not self.target_modules or ("all-linear" in self.target_modules and len(self.target_modules) > 1):
            raise ValueError(f"target_modules = {self.target_modules!r}; [all-linear] or a list of module names")
        if self.lora_rank > 0 and self.strategy == "deepspeed":
            raise ValueError("lora_rank > 0 is not supported with strategy = 'deepspeed'; use fsdp2")
        if self.use_ref_model is False and self.loss.kl_coef > 0:
            raise ValueError(f"use_ref_model = False but loss.kl_coef = {self.loss.kl_coef} needs a reference model")

    @property
    def recompute_pass(self) -> bool:
        """Whether old (proximal) log-probs are recomputed before the step: recompute and decoupled need them,
        unless one epoch of one mini-batch makes them the training pass's own."""
        one_pass = self.ppo_epochs == 1 and self.mini_batches == 1
        return self.off_policy in ("recompute", "decoupled") and not one_pass

    @property
    def lora(self) -> bool:
        """Whether LoRA adapters are trained instead of the whole model."""
        return self.lora_rank > 0

    @property
    def peft_target_modules(self) -> str | list[str]:
        """target_modules as peft's LoraConfig takes them."""
        return "all-linear" if list(self.target_modules) == ["all-linear"] else list(self.target_modules)

    @property
    def needs_ref_model(self) -> bool:
        """Whether a frozen reference model is loaded."""
        return self.loss.kl_coef > 0 if self.use_ref_model is None else self.use_ref_model
