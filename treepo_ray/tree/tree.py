"""The rollout tree of one prompt, stored as flat arrays.

Node 0 is the root: it holds the prompt and no generated tokens. Every other node is one generated segment; its
parent is the node it continues. A trajectory is a root-to-leaf path; its response is the concatenation of the
segments along the path. Rewards are given to the trajectories' last nodes and propagated bottom-up as means.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

FINISH_REASONS = ("none", "eos", "boxed", "repetition", "max_length", "max_depth")


def root_path(parent: list[int], node: int) -> list[int]:
    """Node ids from the first generated segment down to `node` (root, id 0, excluded) in a parent array."""
    out = []
    while node > 0:
        out.append(node)
        node = parent[node]
    return out[::-1]


@dataclass
class Tree:
    """One prompt's tree. Lists are indexed by node id; node 0 is the prompt."""

    prompt_ids: list[int]
    """Token ids of the prompt (the root's text)."""
    query_id: str = ""
    """Stable id of the prompt in its dataset (routing key, logging)."""
    parent: list[int] = field(default_factory=lambda: [-1])
    """Parent node id; -1 for the root."""
    depth: list[int] = field(default_factory=lambda: [0])
    """Number of segments from the root (root 0, its children 1, ...)."""
    tokens: list[list[int]] = field(default_factory=lambda: [[]])
    """The segment's generated token ids (empty for the root)."""
    logprobs: list[list[float]] = field(default_factory=lambda: [[]])
    """Sampling log-prob of each token of the segment, under the policy that generated it."""
    entropy: list[list[float]] = field(default_factory=lambda: [[]])
    """Entropy (nats) of the distribution each token of the segment was drawn from; empty where the engine was not
    asked for it (Segment.entropies)."""
    finish: list[str] = field(default_factory=lambda: ["none"])
    """Why the path stopped at this node: one of FINISH_REASONS ('none' = it may still continue or branch)."""
    reward: list[float] = field(default_factory=lambda: [math.nan])
    """Reward per node: set on trajectory ends by the verifier, on inner nodes by propagate_rewards."""
    trajectories: list[int] = field(default_factory=list)
    """Node ids of the trajectories' last nodes, in order (a leaf may be listed once)."""
    meta: dict = field(default_factory=dict)
    """Free-form facts about this tree (ground truth, data source, growth statistics, weights version)."""

    def __len__(self) -> int:
        return len(self.parent)

    def add_node(self, parent: int, tokens: list[int], logprobs: list[float], finish: str = "none",
                 entropy: list[float] | None = None) -> int:
        """Append a segment under `parent` and return its node id."""
        if not 0 <= parent < len(self.parent):
            raise ValueError(f"parent {parent} is not a node of this tree ({len(self.parent)} nodes)")
        if len(tokens) != len(logprobs):
            raise ValueError(f"segment has {len(tokens)} tokens but {len(logprobs)} log-probs")
        if entropy is not None and len(entropy) != len(tokens):
            raise ValueError(f"segment has {len(tokens)} tokens but {len(entropy)} entropies")
        if finish not in FINISH_REASONS:
            raise ValueError(f"finish reason {finish!r} is not one of {FINISH_REASONS}")
        self.parent.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.tokens.append(list(tokens))
        self.logprobs.append(list(logprobs))
        self.entropy.append(list(entropy or []))
        self.finish.append(finish)
        self.reward.append(math.nan)
        return len(self.parent) - 1

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parent) if p == node]

    def leaves(self) -> list[int]:
        has_child = set(self.parent[1:])
        return [i for i in range(1, len(self.parent)) if i not in has_child]

    def path(self, node: int) -> list[int]:
        """Node ids from the first generated segment down to `node` (root excluded)."""
        return root_path(self.parent, node)

    def response_ids(self, node: int) -> list[int]:
        """Generated token ids from the root to the end of `node`."""
        return [t for n in self.path(node) for t in self.tokens[n]]

    def response_logprobs(self, node: int) -> list[float]:
        return [lp for n in self.path(node) for lp in self.logprobs[n]]

    def prefix_ids(self, node: int) -> list[int]:
        """Prompt plus response up to the end of `node`: what a child of `node` is conditioned on."""
        return self.prompt_ids + self.response_ids(node)

    def trajectory_paths(self) -> list[list[int]]:
        return [self.path(n) for n in self.trajectories]

    def unique_tokens(self) -> int:
        """Prompt once plus every node's segment once: what a perfect prefix cache must compute."""
        return len(self.prompt_ids) + sum(len(t) for t in self.tokens)

    def renumber(self, order: list[int]) -> list[int]:
        """Give the nodes new ids in place: node `order[i]` becomes node i (order starts with the root and lists each
        parent before its children). Returns the new id of every old node."""
        if sorted(order) != list(range(len(self.parent))) or order[0] != 0:
            raise ValueError("order must list every node once, the root first")
        new = [0] * len(order)
        for i, old in enumerate(order):
            new[old] = i
        if any(new[self.parent[old]] >= i for i, old in enumerate(order) if i):
            raise ValueError("order must list each parent before its children")
        self.parent = [-1] + [new[self.parent[old]] for old in order[1:]]
        for name in ("depth", "tokens", "logprobs", "entropy", "finish", "reward"):
            values = getattr(self, name)
            setattr(self, name, [values[old] for old in order])
        self.trajectories = [new[n] for n in self.trajectories]
        return new

    def set_trajectory_rewards(self, rewards: list[float]) -> None:
        """Give each trajectory's last node its reward, then propagate means bottom-up."""
        if len(rewards) != len(self.trajectories):
            raise ValueError(f"{len(rewards)} rewards for {len(self.trajectories)} trajectories")
        for node, r in zip(self.trajectories, rewards):
            if not math.isfinite(r):
                raise ValueError(f"reward of trajectory ending at node {node} is not finite: {r}")
            self.reward[node] = float(r)
        self.propagate_rewards()

    def propagate_rewards(self) -> None:
        """An inner node's reward is the mean of its children's (children whose subtree holds no reward are skipped).

        Nodes that end a trajectory keep their own reward. Children always have larger ids than their parent,
        so one pass from the last node to the first sees every child before its parent.
        """
        ends = set(self.trajectories)
        sums = [0.0] * len(self.parent)
        counts = [0] * len(self.parent)
        for i in range(len(self.parent) - 1, -1, -1):
            if i not in ends:
                self.reward[i] = sums[i] / counts[i] if counts[i] else math.nan
            if i > 0 and not math.isnan(self.reward[i]):
                sums[self.parent[i]] += self.reward[i]
                counts[self.parent[i]] += 1

    def keep_trajectories(self, keep: list[int]) -> "Tree":
        """A copy with only the trajectories at positions `keep` and the nodes on their paths (renumbered in their
        old order): the tree as if the others had never been sampled (a trajectory that could not be verified)."""
        ends = [self.trajectories[i] for i in keep]
        needed = sorted({0}.union(*(self.path(e) for e in ends)))
        new = {old: i for i, old in enumerate(needed)}
        return Tree(prompt_ids=list(self.prompt_ids), query_id=self.query_id,
                    parent=[-1] + [new[self.parent[n]] for n in needed[1:]], depth=[self.depth[n] for n in needed],
                    tokens=[list(self.tokens[n]) for n in needed], logprobs=[list(self.logprobs[n]) for n in needed],
                    entropy=[list(self.entropy[n]) for n in needed], finish=[self.finish[n] for n in needed],
                    reward=[self.reward[n] for n in needed],
                    trajectories=[new[e] for e in ends], meta=dict(self.meta))

    def to_dict(self) -> dict:
        return {
            "query_id": self.query_id,
            "prompt_ids": self.prompt_ids,
            "parent": self.parent,
            "depth": self.depth,
            "tokens": self.tokens,
            "logprobs": self.logprobs,
            "entropy": self.entropy,
            "finish": self.finish,
            "reward": [None if math.isnan(r) else r for r in self.reward],
            "trajectories": self.trajectories,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "Tree":
        n = len(d["parent"])
        for key in ("depth", "tokens", "logprobs", "entropy", "finish", "reward"):
            if len(d.get(key, d["parent"])) != n:  # entropy is absent from trees saved before it existed
                raise ValueError(f"tree field {key!r} has {len(d[key])} entries for {n} nodes")
        return cls(
            prompt_ids=list(d["prompt_ids"]),
            query_id=d.get("query_id", ""),
            parent=list(d["parent"]),
            depth=list(d["depth"]),
            tokens=[list(t) for t in d["tokens"]],
            logprobs=[list(lp) for lp in d["logprobs"]],
            entropy=[list(e) for e in d.get("entropy", [[]] * n)],
            finish=list(d["finish"]),
            reward=[math.nan if r is None else float(r) for r in d["reward"]],
            trajectories=list(d["trajectories"]),
            meta=dict(d.get("meta", {})),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> "Tree":
        return cls.from_dict(json.loads(s))
