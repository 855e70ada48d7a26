"""The embedded default engine: a transformers causal LM behind a tree-aware KV cache, CPU or GPU.

Split by concern:
- model.py: its own fused forward over the HF model's weights (Llama / Qwen2 / Qwen3 / Mistral family), run over rows of
  one preallocated KV buffer; `load_weights` updates the HF model and the fused tensors alike.
- sampler.py: temperature / top-k / top-p sampling with one counter-based uniform per (child seed, token index),
  so the same seeds give the same tokens whatever else is in the batch.
- cache.py: every node's KV kept once, as an entry chained to its parent's; released by the caller, capped with
  LRU eviction, an evicted prefix recomputed from its token ids.
- engine.py: `HFEngine`, the scheduling: requests, admission into rows, the decode loop, counters, weight loads.
"""

from treepo_ray.engines.hf.engine import HFEngine

__all__ = ["HFEngine"]
