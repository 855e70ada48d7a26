"""The generation protocol every engine implements.

A request asks for `n` children of one prefix, each at most `max_new_tokens` long. The prefix always travels as
token ids, so any engine can serve it; `parent_key` additionally names a cached node of *this* engine (a key the
engine returned with an earlier segment), so a prefix-caching engine continues from that cache instead of
recomputing the prefix. A key that is unknown (evicted, or another engine's) falls back to the token ids.
Engines batch continuously: `add_requests` may be called between `step` calls, and `step` returns whatever
finished in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from treepo_ray.tree import Segment


@dataclass
class SamplingParams:
    """How tokens are drawn."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Keep only the k most likely tokens (0 = off)."""
    seed: int | None = None
    """Seed of this request's random stream: the same request and seed give the same tokens."""
    entropy: bool = False
    """Report each sampled token's entropy (Segment.entropies): of the distribution the log-probs are taken from (at
    the sampling temperature, before top-k/top-p), exactly or as a lower bound from its most likely tokens."""


@dataclass
class SegmentRequest:
    """Sample `n` continuations of one prefix."""

    request_id: str
    """Unique id chosen by the caller; results carry it back."""
    prefix_ids: list[int]
    """Full prefix: prompt plus every generated token so far."""
    max_new_tokens: int
    """Length cap of each child segment."""
    n: int = 1
    """How many children to sample from this prefix."""
    params: SamplingParams = field(default_factory=SamplingParams)
    """Sampling parameters, shared by the children (child j uses seed + j)."""
    parent_key: str | None = None
    """Cache key of the node this prefix ends at, as returned by this engine earlier; None = no cached node."""
    stop_at_eos: bool = True
    """End a child at the EOS token (it is kept as the segment's last token)."""
    stop_entropy: float = 0.0
    """End a child before a token whose distribution's entropy (nats) reaches this, once it holds `min_new_tokens`
    tokens: the token is not sampled, the child ends with finish_reason 'branch' and its `branch_entropy`, so that
    children of it diverge exactly there (0 = off)."""
    min_new_tokens: int = 0
    """Tokens a child holds at least before `stop_entropy` may end it (>= 1 when it is on)."""


@dataclass
class SegmentResult:
    """The children of one request, in child order (the segment type is the tree layer's: growers take it as is)."""

    request_id: str
    children: list[Segment]
    weights_version: int = 0
    """Version of the weights that generated these tokens."""
    forward_tokens: int | None = None
    """Positions the engine ran through the model for this request alone: the part of its prefix not taken from a
    cache (with a cached parent, just the parent's last token, which was sampled but never fed), then every child's
    sampled tokens but its last. None where the engine cannot tell (the runtime then has no per-tree figure)."""
    prefix_key: str | None = None
    """Cache key of the node the children continue (the request's `parent_key`, or, for a prefix it named by no key
    such as a prompt, the entry the engine made or found for it), so that a later request from the same node (a
    fallback at the root) continues from that cache instead of recomputing; None = not cached by key."""
    cached_tokens: int = 0
    """Positions of its prefix taken from a cache instead of being run (what the parent's key or a prompt already
    computed, possibly by another tree or an earlier step)."""


class Engine(Protocol):
    """What the sampler and the runtime need of a generation backend."""

    eos_token_id: int
    weights_dtype: str
    """The dtype the engine keeps its weights in (what the learner exports for it), e.g. 'bfloat16'."""
    loads_weights_while_running: bool
    """`load_weights` may come between two steps while sequences run (else the runtime lets them finish first)."""
    loads_weight_stream: bool
    """`load_weights` also takes an iterator of (name, tensor) pairs and consumes it as it loads (a broadcast's
    buckets, without a second copy of the model)."""

    def add_requests(self, requests: list[SegmentRequest]) -> None: ...

    def step(self) -> list[SegmentResult]:
        """Advance every pending request by one decode step; return the requests that finished."""
        ...

    def has_unfinished(self) -> bool: ...

    def release(self, keys: list[str]) -> None:
        """Free the caches of nodes that will never be continued or branched from again."""
        ...

    def stats(self) -> dict:
        """Counters: forward_tokens (every position run through the model), cache_hits, cached_tokens, steps (model
        steps), step_sequences (summed over steps: sequences that sampled a token), steps_at_cap (steps whose batch
        was full), ...; and gauges: open_sequences (children not yet finished, running or waiting) and
        max_sequences (the batch's cap), which tell a caller whether more work would be run at once."""
        ...

    def load_weights(self, state_dict: dict, version: int) -> None: ...

    def score(self, prefix_ids: list[int], token_ids: list[int], temperature: float) -> list[float]:
        """Log-probs of `token_ids` after `prefix_ids` under the current weights at `temperature`, teacher-forced
        (CATPO's grafted branches); ValueError where the engine cannot."""
        ...


def generate(engine: Engine, requests: list[SegmentRequest]) -> list[SegmentResult]:
    """Run `requests` to completion and return their results in request order."""
    engine.add_requests(requests)
    done: dict[str, SegmentResult] = {}
    while engine.has_unfinished():
        for result in engine.step():
            done[result.request_id] = result
    return [done[r.request_id] for r in requests]
