"""The prompt record, from the dataset loader to the tree schedulers, and the stream that hands prompts out in a
reproducible order."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Prompt:
    """One prompt with what is needed to grow and score its tree."""

    id: str
    """Unique in its dataset (the stream makes it unique over a run: `<id>#<position>`); routes the tree's requests."""
    prompt_ids: tuple[int, ...]
    """Token ids the policy continues."""
    ground_truth: object
    """What the verifier compares an answer with: a string, a list of acceptable answers, or whatever JSON value a
    custom reward function reads (verl's reward_model.ground_truth)."""
    data_source: str = ""
    """Picks the verifier (rewards/router.py); read from the row's data.reward_fn_key field."""
    prompt_text: str = ""
    """The rendered prompt (what prompt_ids encode), for logs."""
    seed: int = 0
    """Seed of the tree's sampling (set by PromptStream from the stream position)."""
    extra_info: dict = field(default_factory=dict)
    """The row's `extra_info` (verl layout), passed to the reward function as is."""


class PromptStream:
    """Training prompts in a reproducible order: epoch e is a permutation seeded by (seed, e). `position` counts the
    prompts handed out, so a resumed run continues exactly where its checkpoint says."""

    def __init__(self, prompts: list[Prompt], seed: int, shuffle: bool = True, position: int = 0):
        if not prompts:
            raise ValueError("the training set is empty")
        self.prompts, self.seed, self.shuffle, self.position = prompts, seed, shuffle, position
        self._epoch, self._order = -1, np.arange(0)

    def rewound(self, position: int) -> PromptStream:
        """The same stream, handing out prompts again from `position` (a learner restored from a checkpoint)."""
        return PromptStream(self.prompts, self.seed, self.shuffle, position)

    def take(self, n: int) -> list[Prompt]:
        """The next `n` prompts; each gets a unique id (`<id>#<position>`) and a seed derived from its position."""
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.prompts))
            if epoch != self._epoch:
                self._epoch = epoch
                rng = np.random.default_rng([self.seed, epoch])
                self._order = rng.permutation(len(self.prompts)) if self.shuffle else np.arange(len(self.prompts))
            p = self.prompts[int(self._order[i])]
            seed = int(np.random.SeedSequence([self.seed, self.position]).generate_state(1)[0] & 0x7FFFFFFF)
            out.append(dataclasses.replace(p, id=f"{p.id}#{self.position}", seed=seed))
            self.position += 1
        return out
