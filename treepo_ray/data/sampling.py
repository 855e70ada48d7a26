"""Test-time sampling: n answers per record, grown with the project's own engine and growers (sequential i.i.d.
paths, or one TreePO tree per record), seeded per record. `treepo-ray eval` and the base model's pretraining
evaluation both sample through here.
"""

from __future__ import annotations

from dataclasses import dataclass

from treepo_ray.data.prompts import Prompt
from treepo_ray.engines.decode import safe_decode

SAMPLERS = ("sequential", "treepo")


@dataclass
class SampleSettings:
    """How answers are sampled at test time."""

    sampler: str = "sequential"
    """'sequential' (n independent paths) or 'treepo' (one tree of n trajectories per problem)."""
    n: int = 8
    """Answers per problem (the group size, or the tree's width)."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy; then n is 1)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_new_tokens: int = 96
    """Response length cap (segment_len * max_depth at most)."""
    segment_len: int = 32
    """Tokens per segment (tree sampling branches at segment ends)."""
    divergence: int = 2
    """TreePO: children of the root and branches per path per round."""
    seed: int = 0
    """Seed of the sampling streams."""


SEED_STRIDE = 1_000_003


def problem_seed(seed: int, i: int) -> int:
    """Seed of the sampling stream of the i-th record of an evaluation with `seed` (trainer.seed)."""
    return seed * SEED_STRIDE + i


def request_seed(seed: int, i: int) -> int:
    """The seed of the i-th record's answers drawn as one request of n children (child j draws from seed + j):
    problem_seed spaced SEED_STRIDE apart, so no two records share a child's stream."""
    return problem_seed(seed, i) * SEED_STRIDE


def sample_answers(records: list[Prompt], engine, tokenizer, s: SampleSettings,
                   stats: dict | None = None) -> list[list[str]]:
    """Texts of the sampled responses of each record, grown on `engine` (n per record; 1 when greedy).
    `stats`, when given, receives the driver's counters (generated_tokens, forward_tokens, wall_s, ...)."""
    from treepo_ray.engines.base import SamplingParams
    from treepo_ray.engines.driver import grow
    from treepo_ray.tree import SequentialConfig, SequentialGrower, TreePOConfig, TreePOGrower, Tree

    if s.sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {s.sampler!r}")
    n = 1 if s.temperature == 0 else s.n
    depth = max(1, -(-s.max_new_tokens // s.segment_len))
    # Repetition checks off: evaluation judges whatever the model writes within the length cap.
    if s.sampler == "sequential":
        cfg = SequentialConfig(group_size=n, segment_len=s.segment_len, max_depth=depth,
                               max_response_len=s.max_new_tokens, repetition_substr_len=0)
        make = lambda tree, seed: SequentialGrower(tree, cfg, eos_token_id=eos, decode=decode, seed=seed)  # noqa: E731
    else:
        d = min(s.divergence, n)
        cfg = TreePOConfig(width=n, max_depth=depth, segment_len=s.segment_len, init_divergence=d,
                           branch_factor=d, max_response_len=s.max_new_tokens, repetition_substr_len=0)
        make = lambda tree, seed: TreePOGrower(tree, cfg, eos_token_id=eos, decode=decode, seed=seed)  # noqa: E731
    eos = tokenizer.eos_token_id
    decode = lambda ids: safe_decode(tokenizer, ids, skip_special_tokens=True)  # noqa: E731
    growers = [make(Tree(prompt_ids=list(r.prompt_ids), query_id=r.id), problem_seed(s.seed, i))
               for i, r in enumerate(records)]
    counters = grow(growers, engine, SamplingParams(temperature=s.temperature, top_p=s.top_p))
    if stats is not None:
        stats.update(counters)
    return [[decode(g.tree.response_ids(node)) for node in g.tree.trajectories] for g in growers]
