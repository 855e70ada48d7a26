"""Training samples and their collation into padded tensors.

Layout of a collated batch of B sequences (prompt + response, right-padded to length L):
    input_ids, attention_mask, position_ids      [B, L]
    response_mask, advantages, old_logprobs      [B, L - 1], aligned with the *targets*: column t describes
                                                 token input_ids[:, t + 1], predicted from the logits at t.
So sample i's response occupies target columns prompt_len - 1 ... prompt_len + response_len - 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainSample:
    """One response to learn from, with its advantage(s)."""

    prompt_ids: list[int]
    """Token ids the response was conditioned on (at least one)."""
    response_ids: list[int]
    """Generated token ids whose log-probs are trained (at least one)."""
    advantages: float | list[float]
    """One advantage for the whole response, or one per response token."""
    weight: float = 1.0
    """Multiplies the advantages (CATPO's per-tree informativeness weight)."""
    old_logprobs: list[float] | None = None
    """Behaviour-policy log-probs of the response tokens; None lets the learner recompute them."""

    def validate(self, where: str, vocab_size: int | None = None) -> None:
        """Raise ValueError naming `where` and the field if the sample is malformed (NaN values are allowed:
        the learner skips a step whose loss is not finite rather than crashing)."""
        if len(self.prompt_ids) == 0:
            raise ValueError(f"{where}.prompt_ids is empty; the first response token needs a context")
        if len(self.response_ids) == 0:
            raise ValueError(f"{where}.response_ids is empty")
        for name in ("prompt_ids", "response_ids"):
            for j, tok in enumerate(getattr(self, name)):
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    raise ValueError(f"{where}.{name}[{j}] = {tok!r}; token ids are non-negative ints")
                if vocab_size is not None and tok >= vocab_size:
                    raise ValueError(f"{where}.{name}[{j}] = {tok} is outside the vocabulary (size {vocab_size})")
        n = len(self.response_ids)
        if isinstance(self.advantages, (list, tuple)):
            if len(self.advantages) != n:
                raise ValueError(f"{where}.advantages has {len(self.advantages)} values for {n} response tokens")
        elif not isinstance(self.advantages, (int, float)):
            raise ValueError(f"{where}.advantages = {self.advantages!r}; expected a number or a list of numbers")
        if not isinstance(self.weight, (int, float)):
            raise ValueError(f"{where}.weight = {self.weight!r}; expected a number")
        if self.old_logprobs is not None and len(self.old_logprobs) != n:
            raise ValueError(f"{where}.old_logprobs has {len(self.old_logprobs)} values for {n} response tokens")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class Batch:
    """Padded tensors of a list of samples (see the module docstring for the layout)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None
    prompt_lens: list[int]
    response_lens: list[int]

    def to(self, device: torch.device | str) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.attention_mask), move(self.position_ids),
                     move(self.response_mask), move(self.advantages), move(self.old_logprobs),
                     self.prompt_lens, self.response_lens)

    @property
    def num_tokens(self) -> int:
        """Response tokens in the batch."""
        return sum(self.response_lens)

    def responses(self, values: torch.Tensor) -> list[list[float]]:
        """Cut a [B, L - 1] target-aligned tensor back into one list per sample over its response tokens."""
        rows = values.detach().float().cpu().tolist()
        return [row[p - 1:p - 1 + r] for row, p, r in zip(rows, self.prompt_lens, self.response_lens)]


def collate(samples: list[TrainSample], pad_id: int = 0) -> Batch:
    """Right-pad samples into a Batch; old_logprobs is a tensor only if every sample carries them."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    B, L = len(samples), max(s.length for s in samples)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    response_mask = torch.zeros((B, L - 1), dtype=torch.float32)
    advantages = torch.zeros((B, L - 1), dtype=torch.float32)
    has_old = all(s.old_logprobs is not None for s in samples)
    old = torch.zeros((B, L - 1), dtype=torch.float32) if has_old else None
    for i, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention_mask[i, :p + r] = 1
        cols = slice(p - 1, p - 1 + r)
        response_mask[i, cols] = 1.0
        adv = s.advantages if isinstance(s.advantages, (list, tuple)) else [s.advantages] * r
        advantages[i, cols] = torch.tensor(adv, dtype=torch.float32) * float(s.weight)
        if old is not None:
            old[i, cols] = torch.tensor(s.old_logprobs, dtype=torch.float32)
    # Right padding: positions simply count from 0; padded positions are masked out of attention and loss.
    position_ids = torch.arange(L, dtype=torch.long).expand(B, L).clone()
    return Batch(input_ids, attention_mask, position_ids, response_mask, advantages, old,
                 [len(s.prompt_ids) for s in samples], [len(s.response_ids) for s in samples])


def samples_from_trees(trees: list, advantages: list[list[float | list[float]]],
                       tree_weights: list[float] | None = None) -> list[TrainSample]:
    """One sample per trajectory of each tree (`advantages[t][k]`: tree t's k-th trajectory, from algo/credit.py).

    `tree_weights` (one per tree, default 1) scales every sample of a tree: the place for CATPO's informativeness
    weight. Old log-probs are left None: the learner recomputes them under its current weights (PPO ratio).
    """
    weights = [1.0] * len(trees) if tree_weights is None else list(tree_weights)
    if len(weights) != len(trees) or len(advantages) != len(trees):
        raise ValueError(f"{len(trees)} trees but {len(advantages)} advantage lists and {len(weights)} weights")
    samples = []
    for tree, advs, w in zip(trees, advantages, weights):
        for node, adv in zip(tree.trajectories, advs):
            response = tree.response_ids(node)
            if response:
                samples.append(TrainSample(list(tree.prompt_ids), response, adv, weight=w))
    return samples
