"""How the Learner's model is trained across processes: one class per strategy, chosen by make_strategy.

    Strategy        world_size == 1 (whatever LearnerConfig.strategy says): the plain model and torch AdamW; also
                    the base whose behaviour the other two change only where they differ
    FSDP2           fully_shard per decoder layer and the root; optimizer state sharded alongside the parameters
    DeepSpeedZeRO   a DeepSpeed ZeRO-1/2 engine: whole parameters on every rank, optimizer state (and for stage 2
                    gradients) partitioned; DeepSpeed clips, skips non-finite steps and saves its own partitions

A strategy owns the process group (and the collectives the Learner needs), wraps the model and optimizer, and
answers the few questions where the strategies differ: which module to run forward on, whether to autocast, how to
run backward and the optimizer step, how to gather full weights, and how the optimizer state is saved and restored.
"""

from __future__ import annotations

import contextlib
import math
import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

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

from treepo_ray.learner.config import LearnerConfig

FULL_OPTIMIZER_STATE = "full"
"""Optimizer-state format of one process and FSDP2: one unsharded dict keyed by parameter name (any world size)."""
DEEPSPEED_OPTIMIZER_STATE = "deepspeed"
"""Optimizer-state format of DeepSpeedZeRO: DeepSpeed's own per-rank partitions (same world size only)."""


def assigned_gpus() -> str:
    """The GPUs this process was given, as CUDA_VISIBLE_DEVICES says (Ray sets it for an actor that asked for
    GPUs); '' when none."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    return "" if value in ("", "-1", "NoDevFiles") else value


def require_usable_cuda(who: str) -> None:
    """Stop with one line when this process was given GPUs that torch cannot use: running on the CPU instead would
    be silently slow, and the weight path, chosen from the resources asked for, would still pick NCCL."""
    gpus = assigned_gpus()
    if not gpus or torch.cuda.is_available():
        return
    try:
        driver = Path("/proc/driver/nvidia/version").read_text().splitlines()[0].strip()
    except (OSError, IndexError):
        driver = "no NVIDIA driver found (/proc/driver/nvidia/version)"
    raise RuntimeError(f"{who} was given GPU(s) CUDA_VISIBLE_DEVICES={gpus} but torch {torch.__version__} (CUDA "
                       f"{torch.version.cuda}) cannot use CUDA; driver: {driver}")


def pick_device(rank: int) -> torch.device:
    if not torch.cuda.is_available():
        require_usable_cuda(f"learner rank {rank}")
        return torch.device("cpu")
    # Under Ray each actor usually sees exactly one GPU; under torchrun LOCAL_RANK says which one is ours.
    local = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def make_strategy(cfg: LearnerConfig, rank: int = 0, world_size: int = 1, master_addr: str | None = None,
                  master_port: int | str | None = None) -> Strategy:
    """The strategy of this rank; with world_size > 1 it joins (or creates) the process group."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank = {rank} must lie in [0, world_size = {world_size})")
    if world_size > 1 and cfg.strategy == "none":
        raise ValueError(f"strategy = 'none' cannot train with world_size = {world_size}; use 'fsdp2'")
    device = pick_device(rank)
    # One rank trains the plain model, unless its caller made a process group of one for FSDP2 (jobs/gpu_check.py
    # measures FSDP2's mixed precision on one GPU).
    if world_size == 1 and not (cfg.strategy == "fsdp2" and dist.is_initialized() and dist.get_world_size() == 1):
        return Strategy(cfg, device)
    kind = FSDP2 if cfg.strategy == "fsdp2" else DeepSpeedZeRO
    return kind(cfg, device, rank, world_size, master_addr, master_port)


class Strategy:
    """One process trains the plain model with torch AdamW (the strategy for world_size == 1, and the behaviour
    FSDP2 and DeepSpeedZeRO share unless they override it)."""

    optimizer_format = FULL_OPTIMIZER_STATE
    """How a checkpoint holds the optimizer state (see checkpoint.py)."""

    def __init__(self, cfg: LearnerConfig, device: torch.device) -> None:
        self.cfg, self.device = cfg, device
        self.rank, self.world_size = 0, 1
        self.compute_dtype = getattr(torch, cfg.dtype)
        self.model: torch.nn.Module | None = None
        self.optimizer: Any = None

    # ------------------------------------------------------------------ set-up

    def load_model(self, path: str | Path, prepare: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
        """The model at `path` with float32 master weights on this rank's device, `prepare`d (in place) and sharded
        for this strategy."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        prepare(model)
        model.to(self.device)
        self.shard(model)
        return model

    def shard(self, model: torch.nn.Module) -> None:
        """Prepare a freshly loaded model (trained or reference) for this strategy, in place."""

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        """Take charge of the trained model and its optimizer; return the optimizer the Learner steps."""
        self.model, self.optimizer = model, optimizer
        return optimizer

    def close(self) -> None:
        """Release what this strategy set up (the process group it created, if any)."""

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        """Sum (or max) of `values` over all ranks."""
        return list(values)

    def first_error(self, error: str) -> str:
        """Share a failure between ranks so that all of them stop together (rank order decides which message)."""
        return error

    # ------------------------------------------------------------------ training

    @property
    def train_module(self) -> torch.nn.Module:
        """The module whose forward is differentiated."""
        return self.model

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        """Add the gradient of one micro-batch's `loss` (`last`: the mini-batch's final one)."""
        loss.backward()

    def step(self, loss: float) -> tuple[float, bool]:
        """Clip and take the optimizer step on the accumulated gradients, unless the loss or the gradient norm is
        not finite; clear the gradients. Returns (gradient norm before clipping, whether the step was taken)."""
        grad_norm = self._grad_norm(clip=True)
        ok = math.isfinite(loss) and math.isfinite(grad_norm)
        if ok:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, ok

    def grad_norm(self) -> float:
        """Global L2 norm of the accumulated gradient (not clipped)."""
        return self._grad_norm(clip=False)

    def _grad_norm(self, clip: bool) -> float:
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

    # ------------------------------------------------------------------ weights and optimizer state

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full float32 CPU copies of the weights on rank 0, {} elsewhere. Call on all ranks."""
        if self.rank != 0:  # DeepSpeed ZeRO-1/2: every rank holds whole parameters, rank 0 alone hands them out
            return {}
        return {k: v.detach().to("cpu", dtype=torch.float32, copy=True) for k, v in self.model.state_dict().items()}

    def full_optimizer_state(self) -> dict:
        """The whole (unsharded) optimizer state, keyed by parameter name, on CPU. Call on all ranks."""
        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_full_state(self, weights: dict[str, torch.Tensor], optimizer_state: dict) -> None:
        """Load full weights and optimizer state (read by rank 0; other ranks pass empty dicts). Call on all
        ranks."""
        # With ranks (FSDP2), rank 0 alone read the files and broadcasts them.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=self.world_size > 1)
        set_model_state_dict(self.model, weights, options=options)
        set_optimizer_state_dict(self.model, self.optimizer, optimizer_state, options=options)

    def require_own_gradients(self, what: str) -> None:
        """Raise ValueError when `what` needs the parameters' .grad and this strategy keeps gradients to itself."""


