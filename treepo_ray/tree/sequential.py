"""Sequential (i.i.d.) growth: G independent samples, grown segment by segment.

The root asks for G children once; every path then continues with one child per segment until an early-stop
rule ends it (the same rules, in the same order, as TreePO). So sequential and TreePO sampling differ only in
branching, and the same engine, driver and early stops serve both. Paths advance independently.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from treepo_ray.tree.growth import Ask, Grower, PathLimits, check_positive
from treepo_ray.tree.tree import Tree


@dataclass
class SequentialConfig(PathLimits):
    """Sequential (GRPO/DAPO) sampling, segment by segment."""

    group_size: int = 16
    """G: independent samples per prompt."""

    def __post_init__(self) -> None:
        check_positive("SequentialConfig", group_size=self.group_size, segment_len=self.segment_len,
                       max_depth=self.max_depth)
        self.check_limits()


class SequentialGrower(Grower):
    """Grows G independent paths of one prompt."""

    def __init__(
        self, tree: Tree, cfg: SequentialConfig, *, eos_token_id: int, decode: Callable[[list[int]], str], seed: int
    ):
        super().__init__(tree, cfg.stop_rules(), eos_token_id=eos_token_id, decode=decode, seed=seed)
        self.cfg = cfg
        self.align = cfg.segment_align
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
