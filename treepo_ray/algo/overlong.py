"""DAPO's overlong reward shaping ("soft overlong punishment", Yu et al. 2025, eq. 13): a response longer than
max_len - buffer_len loses reward linearly, down to -penalty_factor at max_len. The official TreePO script turns it
on with a 512-token buffer and factor 1.0 (verl's DAPO reward manager: the same formula, added to the score).

Applied to the trajectory rewards of scored trees right before credit assignment (AlgoConfig.advantages), so the
DAPO filter and the accuracy metrics still see the verifier's rewards (the script filters groups on accuracy too).
"""

from __future__ import annotations

from dataclasses import dataclass

from treepo_ray.tree.tree import Tree


@dataclass
class OverlongConfig:
    """The overlong reward buffer."""

    enable: bool = False
    """Subtract the overlong penalty from trajectory rewards before credit assignment."""
    buffer_len: int = 512
    """Tokens before the response limit where the penalty starts (official TreePO script: 512)."""
    penalty_factor: float = 1.0
    """Penalty at the response limit (official TreePO script: 1.0)."""
    max_len: int = 0
    """Response limit the buffer ends at; 0 = the sampler's response limit (filled in by the job config)."""

    def __post_init__(self) -> None:
        if self.buffer_len < 1:
            raise ValueError(f"algo.overlong.buffer_len = {self.buffer_len}; it must be >= 1")
        if self.penalty_factor < 0 or self.max_len < 0:
            raise ValueError("algo.overlong.penalty_factor and max_len must be >= 0")


def overlong_penalty(length: int, max_len: int, buffer_len: int, factor: float) -> float:
    """0 up to max_len - buffer_len tokens, then -(length - (max_len - buffer_len)) / buffer_len * factor."""
    return min(-(length - (max_len - buffer_len)) / buffer_len * factor, 0.0)


def with_overlong_penalty(trees: list[Tree], cfg: OverlongConfig) -> list[Tree]:
    """Copies of `trees` whose trajectory rewards carry the penalty (rewards re-propagated); the trees given are
    left as they are."""
    if cfg.max_len < 1:
        raise ValueError("algo.overlong.max_len is unset; the job config fills it in from the sampler")
    out = []
    for tree in trees:
        copy = Tree.from_dict(tree.to_dict())
        rewards = [tree.reward[n] + overlong_penalty(len(tree.response_ids(n)), cfg.max_len, cfg.buffer_len,
                                                     cfg.penalty_factor) for n in tree.trajectories]
        copy.set_trajectory_rewards(rewards)
        out.append(copy)
    return out
