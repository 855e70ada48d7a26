"""The learner's weights as the engines load them: full tensors, cast to the engines' dtype, packed into one buffer
(engines/weights.py) on rank 0. Every rank must call it (with FSDP2 each full tensor is an all-gather)."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from treepo_ray.engines.weights import PackedWeights, layout, view


def export_packed(model: torch.nn.Module, dtype: torch.dtype | str, rank: int, pin: bool = False,
                  out: torch.Tensor | None = None) -> PackedWeights | None:
    """`model`'s weights (sharded or whole) in `dtype`, packed on rank 0 (None elsewhere). The buffer is a numpy array
    (zero-copy through Ray's object store), or with `pin` a pinned torch tensor (fast copies to a GPU for NCCL), or
    `out` when it has the right size (a spare pinned buffer: pinning gigabytes anew every step takes seconds).

    Tensors are gathered one at a time, every rank in the same order, so rank 0 holds at most one full float32 tensor
    besides the packed copy (never a full float32 state dict). Tied parameters are sent under each name: vLLM's
    in-place reload counts a layer without its weights (a tied lm_head) as failed and keeps its old values."""
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    named = list(model.state_dict(keep_vars=True).items())
    specs, nbytes = layout((name, dtype, tensor.shape) for name, tensor in named)
    data = buffer = None
    if rank == 0:
        if out is not None and out.numel() == nbytes:
            data = buffer = out
        elif pin:
            data = buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            buffer = np.empty(nbytes, dtype=np.uint8)
            data = torch.from_numpy(buffer)
    with torch.no_grad():
        for spec, (_, tensor) in zip(specs, named):
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            if data is not None:
                view(data, spec).copy_(full.to(dtype))
            del full
    return PackedWeights(specs, nbytes, buffer) if rank == 0 else None
