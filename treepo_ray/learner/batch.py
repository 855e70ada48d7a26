"""What the learner trains on: scored trees (TrainTree), or single responses (TrainSample, a one-node tree).

A TrainTree is one prompt's rollout tree with its credit: every trajectory's advantage (the per-trajectory losses)
and, for TreeRPO and CATPO, every node's advantage and whether it takes part (the per-node loss), plus the engines'
sampled log-probs of every token (the behaviour policy's, at the sampling temperature) for the off-policy
correction. How trees become forward passes and loss terms is packing.py.
"""

from __future__ import annotations

from dataclasses import dataclass

Advantage = float | list[float]
"""Of one trajectory: one number for its whole response, or one per response token."""


def _check_ids(where: str, ids, vocab_size: int | None) -> None:
    for j, tok in enumerate(ids):
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            raise ValueError(f"{where}[{j}] = {tok!r}; token ids are non-negative ints")
        if vocab_size is not None and tok >= vocab_size:
            raise ValueError(f"{where}[{j}] = {tok} is outside the vocabulary (size {vocab_size})")


def _check_advantage(where: str, adv, n: int) -> None:
    if isinstance(adv, (list, tuple)):
        if len(adv) != n:
            raise ValueError(f"{where} has {len(adv)} values for {n} response tokens")
    elif not isinstance(adv, (int, float)) or isinstance(adv, bool):
        raise ValueError(f"{where} = {adv!r}; expected a number or a list of numbers")


@dataclass
class TrainTree:
    """One scored tree as the learner trains on it. Lists are indexed by node id; node 0 is the prompt."""

    prompt_ids: list[int]
    """Token ids of the prompt (at least one)."""
    parent: list[int]
    """Parent of each node (-1 for node 0; 0 <= parent[i] < i otherwise)."""
    tokens: list[list[int]]
    """Each node's generated token ids (tokens[0] is empty)."""
    trajectories: list[int]
    """The last node of each trajectory (a root-to-node path)."""
    advantages: list[Advantage]
    """Each trajectory's advantage: a number, or one per response token."""
    logprobs: list[list[float]] | None = None
    """The behaviour policy's log-probs of each node's tokens (the engines' sampled ones); None = unknown."""
    node_advantages: list[float] | None = None
    """Per-node losses (TreeRPO, CATPO): each node's advantage."""
    node_mask: list[bool] | None = None
    """Per-node losses: the nodes that take part (others are context only)."""
    weight: float = 1.0
    """CATPO's w(T): multiplies the advantages (per-trajectory losses) or the whole per-tree term (per-node)."""

    def path(self, node: int) -> list[int]:
        """Node ids from the first generated segment down to `node` (root excluded)."""
        out = []
        while node > 0:
            out.append(node)
            node = self.parent[node]
        return out[::-1]

    def response_length(self, node: int) -> int:
        return sum(len(self.tokens[n]) for n in self.path(node))

    def validate(self, where: str, vocab_size: int | None = None) -> None:
        """Raise ValueError naming `where` and the field if the tree is malformed (NaN values are allowed: the
        learner skips a step whose loss is not finite rather than crashing)."""
        if not self.prompt_ids:
            raise ValueError(f"{where}.prompt_ids is empty; the first response token needs a context")
        _check_ids(f"{where}.prompt_ids", self.prompt_ids, vocab_size)
        n = len(self.parent)
        if n < 2 or self.parent[0] != -1:
            raise ValueError(f"{where}.parent = {self.parent[:3]}...; node 0 (parent -1) and at least one segment")
        for i in range(1, n):
            if not 0 <= self.parent[i] < i:
                raise ValueError(f"{where}.parent[{i}] = {self.parent[i]}; a parent comes before its child")
        if len(self.tokens) != n or self.tokens[0]:
            raise ValueError(f"{where}.tokens: {len(self.tokens)} entries for {n} nodes (the root's empty)")
        for i in range(1, n):
            if not self.tokens[i]:
                raise ValueError(f"{where}.tokens[{i}] is empty; every segment has at least one token")
            _check_ids(f"{where}.tokens[{i}]", self.tokens[i], vocab_size)
        if not self.trajectories:
            raise ValueError(f"{where}.trajectories is empty")
        if len(self.advantages) != len(self.trajectories):
            raise ValueError(f"{where}.advantages has {len(self.advantages)} entries for "
                             f"{len(self.trajectories)} trajectories")
        for k, end in enumerate(self.trajectories):
            if not 0 < end < n:
                raise ValueError(f"{where}.trajectories[{k}] = {end} is not a node of the tree")
            _check_advantage(f"{where}.advantages[{k}]", self.advantages[k], self.response_length(end))
        if self.logprobs is not None:
            if len(self.logprobs) != n:
                raise ValueError(f"{where}.logprobs has {len(self.logprobs)} entries for {n} nodes")
            for i in range(n):
                if len(self.logprobs[i]) != len(self.tokens[i]):
                    raise ValueError(f"{where}.logprobs[{i}] has {len(self.logprobs[i])} values for "
                                     f"{len(self.tokens[i])} tokens")
        for name in ("node_advantages", "node_mask"):
            values = getattr(self, name)
            if values is not None and len(values) != n:
                raise ValueError(f"{where}.{name} has {len(values)} entries for {n} nodes")
        if (self.node_advantages is None) != (self.node_mask is None):
            raise ValueError(f"{where}: node_advantages and node_mask come together")
        if not isinstance(self.weight, (int, float)) or isinstance(self.weight, bool):
            raise ValueError(f"{where}.weight = {self.weight!r}; expected a number")


