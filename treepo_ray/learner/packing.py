"""From trees to forward passes and per-token loss weights.

Loss weights. Every loss the learner trains is a sum over scored tokens of per-token terms; per token it needs
    pos   sum over the trajectories through it with advantage A > 0 of c * A     (c: the token's normaliser)
    neg   the same over A < 0 (a negative number)
    weight sum of c over the trajectories through it (the KL and entropy terms' weight)
and, for the logged figures, count (trajectories through it), n_pos and n_neg. Because a token's ratio is the same
for every trajectory through it, the clipped surrogate of each trajectory, max(-A r, -A clip(r)), is -A min(r, 1+e_h)
for A > 0 and -A max(r, 1-e_l) for A < 0, so the sum over the trajectories through a token is
    -pos * min(r, 1 + e_h) - neg * min(max(r, 1 - e_l), dual_clip)
(algo/losses.py: tree_policy_loss): packing a shared token once, with the summed weights, gives exactly the loss
and gradient of the unpacked per-trajectory terms. The normaliser c:
    token-mean  1 / (response tokens of all trajectories of the mini-batch)          (A includes the tree weight)
    seq-mean    1 / (trajectory's tokens * trajectories of the mini-batch)            (A includes the tree weight)
    node-mean   w(T) / (node's tokens * nodes taking part in the mini-batch)          (per-node losses: CATPO eq. 7)
In node-mean each node counts once (its advantage on each of its tokens); nodes outside the mask, and every node
of a tree with w(T) = 0, take no part: weight 0 and out of the denominator, their tokens only context.

Forward passes. `packing: tree` puts whole trees in a micro-batch, each distinct token once, depth first (a node's
tokens follow its parent's subtree position, so every node comes after its ancestors); position ids count along
the token's own path; attention goes to the token's ancestors and to the earlier tokens of its own node
(tree_attention.py). Micro-batches are filled up to `micro_batch_tokens`; a tree larger than that is split into
pieces, each a set of whole subtrees below one node plus that node's ancestors again as context (computed, not
trained); pieces of one tree that share a micro-batch share their ancestors too, so only ancestors of pieces in
different micro-batches are computed twice. A single-child chain is never split (a path longer than the budget is
one piece over it): split node by node, each node computed its whole path again, 9x the unique tokens of a
paper-sized TreePO tree at half its path length. A node whose piece would hold nothing but context for its
children's pieces is trained in the first of them instead. The job's default budget is the longest path its
rollout allows (job/config.py), so a whole path always fits. `packing: none` is one padded row per trajectory,
`micro_batch_size` rows per micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from treepo_ray.learner.batch import TrainTree

COLUMNS = ("pos", "neg", "weight", "count", "n_pos", "n_neg")
"""Per-token loss weights (see the module docstring), in this column order."""
POS, NEG, WEIGHT, COUNT, N_POS, N_NEG = range(len(COLUMNS))


# ---------------------------------------------------------------------------------------------- tree facts


class TreeIndex:
    """What packing needs to know about one TrainTree: children, lengths, paths, multiplicities."""

    def __init__(self, tree: TrainTree):
        self.tree = tree
        n = len(tree.parent)
        self.children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            self.children[tree.parent[i]].append(i)
        # The root's "segment" is the prompt: context for everything, never trained.
        self.length = [len(tree.prompt_ids)] + [len(t) for t in tree.tokens[1:]]
        self.ctx = [0] * n
        for i in range(1, n):
            self.ctx[i] = self.ctx[tree.parent[i]] + self.length[tree.parent[i]]
        self.paths = [tree.path(end) for end in tree.trajectories]
        self.multiplicity = [0] * n
        for path in self.paths:
            for node in path:
                self.multiplicity[node] += 1
        self.multiplicity[0] = len(self.paths)
        live = [m > 0 for m in self.multiplicity]
        self.children = [[c for c in kids if live[c]] for kids in self.children]
        self.subtree = list(self.length)  # tokens of the node's subtree, the node included
        for i in range(n - 1, 0, -1):
            if live[i]:
                self.subtree[tree.parent[i]] += self.subtree[i]
        self.dfs = self._dfs(0)

    def _dfs(self, top: int) -> list[int]:
        out, stack = [], [top]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(self.children[node]))
        return out

    def subtree_nodes(self, top: int) -> list[int]:
        return self._dfs(top)

    def ancestors(self, node: int) -> list[int]:
        """Strict ancestors of `node`, root first (the root included)."""
        out = []
        while node > 0:
            node = self.tree.parent[node]
            out.append(node)
        return out[::-1]

    @property
    def tokens(self) -> int:
        """Unique tokens of the trained part of the tree (prompt once, every node on a trajectory once)."""
        return self.subtree[0]

    @property
    def path_tokens(self) -> int:
        """Tokens of the tree as one row per trajectory (prompt + response each)."""
        return sum(self.length[0] + sum(self.length[n] for n in p) for p in self.paths)

    def participates(self, node: int) -> bool:
        """Per-node loss: whether `node` takes part (in the mask, in a tree of non-zero weight, has tokens)."""
        t = self.tree
        return bool(node > 0 and t.node_mask[node] and self.length[node] > 0 and self.multiplicity[node] > 0
                    and t.weight != 0)


def denominators(indices: list[TreeIndex]) -> list[float]:
    """[response tokens of all trajectories, trajectories, nodes taking part in a per-node loss] of these trees."""
    tokens = sum(ix.path_tokens - ix.length[0] * len(ix.paths) for ix in indices)
    seqs = sum(len(ix.paths) for ix in indices)
    nodes = sum(sum(ix.participates(n) for n in range(1, len(ix.length))) for ix in indices
                if ix.tree.node_mask is not None)
    return [float(tokens), float(seqs), float(nodes)]


# ---------------------------------------------------------------------------------------------- loss weights


@dataclass
class TreeWeights:
    """Loss weights of one tree: per node (packed) and per trajectory (unpacked); each [tokens, len(COLUMNS)]."""

    nodes: list[np.ndarray]
    trajectories: list[np.ndarray]


def loss_weights(ix: TreeIndex, aggregation: str, denoms: list[float]) -> TreeWeights:
    """The per-token loss weights of one tree (module docstring) given the mini-batch's global denominators
    (`denominators` summed over ranks)."""
    t = ix.tree
    nodes = [np.zeros((ix.length[n] if n else 0, len(COLUMNS))) for n in range(len(ix.length))]
    trajs = []
    if aggregation == "node-mean":
        if t.node_advantages is None:
            raise ValueError("learner.loss.aggregation = 'node-mean' needs per-node advantages (algo.name treerpo "
                             "or catpo)")
        d = max(denoms[2], 1.0)
        for n in range(1, len(ix.length)):
            m = ix.multiplicity[n]
            if m == 0:
                continue
            block = nodes[n]
            block[:, COUNT] = m
            if ix.participates(n):
                a = float(t.node_advantages[n])
                c = float(t.weight) / (ix.length[n] * d)
                block[:, WEIGHT] = c
                block[:, POS if a > 0 else NEG] = c * a if a != 0 else 0.0
                block[:, N_POS] = m * (a > 0)
                block[:, N_NEG] = m * (a < 0)
        for path in ix.paths:
            # One row per trajectory: a node's weights split evenly over the trajectories through it.
            rows = [nodes[n] / np.array([ix.multiplicity[n]] * len(COLUMNS)) for n in path]
            trajs.append(np.concatenate(rows) if rows else np.zeros((0, len(COLUMNS))))
        return TreeWeights(nodes, trajs)
    if aggregation not in ("token-mean", "seq-mean"):
        raise ValueError(f"aggregation = {aggregation!r}")
    for path, adv in zip(ix.paths, t.advantages):
        r = sum(ix.length[n] for n in path)
        a = np.asarray(adv, dtype=np.float64) * np.ones(r) * float(t.weight)
        c = 1.0 / max(denoms[0], 1.0) if aggregation == "token-mean" else 1.0 / (r * max(denoms[1], 1.0))
        row = np.zeros((r, len(COLUMNS)))
        row[:, POS] = np.where(a > 0, c * a, 0.0)
        row[:, NEG] = np.where(a < 0, c * a, 0.0)
        row[:, WEIGHT] = c
        row[:, COUNT] = 1.0
        row[:, N_POS] = a > 0
        row[:, N_NEG] = a < 0
        nan = np.isnan(a)  # a NaN advantage must make the loss NaN (the step is then skipped), not vanish
        row[nan, POS] = np.nan
        trajs.append(row)
        start = 0
        for n in path:
            nodes[n] += row[start:start + ix.length[n]]
            start += ix.length[n]
    return TreeWeights(nodes, trajs)


# ---------------------------------------------------------------------------------------------- pieces


@dataclass
class Piece:
    """Part of one tree in a packed micro-batch: `nodes` (depth first, root first, every node's ancestors
    included) of which `owned` are trained here; the others are context, computed again but not trained."""

    tree: int
    nodes: list[int]
    owned: set[int]
    tokens: int
    """Forward tokens: the prompt and the segments of `nodes`."""


def split_tree(ix: TreeIndex, tree: int, budget: int) -> list[Piece]:
    """Whole tree if it fits in `budget` tokens; else pieces of whole subtrees, each with its ancestors as context.

    A node goes with its single-child chain below it (to where the path branches or ends), then with as many of
    that branch point's children's whole subtrees as fit beside it (in order); a child that does not fit is split
    the same way. A chain is never cut: each cut would compute its ancestors again, so a chain longer than the
    budget becomes one piece over it (at most its path, as one unpacked row) rather than one piece per node."""
    pieces: list[Piece] = []

    def emit(top: int, owned: list[int], adopted: list[int]) -> None:
        nodes = ix.ancestors(top) + owned
        pieces.append(Piece(tree, nodes, set(owned) | set(adopted), sum(ix.length[n] for n in nodes)))

    def place(top: int, adopted: list[int]) -> None:
        # `adopted`: ancestors of `top` that no piece trains yet; they are context here anyway, so trained here.
        if ix.ctx[top] + ix.subtree[top] <= budget or not ix.children[top]:
            emit(top, ix.subtree_nodes(top), adopted)
            return
        chain = [top]
        while len(ix.children[chain[-1]]) == 1:
            chain.append(ix.children[chain[-1]][0])
        end = chain[-1]
        room = budget - ix.ctx[end] - ix.length[end]
        keep, rest = [], []
        for c in ix.children[end]:
            if ix.subtree[c] <= room:
                keep.append(c)
                room -= ix.subtree[c]
            else:
                rest.append(c)
        if keep or not rest:
            emit(top, chain + [n for c in keep for n in ix.subtree_nodes(c)], adopted)
            adopted = []
        else:  # this piece would be context of its first child's piece: that one trains it (the prompt: nothing)
            adopted = adopted + [n for n in chain if n]
        for c in rest:
            place(c, adopted)
            adopted = []

    place(0, [])
    return pieces


def fill(pieces: list[Piece], indices: list[TreeIndex], budget: int) -> list[list[Piece]]:
    """Micro-batches of at most `budget` forward tokens (a larger piece goes alone): first fit, in order, over the
    micro-batches opened so far. Pieces of one tree in one micro-batch become one piece: their shared ancestors
    are computed once."""
    bins: list[dict[int, tuple[set, set]]] = []  # per micro-batch: tree -> (nodes, owned)
    loads: list[int] = []
    for p in pieces:
        length = indices[p.tree].length
        for i, load in enumerate(loads):
            have = bins[i].get(p.tree, (set(), set()))[0]
            extra = sum(length[n] for n in p.nodes if n not in have)
            if load + extra <= budget:
                nodes, owned = bins[i].setdefault(p.tree, (set(), set()))
                nodes.update(p.nodes)
                owned.update(p.owned)
                loads[i] += extra
                break
        else:
            bins.append({p.tree: (set(p.nodes), set(p.owned))})
            loads.append(p.tokens)
    out = []
    for b in bins:
        merged = []
        for t, (nodes, owned) in b.items():
            ix = indices[t]
            order = [n for n in ix.dfs if n in nodes]  # nodes are closed under ancestors: a valid DFS order
            merged.append(Piece(t, order, owned, sum(ix.length[n] for n in order)))
        out.append(merged)
    return out


# ---------------------------------------------------------------------------------------------- micro-batches


@dataclass
class Scored:
    """Where a run of scored tokens came from: tree, node, and the run's place in the flat scored order."""

    tree: int
    node: int
    start: int
    length: int