class _Distributed(Strategy):
    """Ranks joined by torch.distributed (gloo on CPU, nccl on GPU); they apply their own mixed precision."""

    def __init__(self, cfg: LearnerConfig, device: torch.device, rank: int, world_size: int,
                 master_addr: str | None, master_port: int | str | None) -> None:
        super().__init__(cfg, device)
        self.rank, self.world_size = rank, world_size
        self._owns_process_group = False
        if dist.is_initialized():
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise ValueError(f"a process group of world size {dist.get_world_size()} (rank {dist.get_rank()}) "
                                 f"already exists, but rank {rank} of {world_size} was requested")
            return
        addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = master_port or os.environ.get("MASTER_PORT")
        if not port:
            raise ValueError("world_size > 1 needs master_port (argument) or the MASTER_PORT environment variable")
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(minutes=30))
        self._owns_process_group = True

    def close(self) -> None:
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False

    def all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return t.tolist()

    def first_error(self, error: str) -> str:
        errors: list[str] = [""] * self.world_size
        dist.all_gather_object(errors, error)
        return next((e for e in errors if e), "")

    def autocast(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class FSDP2(_Distributed):
    """Parameters, gradients and optimizer state sharded with fully_shard; full weights gathered on rank 0."""

    def load_model(self, path: str | Path, prepare: Callable[[torch.nn.Module], None]) -> torch.nn.Module:
        """Rank 0 alone reads the weights, into host memory (once per node); every rank builds the model on the meta
        device, shards it there and takes its shards of rank 0's weights by broadcast: no GPU ever holds the whole
        model, and no other rank reads or allocates it."""
        from transformers import AutoConfig, AutoModelForCausalLM

        full = None
        if self.rank == 0:
            full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            prepare(full)  # the same module tree (and state-dict names) as the sharded model's
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
        prepare(model)
        self.shard(model)
        model.to_empty(device=self.device)
        weights = full.state_dict() if full is not None else {}
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True,
                                                                      broadcast_from_rank0=True))
        # Buffers outside the state dict (rotary frequencies) were left empty by to_empty: rank 0's, broadcast.
        kept = set(model.state_dict())
        source = dict(full.named_buffers()) if full is not None else {}
        for name, buffer in model.named_buffers():
            if name not in kept:
                if full is not None:
                    buffer.copy_(source[name])
                dist.broadcast(buffer, src=0)
        return model

    def shard(self, model: torch.nn.Module) -> None:
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

    def export_weights(self) -> dict[str, torch.Tensor]:
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


class DeepSpeedZeRO(_Distributed):
    """A DeepSpeed ZeRO engine (stage 1 or 2) around the model and AdamW. Gradient accumulation boundaries are set
    by backward() itself, so DeepSpeed's own accumulation count stays at 1."""

    optimizer_format = DEEPSPEED_OPTIMIZER_STATE

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
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
        self.engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config,
                                                            dist_init_required=False)
        return super().wrap(model, optimizer)

    @property
    def train_module(self) -> torch.nn.Module:
        return self.engine

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        # DeepSpeed decides to skip a step from the gradient norm alone; a non-finite loss must therefore make the
        # gradient non-finite too (adds exactly zero when the loss is finite).
        anchor = next(p for p in self.model.parameters() if p.requires_grad)
        loss = loss + (loss.detach() - loss.detach()) * anchor.sum()
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self, loss: float) -> tuple[float, bool]:
        # DeepSpeed clips, and skips a step with a non-finite gradient norm, itself.
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        ok = self.engine.skipped_steps == skipped_before
        grad_norm = self.engine.get_global_grad_norm()
        return float("nan") if grad_norm is None else float(grad_norm), ok

    def require_own_gradients(self, what: str) -> None:
        raise ValueError(f"{what} is not supported with strategy='deepspeed'")

    def save_partitions(self, directory: Path, tag: str) -> None:
        """Write this rank's share of the weights and optimizer state (DeepSpeed's layout). Call on all ranks."""
        self.engine.save_checkpoint(directory, tag=tag, save_latest=False)

    def load_partitions(self, directory: Path, tag: str) -> None:
        """Restore what save_partitions wrote at the same world size. Call on all ranks."""
        path, _ = self.engine.load_checkpoint(directory, tag=tag, load_module_strict=True,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint under {directory}")
