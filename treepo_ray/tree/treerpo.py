"""TreeRPO growth: a full N-ary tree of depth D with steps of L tokens (TreeRPO, as summarised in the CATPO paper).

Every node that goes on asks for N children at once; a path stops at EOS, at the response length limit or at
depth D. Nodes advance independently (there is no budget to share, so nothing waits for a depth to complete).
The trajectories are all leaves: N^D of them when nothing ends early.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from treepo_ray.tree.growth import Ask, Grower, StopRules, check_positive
from treepo_ray.tree.tree import Tree


@dataclass
class TreeRPOConfig:
    """TreeRPO tree sampling."""

    n_children: int = 8
    """N: children of every node that goes on."""
    max_depth: int = 3
    """D: depth of the tree (segments per full path)."""
    step_len: int = 384
    """L: most tokens per step (segment)."""
    max_response_len: int | None = None
    """Response token limit ('max_length'); 0 or None = max_depth * step_len."""

    def __post_init__(self) -> None:
        check_positive("TreeRPOConfig", n_children=self.n_children, max_depth=self.max_depth, step_len=self.step_len)
        if self.max_response_len is not None and self.max_response_len < 0:
            raise ValueError(f"TreeRPOConfig.max_response_len must be >= 0, got {self.max_response_len}")

    def response_limit(self) -> int:
        return self.max_response_len or self.max_depth * self.step_len

    def stop_rules(self) -> StopRules:
        # TreeRPO stops on EOS and the limits only: no boxed or repetition check.
        return StopRules(max_depth=self.max_depth, max_response_len=self.response_limit(), check_boxed=False)


class TreeRPOGrower(Grower):
    """Grows one prompt's N-ary TreeRPO tree."""

    def __init__(
        self, tree: Tree, cfg: TreeRPOConfig, *, eos_token_id: int, decode: Callable[[list[int]], str], seed: int
    ):
        super().__init__(tree, cfg.stop_rules(), eos_token_id=eos_token_id, decode=decode, seed=seed)
        self.cfg = cfg
        self._ask(0, cfg.n_children, cfg.step_len)

    def _grow(self, ask: Ask, nodes: list[int]) -> None:
        for n in nodes:
            if self.tree.finish[n] == "none":
                self._ask(n, self.cfg.n_children, self.cfg.step_len)
            else:
                self._finish(n)
        if self._idle():
            self._finished.sort(key=self._address)
            self._close()