@dataclass
class MicroBatch:
    """One forward pass: model inputs plus, for every scored token (flat order), its target and loss weights."""

    input_ids: torch.Tensor
    """[1, T] packed, or [B, L] padded."""
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    """[B, L] for padded rows; None when packed (tree attention instead)."""
    keep: torch.Tensor | int
    """Positions whose output is scored (HF logits_to_keep): packed, the [N] predicting positions; padded, 0 (all)."""
    targets: torch.Tensor
    """Target token of each kept position: [1, N] packed, [B, L] padded."""
    select: torch.Tensor | None
    """Padded only: flat indices into [B * L] of the N scored positions."""
    weights: torch.Tensor
    """[N, len(COLUMNS)] float64 loss weights."""
    scored: list[Scored]
    """Runs of scored tokens, to read per-node log-probs out and to fill old/behaviour ones in."""
    layout: object = None
    """Packed: the tree attention layout (tree_attention.TreeLayout)."""
    forward_tokens: int = 0
    """Tokens run through the model (packed: T; padded: real tokens, padding excluded)."""

    @property
    def num_scored(self) -> int:
        return int(self.weights.shape[0])

    def gather(self, per_node: list[list[np.ndarray]]) -> np.ndarray:
        """Flat values in scored order from per-tree, per-node arrays (`per_node[tree][node]`)."""
        out = np.empty(self.num_scored)
        for s in self.scored:
            out[s.start:s.start + s.length] = per_node[s.tree][s.node]
        return out


