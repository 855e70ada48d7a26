"""The training step: a causal LM, AdamW, the clipped policy loss; weight export and checkpoints.

One Learner per process (rank). With world_size > 1 every rank builds its own Learner with the same config, and
each call (compute_logprobs, train_step, export_weights, save/load_checkpoint) must be made on all ranks together,
each with its own shard of the samples: FSDP2 gathers parameters inside every forward and backward (and DeepSpeed
reduces gradients inside backward), so the ranks agree on how many micro-batches to run (a rank with fewer samples
runs zero-weighted dummy passes). With world_size == 1 the model is trained as is, whatever the strategy.
Where FSDP2, DeepSpeed and one process differ is strategy.py; how a checkpoint is written and read, checkpoint.py.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from treepo_ray.algo.losses import policy_loss
from treepo_ray.learner.batch import Batch, TrainSample, collate
from treepo_ray.learner.checkpoint import read_checkpoint, write_checkpoint
from treepo_ray.learner.config import LearnerConfig
from treepo_ray.learner.schedule import lr_at, set_lr
from treepo_ray.learner.strategy import make_strategy

# Figures of policy_loss that are aggregated like the loss itself (weighted by the micro-batch's share of the
# normaliser) and those that are always a mean over response tokens (weighted by the token share).
LOSS_FIGURES = ("loss", "pg_loss", "kl", "entropy")
TOKEN_FIGURES = ("clip_frac", "clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl")


class Learner:
    """Trains a Hugging Face causal LM with the clipped policy loss; one instance per rank."""

    def __init__(
        self,
        model_path: str | Path,
        cfg: LearnerConfig | None = None,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str | None = None,
        master_port: int | str | None = None,
    ) -> None:
        self.cfg = cfg = cfg if cfg is not None else LearnerConfig()
        self.strategy = make_strategy(cfg, rank, world_size, master_addr, master_port)
        self.model_path, self.rank, self.world_size = Path(model_path), rank, world_size
        self.device = self.strategy.device
        torch.manual_seed(cfg.seed + rank)

        self.model = self._load_model(trainable=True)
        self.ref_model = self._load_model(trainable=False) if cfg.needs_ref_model else None
        self.optimizer = self.strategy.wrap(self.model,
                                            torch.optim.AdamW(self.model.parameters(), **self._optimizer_hparams()))
        self.version = 0
        """Optimizer steps taken so far (the weights' version, for staleness checks by the generators)."""
        config = self.model.config
        self.vocab_size: int = config.vocab_size
        self.pad_id: int = config.pad_token_id if config.pad_token_id is not None else 0
        self.tokenizer = None
        if rank == 0:
            try:  # saved with each checkpoint so it is a complete HF model directory
                self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
            except (OSError, ValueError):
                self.tokenizer = None

    # ------------------------------------------------------------------ setup

    def _optimizer_hparams(self) -> dict[str, Any]:
        cfg = self.cfg
        return dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)

    def _load_model(self, trainable: bool) -> PreTrainedModel:
        # Master weights in float32; a lower compute dtype is applied by the strategy (autocast or its own).
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        model.config.use_cache = False
        if trainable and self.cfg.gradient_checkpointing:
            # transformers 5 renamed gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable.
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        if not trainable:
            model.requires_grad_(False)
        model.to(self.device)
        self.strategy.shard(model)
        # Dropout off in every pass, so the recomputed old log-probs and the trained ones come from one function.
        # Exception: HF runs gradient checkpointing only in training mode (the config's dropout then applies).
        model.train(trainable and self.cfg.gradient_checkpointing)
        return model

    def close(self) -> None:
        """Release the process group this Learner created (if any)."""
        self.strategy.close()

    # ------------------------------------------------------------------ forward

    def _forward(
        self, model: torch.nn.Module, batch: Batch, entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target-aligned token log-probs [B, L-1] and (optionally) the policy's entropy at each position."""
        with self.strategy.autocast():
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           position_ids=batch.position_ids, use_cache=False).logits
        logits = logits[:, :-1].float()
        if self.cfg.temperature != 1.0:
            logits = logits / self.cfg.temperature
        log_p = logits.log_softmax(dim=-1)
        logprobs = log_p.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        ent = None
        if entropy:
            # H = -sum_v p_v log p_v; differentiable only when the loss uses it (entropy_coef != 0).
            src = log_p if entropy_grad else log_p.detach()
            ent = -(src.exp() * src).sum(dim=-1)
        return logprobs, ent

    def _micro_batches(self, samples: list[TrainSample]) -> list[list[TrainSample]]:
        """Split into micro-batches, padded with empty ones to the largest count on any rank."""
        mbs = self.cfg.micro_batch_size
        chunks = [samples[i:i + mbs] for i in range(0, len(samples), mbs)]
        n = int(self.strategy.all_reduce([len(chunks)], op="max")[0])
        return chunks + [[] for _ in range(n - len(chunks))]

    def _collate(self, chunk: list[TrainSample]) -> Batch:
        # An empty chunk still runs a forward/backward (FSDP2 collectives), on a 2-token dummy with zero weight.
        dummy = [TrainSample([self.pad_id], [self.pad_id], 0.0, old_logprobs=[0.0])]
        return collate(chunk or dummy, pad_id=self.pad_id).to(self.device)

    def _validate(self, samples: list[TrainSample]) -> None:
        if not isinstance(samples, (list, tuple)):
            raise ValueError(f"samples must be a list of TrainSample, got {type(samples).__name__}")
        for i, s in enumerate(samples):
            if not isinstance(s, TrainSample):
                raise ValueError(f"samples[{i}] is a {type(s).__name__}, not a TrainSample")
            s.validate(f"samples[{i}]", self.vocab_size)

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def compute_logprobs(self, samples: list[TrainSample]) -> list[list[float]]:
        """Log-probs of each sample's response tokens under the current weights (no gradient)."""
        self._validate(samples)
        out: list[list[float]] = []
        for chunk in self._micro_batches(list(samples)):
            batch = self._collate(chunk)
            logprobs, _ = self._forward(self.model, batch)
            if chunk:
                out.extend(batch.responses(logprobs))
        return out

    def train_step(self, samples: list[TrainSample]) -> dict[str, float]:
        """ppo_epochs x mini_batches optimizer steps on this rank's shard of the batch; returns global metrics.

        A step whose loss or gradient norm is NaN/inf is skipped on every rank (weights and optimizer state
        untouched) and counted in "skipped".
        """
        started = time.perf_counter()
        cfg = self.cfg
        self._validate(samples)
        samples = list(samples)
        # The PPO ratio needs the behaviour policy's log-probs; recompute the ones the caller did not supply.
        missing = [i for i, s in enumerate(samples) if s.old_logprobs is None]
        recomputed = self.compute_logprobs([samples[i] for i in missing])
        for i, lp in zip(missing, recomputed):
            samples[i] = dataclasses.replace(samples[i], old_logprobs=lp)

        tokens, seqs = self.strategy.all_reduce([sum(len(s.response_ids) for s in samples), len(samples)])
        if seqs == 0:
            raise ValueError("train_step got no samples on any rank")
        start_version = self.version
        totals: dict[str, float] = {}
        steps = skipped = 0
        for epoch in range(cfg.ppo_epochs):
            # Deterministic shuffle: the same (seed, version, epoch, rank) always gives the same mini-batches.
            order = np.random.default_rng([cfg.seed, start_version, epoch, self.rank]).permutation(len(samples))
            for part in np.array_split(order, cfg.mini_batches):
                stats = self._optimizer_step([samples[i] for i in part])
                if stats is None:
                    continue
                steps += 1
                skipped += int(stats.pop("skipped"))
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
        metrics = {k: v / max(steps, 1) for k, v in totals.items()}
        metrics.update(lr=self.optimizer.param_groups[0]["lr"], tokens=float(tokens), samples=float(seqs),
                       steps=float(steps - skipped), skipped=float(skipped), version=float(self.version),
                       time_s=time.perf_counter() - started)
        return metrics

    def per_group_grad_norms(self, groups: list[list[TrainSample]]) -> list[float]:
        """L2 norm of the gradient of each group's loss taken alone, at the current weights (CATPO's H1 check: a
        group is one tree's samples, the result its per-tree gradient norm).

        The loss is train_step's, normalised over the group's own tokens (token-mean) or sequences (seq-mean);
        missing old log-probs are the current ones (ratio 1: the clipped surrogate's gradient is then the plain
        policy gradient). No optimizer step; gradients are left cleared. Call on all ranks, each with its shard of
        every group. Not supported under DeepSpeed (it owns the gradients)."""
        self.strategy.require_own_gradients("per_group_grad_norms")
        norms = []
        self.optimizer.zero_grad(set_to_none=True)
        for g, group in enumerate(groups):
            group = list(group)
            if not group and self.world_size == 1:
                raise ValueError(f"groups[{g}] is empty; every group needs at least one sample")
            self._validate(group)
            missing = [i for i, s in enumerate(group) if s.old_logprobs is None]
            for i, lp in zip(missing, self.compute_logprobs([group[i] for i in missing])):
                group[i] = dataclasses.replace(group[i], old_logprobs=lp)
            figures = self.backward(group)
            norms.append(self.strategy.grad_norm() if figures else 0.0)
            self.optimizer.zero_grad(set_to_none=True)
        return norms

    def _optimizer_step(self, samples: list[TrainSample]) -> dict[str, float] | None:
        """Accumulate gradients over micro-batches (and ranks), then clip and step. None if no rank has samples."""
        figures = self.backward(samples)
        if not figures:
            return None
        set_lr(self.optimizer, lr_at(self.cfg.lr, self.cfg.lr_warmup_steps, self.version))  # schedule.py
        grad_norm, ok = self.strategy.step(figures["loss"])
        self.version += int(ok)
        return figures | {"grad_norm": grad_norm, "skipped": float(not ok)}

    def backward(self, samples: list[TrainSample]) -> dict[str, float]:
        """Add to the parameters' .grad the gradient of the loss of one mini-batch, of which `samples` is this
        rank's shard (each with old_logprobs), normalised over the whole mini-batch on all ranks; no optimizer
        step. Returns the loss figures of the whole mini-batch ({} when no rank has samples)."""
        for i, s in enumerate(samples):
            if s.old_logprobs is None:
                raise ValueError(f"samples[{i}].old_logprobs is None; backward needs them (train_step fills them)")
        agg = self.cfg.loss.aggregation
        g_tokens, g_seqs = self.strategy.all_reduce([sum(len(s.response_ids) for s in samples), len(samples)])
        if g_seqs == 0:
            return {}
        # policy_loss averages within a micro-batch; re-weighting each micro-batch by its share of the global
        # normaliser (all response tokens for token-mean, all sequences for seq-mean) makes the summed gradient
        # equal that of one pass over the whole mini-batch on one process.
        denom = g_tokens if agg == "token-mean" else g_seqs
        figures = dict.fromkeys(LOSS_FIGURES + TOKEN_FIGURES, 0.0)
        chunks = self._micro_batches(samples)
        for k, chunk in enumerate(chunks):
            batch = self._collate(chunk)
            share = (batch.num_tokens if agg == "token-mean" else len(chunk)) / denom if chunk else 0.0
            token_share = batch.num_tokens / g_tokens if chunk else 0.0
            logprobs, entropy = self._forward(self.strategy.train_module, batch, entropy=True,
                                              entropy_grad=self.cfg.loss.entropy_coef != 0)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = self._forward(self.ref_model, batch)
            loss, figs = policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.response_mask,
                                     self.cfg.loss, ref_logprobs=ref, entropy=entropy)
            # FSDP2 and DeepSpeed average gradients over ranks; multiplying by world_size turns that into the sum.
            self.strategy.backward(loss * (share * self.world_size), last=k == len(chunks) - 1)
            for k in LOSS_FIGURES:
                figures[k] += figs[k] * share if share else 0.0
            for k in TOKEN_FIGURES:
                figures[k] += figs[k] * token_share if token_share else 0.0
        names = list(figures)
        return dict(zip(names, self.strategy.all_reduce([figures[k] for k in names])))

    # ------------------------------------------------------------------ weights and checkpoints

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) float32 CPU weights under HF parameter names; with world_size > 1 only rank 0 gets
        them ({} elsewhere). Copies: training on does not change what was exported. Call on all ranks."""
        return self.strategy.export_weights()

    def save_checkpoint(self, directory: str | Path, trainer_state: dict) -> Path:
        """Write HF weights + tokenizer, optimizer state, learner and trainer state, and every rank's RNG state to
        `directory`, atomically (see checkpoint.py). Raises RuntimeError, leaving any older checkpoint intact,
        when the write fails. Call on all ranks."""
        return write_checkpoint(directory, trainer_state, strategy=self.strategy, model=self.model,
                                tokenizer=self.tokenizer, version=self.version, config=self.cfg)

    def load_checkpoint(self, directory: str | Path) -> dict:
        """Restore weights, optimizer state, version and this rank's RNG from `directory`; return trainer_state.
        Call on all ranks. A checkpoint with full optimizer state (FSDP2 or one process) resumes at any world size
        (RNG then restarts from the seed); a DeepSpeed one only under DeepSpeed at its own world size."""
        self.version, trainer_state = read_checkpoint(directory, strategy=self.strategy, config=self.cfg)
        # The config in force rules the hyper-parameters (a resumed run may change, say, the learning rate).
        for group in self.optimizer.param_groups:
            group.update(self._optimizer_hparams())
        return trainer_state
