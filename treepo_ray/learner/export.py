"""The learner's weights as the engines load them: full tensors, cast to the engines' dtype, packed into one buffer
(engines/weights.py) on rank 0. Every rank must call it (with FSDP2 each full tensor is an all-gather).

With LoRA (LearnerConfig.lora_rank > 0) the trained model holds peft's LoRA layers (`X.base_layer.weight`,
`X.lora_A.default.weight`, `X.lora_B.default.weight`); what leaves the learner is the merged model under the base
model's names: `X.weight` = W + B @ A * scaling, computed on copies (the training copy is never changed), so the
engines load it like any full checkpoint."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from treepo_ray.engines.weights import PackedWeights, layout, view

ADAPTER = "default"
"""peft's adapter name inside the trained model."""


class LoraLayer(NamedTuple):
    scaling: float
    fan_in_fan_out: bool


class MergedTensor(NamedTuple):
    """One tensor of the merged model: `base` (a state-dict name of the trained model), plus B @ A * scaling when
    `lora_a` is set."""

    name: str
    base: str
    lora_a: str | None = None
    lora_b: str | None = None
    layer: LoraLayer | None = None


def lora_layers(model: torch.nn.Module) -> dict[str, LoraLayer]:
    """The modules of `model` that carry a LoRA adapter, by module name ({} without LoRA)."""
    found = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER in scaling and hasattr(module, "lora_A"):
            found[name] = LoraLayer(float(scaling[ADAPTER]), bool(getattr(module, "fan_in_fan_out", False)))
    return found


def is_adapter(name: str) -> bool:
    """Whether a state-dict name is a LoRA adapter's tensor."""
    return ".lora_A." in name or ".lora_B." in name


def merged_plan(names: list[str], layers: dict[str, LoraLayer]) -> list[MergedTensor]:
    """How each tensor of the merged model comes from the trained model's state dict (its `names`), in their order."""
    plan = []
    for name in names:
        if is_adapter(name):
            continue
        if ".base_layer." not in name:
            plan.append(MergedTensor(name, name))
            continue
        prefix, rest = name.split(".base_layer.", 1)
        layer = layers.get(prefix) if rest == "weight" else None
        if layer is None:  # the base layer's bias, or a module without adapter weights
            plan.append(MergedTensor(f"{prefix}.{rest}", name))
        else:
            plan.append(MergedTensor(f"{prefix}.{rest}", name, f"{prefix}.lora_A.{ADAPTER}.weight",
                                     f"{prefix}.lora_B.{ADAPTER}.weight", layer))
    return plan


def merge_one(item: MergedTensor, get) -> torch.Tensor:
    """The merged tensor of `item` (a new tensor, float32 when adapted); `get(name)` gives a full tensor."""
    weight = get(item.base)
    if item.lora_a is None:
        return weight
    a, b = get(item.lora_a).float(), get(item.lora_b).float()
    delta = (b @ a) * item.layer.scaling
    if item.layer.fan_in_fan_out:
        delta = delta.T
    return weight.float() + delta


def merged_state_dict(state: dict[str, torch.Tensor], layers: dict[str, LoraLayer]) -> dict[str, torch.Tensor]:
    """The merged model's full state dict from the trained model's full one (`state`, e.g. Strategy.export_weights);
    `state` unchanged. Without LoRA layers, `state` itself."""
    if not layers:
        return state
    return {item.name: merge_one(item, state.__getitem__) for item in merged_plan(list(state), layers)}


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a full state dict, under the names peft's save_pretrained writes (loadable by
    PeftModel.from_pretrained on the base model)."""
    return {"base_model.model." + k.replace(f".{ADAPTER}.", "."): v for k, v in state.items() if is_adapter(k)}


def from_adapter_state_dict(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of adapter_state_dict: the trained model's state-dict names."""
    out = {}
    for k, v in saved.items():
        k = k.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            k = k.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[k] = v
    return out


def export_packed(model: torch.nn.Module, dtype: torch.dtype | str, rank: int, pin: bool = False,
                  out: torch.Tensor | None = None) -> PackedWeights | None:
    """`model`'s weights (sharded or whole) in `dtype`, packed on rank 0 (None elsewhere); with LoRA the merged
    weights under the base model's names. The buffer is a numpy array (zero-copy through Ray's object store), or
    with `pin` a pinned torch tensor (fast copies to a GPU for NCCL), or `out` when it has the right size (a spare
    pinned buffer: pinning gigabytes anew every step takes seconds).

    Tensors are gathered one at a time, every rank in the same order, so rank 0 holds at most one full float32 tensor
    (with LoRA: one, its A and B and the merged one) besides the packed copy (never a full float32 state dict). Tied
    parameters are sent under each name: vLLM's in-place reload counts a layer without its weights (a tied lm_head)
    as failed and keeps its old values."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    named = dict(model.state_dict(keep_vars=True))
    plan = merged_plan(list(named), lora_layers(model))
    specs, nbytes = layout((item.name, dtype, named[item.base].shape) for item in plan)
    data = buffer = None
    if rank == 0:
        if out is not None and out.numel() == nbytes:
            data = buffer = out
        elif pin:
            data = buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            buffer = np.empty(nbytes, dtype=np.uint8)
            data = torch.from_numpy(buffer)

    def full(name: str) -> torch.Tensor:
        tensor = named[name]
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    with torch.no_grad():
        for spec, item in zip(specs, plan):
            tensor = merge_one(item, full)
            if data is not None:
                view(data, spec).copy_(tensor.to(dtype))
            del tensor
    return PackedWeights(specs, nbytes, buffer) if rank == 0 else None


def peft_lora_config(rank: int, alpha: float, target_modules: str | list[str], base: str | None = None):
    """peft's LoraConfig of the learner's adapters (no dropout: the recomputed and trained log-probs come from one
    function)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=base)