def packed_micro_batch(pieces: list[Piece], indices: list[TreeIndex], weights: list[TreeWeights],
                       attention: str, device: torch.device) -> MicroBatch:
    """One packed forward pass over `pieces` (see the module docstring)."""
    from treepo_ray.learner.tree_attention import Block, build_layout

    ids: list[int] = []
    pos: list[int] = []
    src: list[int] = []
    tgt: list[int] = []
    rows: list[np.ndarray] = []
    scored: list[Scored] = []
    blocks: list[Block] = []
    n_scored = 0
    for piece in pieces:
        ix, tw = indices[piece.tree], weights[piece.tree]
        tree = ix.tree
        end: dict[int, int] = {}
        block_of: dict[int, int] = {}
        here = set(piece.nodes)
        for node in piece.nodes:
            length = ix.length[node]
            toks = tree.prompt_ids if node == 0 else tree.tokens[node]
            start = len(ids)
            ids.extend(toks)
            pos.extend(range(ix.ctx[node], ix.ctx[node] + length))
            end[node] = start + length - 1
            par = tree.parent[node]
            # A node continues its parent's attention block when it is that parent's only child here (depth first,
            # it then follows the parent directly): chains become one block.
            if par >= 0 and sum(c in here for c in ix.children[par]) == 1:
                block_of[node] = block_of[par]
                blocks[block_of[node]].length += length
            else:
                blocks.append(Block(start, length, -1 if par < 0 else block_of[par]))
                block_of[node] = len(blocks) - 1
            if node in piece.owned and node > 0:
                src.append(end[par])
                src.extend(range(start, start + length - 1))
                tgt.extend(toks)
                rows.append(tw.nodes[node])
                scored.append(Scored(piece.tree, node, n_scored, length))
                n_scored += length
    if not tgt:
        raise ValueError("a packed micro-batch has no scored token")
    layout = build_layout(blocks, len(ids), attention, device)
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([pos], dtype=torch.long, device=device),
        attention_mask=None,
        keep=torch.tensor(src, dtype=torch.long, device=device),
        targets=torch.tensor([tgt], dtype=torch.long, device=device),
        select=None,
        weights=torch.from_numpy(np.concatenate(rows)).to(device),
        scored=scored, layout=layout, forward_tokens=len(ids))


