"""Sequential (i.i.d.) growth: G independent samples, grown segment by segment.

The root asks for G children once; every path then continues with one child per segment until an early-stop
rule ends it (the same rules, in the same order, as TreePO). So sequential and TreePO sampling differ only in
branching, and the same engine, driver and early stops serve both. Paths advance independently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from treepo_ray.tree.growth import Ask, Grower, StopRules, check_positive
from treepo_ray.tree.tree import Tree


@dataclass
class SequentialConfig:
    """Sequential (GRPO/DAPO) sampling, segment by segment."""

    group_size: int = 16
    """G: independent samples per prompt."""
    segment_len: int = 512
    """Most tokens per segment (one ask per path per segment)."""
    max_depth: int = 14
    """Most segments on one path."""
    max_response_len: int | None = None
    """Response token limit ('max_length'); 0 or None = max_depth * segment_len."""
    require_eos_after_boxed: bool = False
    """A boxed answer ends a path only if the path also ended with EOS."""
    repetition_substr_len: int = 32
    """Characters of the repeated substring looked for in each new segment's text (0 = no repetition check)."""
    repetition_min_count: int = 8
    """Occurrences (overlaps counted) of that substring that end the path as 'repetition' (0 = no check)."""

    def __post_init__(self) -> None:
        check_positive("SequentialConfig", group_size=self.group_size, segment_len=self.segment_len,
                       max_depth=self.max_depth)
        if self.max_response_len is not None and self.max_response_len < 0:
            raise ValueError(f"SequentialConfig.max_response_len must be >= 0, got {self.max_response_len}")
        if self.repetition_substr_len < 0 or self.repetition_min_count < 0:
            raise ValueError("SequentialConfig.repetition_substr_len and repetition_min_count must be >= 0")

    def response_limit(self) -> int:
        return self.max_response_len or self.max_depth * self.segment_len

    def stop_rules(self) -> StopRules:
        return StopRules(
            max_depth=self.max_depth,
            max_response_len=self.response_limit(),
            require_eos_after_boxed=self.require_eos_after_boxed,
            repetition_substr_len=self.repetition_substr_len,
            repetition_min_count=self.repetition_min_count,
        )


class SequentialGrower(Grower):
    """Grows G independent paths of one prompt."""

    def __init__(
        self, tree: Tree, cfg: SequentialConfig, *, eos_token_id: int, decode: Callable[[list[int]], str], seed: int
    ):
        super().__init__(tree, cfg.stop_rules(), eos_token_id=eos_token_id, decode=decode, seed=seed)
        self.cfg = cfg
        self._ask(0, cfg.group_size, cfg.segment_len)

    def _grow(self, ask: Ask, nodes: list[int]) -> None:
        for n in nodes:
            if self.tree.finish[n] == "none":
                self._ask(n, 1, self.cfg.segment_len)
            else:
                self._finish(n)
        if self._idle():
            self._finished.sort(key=self._address)
            self._close()
