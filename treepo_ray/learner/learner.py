"""The training step: a causal LM, AdamW, the clipped policy loss, FSDP2 across ranks, checkpoints and weight export.

One Learner per process (rank). With world_size > 1 every rank builds its own Learner with the same config, and
each call (compute_logprobs, train_step, export_weights, save/load_checkpoint) must be made on all ranks together,
each with its own shard of the samples: FSDP2 gathers parameters inside every forward and backward (and DeepSpeed
reduces gradients inside backward), so the ranks agree on how many micro-batches to run (a rank with fewer samples
runs zero-weighted dummy passes). With world_size == 1 the model is trained as is, whatever the strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from treepo_ray.algo.losses import policy_loss
from treepo_ray.learner.batch import Batch, TrainSample, collate
from treepo_ray.learner.checkpoint import COMPLETE_MARKER, commit_dir, temp_dir_for
from treepo_ray.learner.config import LearnerConfig

# Figures of policy_loss that are aggregated like the loss itself (weighted by the micro-batch's share of the
# normaliser) and those that are always a mean over response tokens (weighted by the token share).
LOSS_FIGURES = ("loss", "pg_loss", "kl", "entropy")
TOKEN_FIGURES = ("clip_frac", "clip_frac_low", "clip_frac_high", "clip_frac_dual", "approx_kl")
LEARNER_STATE = "learner_state.json"
OPTIMIZER_FILE = "optimizer.pt"  # full (unsharded) AdamW state, keyed by parameter name
DEEPSPEED_DIR, DEEPSPEED_TAG = "deepspeed", "zero"  # DeepSpeed's own per-rank optimizer partitions


def _pick_device(rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # Under Ray each actor usually sees exactly one GPU; under torchrun LOCAL_RANK says which one is ours.
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


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
        if not 0 <= rank < world_size:
            raise ValueError(f"rank = {rank} must lie in [0, world_size = {world_size})")
        if world_size > 1 and cfg.strategy == "none":
            raise ValueError(f"strategy = 'none' cannot train with world_size = {world_size}; use 'fsdp2'")
        self.model_path, self.rank, self.world_size = Path(model_path), rank, world_size
        self.device = _pick_device(rank)
        self.distributed = world_size > 1
        self.fsdp = self.distributed and cfg.strategy == "fsdp2"
        self._owns_process_group = False
        if self.distributed:
            self._init_process_group(master_addr, master_port)
        torch.manual_seed(cfg.seed + rank)
        self.compute_dtype = getattr(torch, cfg.dtype)

        self.model = self._load_model(trainable=True)
        self.ref_model = self._load_model(trainable=False) if cfg.needs_ref_model else None
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **self._optimizer_hparams())
        self.engine = None
        if self.distributed and cfg.strategy == "deepspeed":
            self.engine = self._init_deepspeed()
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

    def _init_process_group(self, master_addr: str | None, master_port: int | str | None) -> None:
        if dist.is_initialized():
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise ValueError(f"a process group of world size {dist.get_world_size()} (rank {dist.get_rank()}) "
                                 f"already exists, but rank {self.rank} of {self.world_size} was requested")
            return
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = master_port or os.environ.get("MASTER_PORT")
        if not port:
            raise ValueError("world_size > 1 needs master_port (argument) or the MASTER_PORT environment variable")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(minutes=30))
        self._owns_process_group = True

    def _optimizer_hparams(self) -> dict[str, Any]:
        cfg = self.cfg
        return dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)

    def _load_model(self, trainable: bool) -> PreTrainedModel:
        # Master weights in float32; a lower compute dtype is applied by FSDP2's mixed precision or autocast.
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        model.config.use_cache = False
        if trainable and self.cfg.gradient_checkpointing:
            # transformers 5 renamed gradient_checkpointing_enable (deprecated) to activation_checkpointing_enable.
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
        if not trainable:
            model.requires_grad_(False)
        model.to(self.device)
        if self.fsdp:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(self.device.type, (self.world_size,))
            mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
            # One FSDP unit per decoder layer (its parameters are gathered just for its own forward/backward),
            # then the root for what is left: embeddings, final norm, head.
            block_names = set(getattr(model, "_no_split_modules", None) or [])
            for module in model.modules():
                if type(module).__name__ in block_names:
                    fully_shard(module, mesh=mesh, mp_policy=mp)
            fully_shard(model, mesh=mesh, mp_policy=mp)
        # Dropout off in every pass, so the recomputed old log-probs and the trained ones come from one function.
        # Exception: HF runs gradient checkpointing only in training mode (the config's dropout then applies).
        model.train(trainable and self.cfg.gradient_checkpointing)
        return model

    def _init_deepspeed(self) -> Any:
        """Wrap the model and AdamW in a DeepSpeed ZeRO engine (stage 1 or 2: parameters stay whole on every rank,
        optimizer state (and for stage 2 gradients) are partitioned). Gradient accumulation boundaries are set by
        backward() itself, so DeepSpeed's own accumulation count stays at 1."""
        import deepspeed

        # DeepSpeed reads its launcher's variables even when the process group already exists.
        local_rank = self.device.index if self.device.type == "cuda" else self.rank
        for key, value in (("LOCAL_RANK", local_rank), ("RANK", self.rank), ("WORLD_SIZE", self.world_size)):
            os.environ.setdefault(key, str(value))
        cfg = self.cfg
        ds_config = {
            "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": cfg.grad_clip if cfg.grad_clip > 0 else 0.0,
            "zero_optimization": {"stage": cfg.zero_stage},
            "zero_allow_untested_optimizer": True,  # the client optimizer is plain torch AdamW
            "bf16": {"enabled": cfg.dtype == "bfloat16"},
            "fp16": {"enabled": cfg.dtype == "float16"},
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        engine, optimizer, _, _ = deepspeed.initialize(model=self.model, optimizer=self.optimizer, config=ds_config,
                                                       dist_init_required=False)
        self.optimizer = optimizer
        return engine

    def close(self) -> None:
        """Release the process group this Learner created (if any)."""
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False

    # ------------------------------------------------------------------ collectives

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        if not self.distributed:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    # ------------------------------------------------------------------ forward

    def _autocast(self) -> contextlib.AbstractContextManager:
        # FSDP2 and DeepSpeed apply their own mixed precision.
        if self.compute_dtype == torch.float32 or self.fsdp or self.engine is not None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def _forward(
        self, model: torch.nn.Module, batch: Batch, entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target-aligned token log-probs [B, L-1] and (optionally) the policy's entropy at each position."""
        with self._autocast():
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
        n = int(self._all_reduce([len(chunks)], op="max")[0])
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

        tokens, seqs = self._all_reduce([sum(len(s.response_ids) for s in samples), len(samples)])
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
        if self.engine is not None:
            raise ValueError("per_group_grad_norms is not supported with strategy='deepspeed'")
        norms = []
        self.optimizer.zero_grad(set_to_none=True)
        for g, group in enumerate(groups):
            group = list(group)
            if not group and not self.distributed:
                raise ValueError(f"groups[{g}] is empty; every group needs at least one sample")
            self._validate(group)
            missing = [i for i, s in enumerate(group) if s.old_logprobs is None]
            for i, lp in zip(missing, self.compute_logprobs([group[i] for i in missing])):
                group[i] = dataclasses.replace(group[i], old_logprobs=lp)
            figures = self.backward(group)
            norms.append(self._grad_norm_and_clip(clip=False) if figures else 0.0)
            self.optimizer.zero_grad(set_to_none=True)
        return norms

    def _optimizer_step(self, samples: list[TrainSample]) -> dict[str, float] | None:
        """Accumulate gradients over micro-batches (and ranks), then clip and step. None if no rank has samples."""
        figures = self.backward(samples)
        if not figures:
            return None
        if self.engine is not None:  # DeepSpeed clips, and skips a step with a non-finite gradient norm, itself
            skipped_before = self.engine.skipped_steps
            self.engine.step()
            ok = self.engine.skipped_steps == skipped_before
            self.version += int(ok)
            grad_norm = self.engine.get_global_grad_norm()
            return figures | {"grad_norm": float("nan") if grad_norm is None else float(grad_norm),
                              "skipped": float(not ok)}
        grad_norm = self._grad_norm_and_clip()
        ok = math.isfinite(figures["loss"]) and math.isfinite(grad_norm)
        if ok:
            self.optimizer.step()
            self.version += 1
        self.optimizer.zero_grad(set_to_none=True)
        return figures | {"grad_norm": grad_norm, "skipped": float(not ok)}

    def backward(self, samples: list[TrainSample]) -> dict[str, float]:
        """Add to the parameters' .grad the gradient of the loss of one mini-batch, of which `samples` is this
        rank's shard (each with old_logprobs), normalised over the whole mini-batch on all ranks; no optimizer
        step. Returns the loss figures of the whole mini-batch ({} when no rank has samples)."""
        for i, s in enumerate(samples):
            if s.old_logprobs is None:
                raise ValueError(f"samples[{i}].old_logprobs is None; backward needs them (train_step fills them)")
        agg = self.cfg.loss.aggregation
        g_tokens, g_seqs = self._all_reduce([sum(len(s.response_ids) for s in samples), len(samples)])
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
            logprobs, entropy = self._forward(self.engine or self.model, batch, entropy=True,
                                              entropy_grad=self.cfg.loss.entropy_coef != 0)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = self._forward(self.ref_model, batch)
            loss, figs = policy_loss(logprobs, batch.old_logprobs, batch.advantages, batch.response_mask,
                                     self.cfg.loss, ref_logprobs=ref, entropy=entropy)
            # FSDP2 and DeepSpeed average gradients over ranks; multiplying by world_size turns that into the sum.
            self._backward(loss * (share * self.world_size), last=k == len(chunks) - 1)
            for k in LOSS_FIGURES:
                figures[k] += figs[k] * share if share else 0.0
            for k in TOKEN_FIGURES:
                figures[k] += figs[k] * token_share if token_share else 0.0
        names = list(figures)
        return dict(zip(names, self._all_reduce([figures[k] for k in names])))

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        if self.engine is None:
            loss.backward()
            return
        # DeepSpeed decides to skip a step from the gradient norm alone; a non-finite loss must therefore make the
        # gradient non-finite too (adds exactly zero when the loss is finite).
        anchor = next(p for p in self.model.parameters() if p.requires_grad)
        loss = loss + (loss.detach() - loss.detach()) * anchor.sum()
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def _grad_norm_and_clip(self, clip: bool = True) -> float:
        """Global L2 norm of the gradient (before clipping); clips in place when it is finite (and `clip`)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):  # sharded grads: partial norms, combined across ranks
            norm = norm.full_tensor()
        value = float(norm)
        if clip and self.cfg.grad_clip > 0 and math.isfinite(value):
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, norm)
        return value

    # ------------------------------------------------------------------ weights and checkpoints

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) float32 CPU weights under HF parameter names; with world_size > 1 only rank 0 gets
        them ({} elsewhere). Copies: training on does not change what was exported. Call on all ranks."""
        if self.fsdp:
            return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True,
                                                                              cpu_offload=True))
        if self.rank != 0:  # DeepSpeed ZeRO-1/2: every rank holds whole parameters, rank 0 alone hands them out
            return {}
        return {k: v.detach().to("cpu", dtype=torch.float32, copy=True) for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, directory: str | Path, trainer_state: dict) -> Path:
        """Write HF weights + tokenizer, optimizer state, learner and trainer state, and every rank's RNG state to
        `directory`, atomically (see checkpoint.py). Raises RuntimeError, leaving any older checkpoint intact,
        when the write fails. Call on all ranks."""
        final = Path(directory)
        tmp = temp_dir_for(final)
        try:
            trainer_json = json.dumps(trainer_state, indent=2)
        except (TypeError, ValueError) as err:
            raise ValueError(f"trainer_state is not JSON-serialisable: {err}") from err
        weights = self.export_weights()  # collective on FSDP2
        optim = None
        if self.engine is None:
            optim = get_optimizer_state_dict(self.model, self.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        error = ""
        if self.rank == 0:
            error = self._guard(lambda: self._write_rank0(tmp, weights, optim))
        error = self._first_error(error)
        if not error and self.engine is not None:
            error = self._first_error(self._guard(lambda: self.engine.save_checkpoint(
                tmp / DEEPSPEED_DIR, tag=DEEPSPEED_TAG, save_latest=False)))
        if not error:
            rng_file = tmp / f"rng_rank{self.rank}.pt"
            error = self._first_error(self._guard(lambda: torch.save(self._rng_state(), rng_file)))
        if not error and self.rank == 0:
            def finish() -> None:
                # The marker file goes last: a folder without it is never taken for a checkpoint.
                (tmp / COMPLETE_MARKER).write_text(trainer_json)
                commit_dir(tmp, final)

            error = self._guard(finish)
        error = self._first_error(error)
        if error:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"could not write checkpoint {final}: {error}; the previous checkpoint is untouched")
        return final

    def _write_rank0(self, tmp: Path, weights: dict, optim: dict | None) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.model.save_pretrained(tmp, state_dict=weights)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(tmp)
        if optim is not None:
            torch.save(optim, tmp / OPTIMIZER_FILE)
        state = {"version": self.version, "world_size": self.world_size,
                 "optimizer_format": "full" if optim is not None else DEEPSPEED_DIR,
                 "learner_config": dataclasses.asdict(self.cfg)}
        (tmp / LEARNER_STATE).write_text(json.dumps(state, indent=2))

    @staticmethod
    def _guard(fn) -> str:
        try:
            fn()
        except Exception as err:  # noqa: BLE001 - e.g. safetensors' own error on a full disk; ranks must agree
            return f"{type(err).__name__}: {err}"
        return ""

    def _first_error(self, error: str) -> str:
        """Share a failure between ranks so that all of them stop together (rank order decides which message)."""
        if not self.distributed:
            return error
        errors: list[str] = [""] * self.world_size
        dist.all_gather_object(errors, error)
        return next((e for e in errors if e), "")

    def _rng_state(self) -> dict[str, Any]:
        state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_checkpoint(self, directory: str | Path) -> dict:
        """Restore weights, optimizer state, version and this rank's RNG from `directory`; return trainer_state.
        Call on all ranks. A checkpoint with full optimizer state (FSDP2 or one process) resumes at any world size
        (RNG then restarts from the seed); a DeepSpeed one only under DeepSpeed at its own world size."""
        directory = Path(directory)
        if not (directory / COMPLETE_MARKER).is_file():
            raise FileNotFoundError(f"{directory} is not a complete checkpoint (no {COMPLETE_MARKER})")
        learner_state = json.loads((directory / LEARNER_STATE).read_text())
        fmt, saved_ws = learner_state.get("optimizer_format", "full"), learner_state["world_size"]
        want = "full" if self.engine is None else DEEPSPEED_DIR
        if fmt != want or (fmt == DEEPSPEED_DIR and saved_ws != self.world_size):
            raise ValueError(f"{directory} holds {fmt!r} optimizer state from world size {saved_ws}; this learner "
                             f"(strategy {self.cfg.strategy!r}, world size {self.world_size}) needs {want!r}"
                             + (" at the same world size" if want == DEEPSPEED_DIR else ""))
        if self.engine is not None:
            path, _ = self.engine.load_checkpoint(directory / DEEPSPEED_DIR, tag=DEEPSPEED_TAG,
                                                  load_module_strict=True, load_optimizer_states=True,
                                                  load_lr_scheduler_states=False)
            if path is None:
                raise FileNotFoundError(f"DeepSpeed found no checkpoint under {directory / DEEPSPEED_DIR}")
        else:
            full = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.fsdp)
            weights: dict[str, torch.Tensor] = {}
            optim: dict = {}
            if self.rank == 0 or not self.fsdp:
                weights = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
                optim = torch.load(directory / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
            set_model_state_dict(self.model, weights, options=full)
            set_optimizer_state_dict(self.model, self.optimizer, optim, options=full)
        # The config in force rules the hyper-parameters (a resumed run may change, say, the learning rate).
        for group in self.optimizer.param_groups:
            group.update(self._optimizer_hparams())
        self.version = int(learner_state["version"])
        rng_file = directory / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)  # our own file: holds Python/numpy RNG tuples
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        else:
            torch.manual_seed(self.cfg.seed + self.rank + self.version)
        return json.loads((directory / COMPLETE_MARKER).read_text())