@dataclass
class Row:
    """One trajectory as a padded row (packing: none)."""

    tree: int
    trajectory: int


def padded_micro_batch(rows: list[Row], indices: list[TreeIndex], weights: list[TreeWeights], pad_id: int,
                       device: torch.device) -> MicroBatch:
    """Right-padded rows, one per trajectory; position t predicts token t + 1."""
    seqs, scored, blocks = [], [], []
    n_scored = 0
    for row in rows:
        ix = indices[row.tree]
        path = ix.paths[row.trajectory]
        seq = list(ix.tree.prompt_ids)
        for n in path:
            seq.extend(ix.tree.tokens[n])
        seqs.append(seq)
        for n in path:
            if ix.length[n]:
                scored.append(Scored(row.tree, n, n_scored, ix.length[n]))
                n_scored += ix.length[n]
        blocks.append(weights[row.tree].trajectories[row.trajectory])
    B, L = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    select = []
    for i, (row, seq) in enumerate(zip(rows, seqs)):
        input_ids[i, :len(seq)] = torch.tensor(seq)
        attention_mask[i, :len(seq)] = 1
        p = indices[row.tree].length[0]
        select.extend(range(i * L + p - 1, i * L + len(seq) - 1))
    targets = torch.cat([input_ids[:, 1:], torch.full((B, 1), pad_id, dtype=torch.long)], dim=1)
    return MicroBatch(
        input_ids=input_ids.to(device),
        position_ids=torch.arange(L, dtype=torch.long).expand(B, L).contiguous().to(device),
        attention_mask=attention_mask.to(device),
        keep=0,
        targets=targets.to(device),
        select=torch.tensor(select, dtype=torch.long, device=device),
        weights=torch.from_numpy(np.concatenate(blocks)).to(device),
        scored=scored, forward_tokens=sum(len(s) for s in seqs))


def plan(indices: list[TreeIndex], packing: str, micro_batch_tokens: int, micro_batch_size: int) -> list:
    """The micro-batches of one mini-batch on this rank: lists of Pieces (tree) or of Rows (none)."""
    if packing == "tree":
        pieces = [p for t, ix in enumerate(indices) for p in split_tree(ix, t, micro_batch_tokens)]
        return fill(pieces, indices, micro_batch_tokens)
    rows = [Row(t, k) for t, ix in enumerate(indices) for k in range(len(ix.paths))]
    return [rows[i:i + micro_batch_size] for i in range(0, len(rows), micro_batch_size)]