@dataclass
class TrainSample:
    """One response to learn from, with its advantage(s): a tree of one segment."""

    prompt_ids: list[int]
    """Token ids the response was conditioned on (at least one)."""
    response_ids: list[int]
    """Generated token ids whose log-probs are trained (at least one)."""
    advantages: Advantage
    """One advantage for the whole response, or one per response token."""
    weight: float = 1.0
    """Multiplies the advantages (CATPO's per-tree informativeness weight)."""
    old_logprobs: list[float] | None = None
    """The behaviour policy's log-probs of the response tokens (the sampler's); None = unknown."""

    def validate(self, where: str, vocab_size: int | None = None) -> None:
        """Raise ValueError naming `where` and the field if the sample is malformed."""
        if len(self.prompt_ids) == 0:
            raise ValueError(f"{where}.prompt_ids is empty; the first response token needs a context")
        if len(self.response_ids) == 0:
            raise ValueError(f"{where}.response_ids is empty")
        _check_ids(f"{where}.prompt_ids", self.prompt_ids, vocab_size)
        _check_ids(f"{where}.response_ids", self.response_ids, vocab_size)
        _check_advantage(f"{where}.advantages", self.advantages, len(self.response_ids))
        if not isinstance(self.weight, (int, float)):
            raise ValueError(f"{where}.weight = {self.weight!r}; expected a number")
        if self.old_logprobs is not None and len(self.old_logprobs) != len(self.response_ids):
            raise ValueError(f"{where}.old_logprobs has {len(self.old_logprobs)} values for "
                             f"{len(self.response_ids)} response tokens")

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def as_tree(self) -> TrainTree:
        return TrainTree(list(self.prompt_ids), [-1, 0], [[], list(self.response_ids)], [1], [self.advantages],
                         None if self.old_logprobs is None else [[], list(self.old_logprobs)], weight=self.weight)


def as_trees(batch: list, where: str = "batch", vocab_size: int | None = None) -> list[TrainTree]:
    """Validate a list of TrainTree and/or TrainSample; return it as trees."""
    if not isinstance(batch, (list, tuple)):
        raise ValueError(f"{where} must be a list of TrainTree or TrainSample, got {type(batch).__name__}")
    out = []
    for i, item in enumerate(batch):
        if isinstance(item, TrainSample):
            item.validate(f"{where}[{i}]", vocab_size)
            out.append(item.as_tree())
        elif isinstance(item, TrainTree):
            item.validate(f"{where}[{i}]", vocab_size)
            out.append(item)
        else:
            raise ValueError(f"{where}[{i}] is a {type(item).__name__}, not a TrainTree or TrainSample")
    return out


def train_trees(trees: list, credit: list, tree_weights: list[float] | None = None) -> list[TrainTree]:
    """The learner's trees from scored rollout trees (tree.Tree) and their credit (algo/credit.py: TreeCredit).

    `tree_weights` (one per tree, default 1) is CATPO's w(T). The engines' sampled log-probs travel along as the
    behaviour log-probs; nodes on no trajectory are dropped (they are never trained)."""
    weights = [1.0] * len(trees) if tree_weights is None else list(tree_weights)
    if len(weights) != len(trees) or len(credit) != len(trees):
        raise ValueError(f"{len(trees)} trees but {len(credit)} credits and {len(weights)} weights")
    out = []
    for tree, c, w in zip(trees, credit, weights):
        keep = sorted({0} | {n for end in tree.trajectories for n in tree.path(end)})
        new = {old: i for i, old in enumerate(keep)}
        pick = lambda values: None if values is None else [values[n] for n in keep]  # noqa: E731
        out.append(TrainTree(
            prompt_ids=list(tree.prompt_ids),
            parent=[-1] + [new[tree.parent[n]] for n in keep[1:]],
            tokens=[list(tree.tokens[n]) for n in keep],
            trajectories=[new[e] for e in tree.trajectories],
            advantages=list(c.trajectories),
            logprobs=[list(lp) for lp in pick(tree.logprobs)],
            node_advantages=pick(c.nodes),
            node_mask=pick(c.node_mask),
            weight=float(w)))
    return out


def tree_tokens(tree: TrainTree) -> int:
    """Prompt once plus every node's segment once."""
    return len(tree.prompt_ids) + sum(len(t) for t in tree.tokens)


def shard_trees(trees: list, rank: int, world_size: int) -> list:
    """This rank's share of a batch: trees dealt to the rank with the fewest tokens so far, largest first (the
    same on every rank, so the shares partition the batch)."""
    if world_size == 1:
        return list(trees)
    size = [tree_tokens(t) if isinstance(t, TrainTree) else getattr(t, "length", 1) for t in trees]
    load = [0] * world_size
    mine = []
    for i in sorted(range(len(trees)), key=lambda i: (-size[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        load[r] += size[i]
        if r == rank:
            mine.append(i)
    return [trees[i] for i in sorted(mine)]
