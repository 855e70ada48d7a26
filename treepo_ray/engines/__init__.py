"""Layer 3: generation engines behind one protocol (base.py), and the driver that grows trees on them."""

from __future__ import annotations

import importlib
from pathlib import Path

from treepo_ray.engines.base import Engine, SamplingParams, SegmentRequest, SegmentResult, generate

# name -> "module:class". Each class takes (model_path, **kw). Another backend registers here; its module is only
# imported when it is asked for, so optional dependencies (vLLM) stay optional.
ENGINES: dict[str, str] = {
    "hf": "treepo_ray.engines.hf:HFEngine",
    "vllm": "treepo_ray.engines.vllm:VLLMEngine",
}


def make_engine(name: str, model_path: str | Path, **kw) -> Engine:
    """Build the engine called `name` (a key of ENGINES) for the model directory `model_path`."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known: {sorted(ENGINES)}")
    module_name, cls_name = ENGINES[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"engine {name!r} is not available here ({module_name}: {e})") from e
    return getattr(module, cls_name)(model_path, **kw)


__all__ = [
    "ENGINES",
    "Engine",
    "SamplingParams",
    "SegmentRequest",
    "SegmentResult",
    "generate",
    "make_engine",
]
