"""Attention over packed trees, as a Hugging Face attention function.

A packed micro-batch (packing.py) is one row of tokens made of attention *blocks*: a block is a run of tokens
(a node, or a chain of single-child nodes) whose tokens attend to every token of the block's ancestors and
causally within the block. Layout is depth first, so ancestors always come earlier in the row.

The function is registered with transformers' AttentionInterface under ATTENTION and installed as the model's
attention implementation: every decoder layer still runs its own forward (projections, RoPE with the per-token
position ids, output projection; FSDP2's and DeepSpeed's hooks see nothing unusual) and only the attention itself
changes. Called without a layout (`tree_layout` keyword of the model's forward) it is plain SDPA, with the causal
or padding mask transformers builds for it; so the same model serves padded rows too.

Three ways to attend (`learner.tree_attention`):
    gather  blocks of about one size in one batched SDPA call: each block's queries against its ancestors' keys
            and values, gathered with index_select, padded to the group's largest block (the fast way on CPU, where
            a dense mask attends over the whole tree and compiled FlexAttention has no backward)
    flex    FlexAttention with a block mask (GPU; compiled)
    sdpa    SDPA with a dense [T, T] boolean mask (anywhere; the reference)
`auto` is flex on CUDA when FlexAttention is available, else gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION = "treepo_tree"
"""Name of the attention implementation the learner's models use."""
MODES = ("auto", "gather", "flex", "sdpa")


@dataclass
class Block:
    """A run of packed tokens [start, start + length) attending to its ancestor blocks and causally to itself."""

    start: int
    length: int
    parent: int
    """Index of the parent block (-1 for a tree's first block)."""


@dataclass
class GatherGroup:
    """Blocks of one batched attention call, padded to S queries and L keys each."""

    q_index: torch.Tensor
    """[m * S] packed index of each query row (padding rows repeat a valid index)."""
    kv_index: torch.Tensor
    """[m * L] packed index of each key row (ancestors root first, then the block itself)."""
    mask: torch.Tensor
    """[m, 1, S, L] True where a query attends to a key."""
    rows: torch.Tensor | None
    """Indices of the real query rows among the m * S (None when none is padding)."""
    m: int
    S: int
    L: int


@dataclass
class TreeLayout:
    """How one packed micro-batch attends; built once, used by every layer."""

    mode: str
    tokens: int
    groups: list[GatherGroup] | None = None
    inverse: torch.Tensor | None = None
    """gather: the position of each packed token in the concatenated outputs of the groups."""
    dense_mask: torch.Tensor | None = None
    """sdpa: [1, 1, T, T] boolean mask."""
    block_mask: object = None
    """flex: a BlockMask."""


def resolve_mode(mode: str, device: torch.device) -> str:
    if mode not in MODES:
        raise ValueError(f"learner.tree_attention = {mode!r}; choose one of {MODES}")
    if mode != "auto":
        return mode
    return "flex" if device.type == "cuda" and _has_flex() else "gather"


def _has_flex() -> bool:
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _ancestry(blocks: list[Block]) -> list[list[int]]:
    """Each block's ancestor blocks, root first."""
    out: list[list[int]] = []
    for b in blocks:
        out.append([] if b.parent < 0 else out[b.parent] + [b.parent])
    return out


def build_layout(blocks: list[Block], tokens: int, mode: str, device: torch.device) -> TreeLayout:
    """The attention layout of a packed row of `tokens` tokens made of `blocks`."""
    mode = resolve_mode(mode, device)
    ancestry = _ancestry(blocks)
    if mode == "gather":
        return _gather_layout(blocks, ancestry, tokens, device)
    block_id = torch.empty(tokens, dtype=torch.long)
    for i, b in enumerate(blocks):
        block_id[b.start:b.start + b.length] = i
    visible = torch.eye(len(blocks), dtype=torch.bool)  # visible[q, k]: block k is q or an ancestor of q
    for i, anc in enumerate(ancestry):
        visible[i, anc] = True
    block_id, visible = block_id.to(device), visible.to(device)
    if mode == "sdpa":
        pos = torch.arange(tokens, device=device)
        mask = visible[block_id[:, None], block_id[None, :]] & (pos[None, :] <= pos[:, None])
        return TreeLayout(mode, tokens, dense_mask=mask[None, None])
    from torch.nn.attention.flex_attention import create_block_mask

    def tree_mask(b, h, q, kv):
        return visible[block_id[q], block_id[kv]] & (kv <= q)

    # Evaluated eagerly: a [T, T] boolean intermediate (256 MB at 16k tokens), once per micro-batch.
    bm = create_block_mask(tree_mask, B=None, H=None, Q_LEN=tokens, KV_LEN=tokens, device=str(device))
    return TreeLayout(mode, tokens, block_mask=bm)


GROUP_COST = 32768
"""What one more batched attention call costs (its gathers, the call, its backward), in padded query-key pairs:
`_split_by_size` opens a new group where that saves more padding than this. Measured on the default job's batches
(one thread, median of 9 learner steps): 1.59 s per TreePO step at 32768, 1.66-1.80 s at 16384 and 65536, 1.94-2.00
s with one group per tree depth (DAPO's: 1.27 s at 16384, 1.71 s per depth)."""


def _split_by_size(sizes: list[tuple[int, int]]) -> list[list[int]]:
    """Indices into `sizes` ((queries, keys) per block) in groups that each pad to their largest block, chosen to
    minimise the padded query-key pairs plus GROUP_COST per group: blocks sorted by keys, then an optimal cut of
    that order (dynamic programming; a tree's paths end at very different lengths, so one group per depth padded
    most of its attention)."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i][1], -sizes[i][0]))
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j blocks of the order
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        s_max = 0
        for i in range(j, 0, -1):  # the last group is order[i - 1 : j]; its keys are those of order[i - 1]
            s_max = max(s_max, sizes[order[i - 1]][0])
            cost = best[i - 1] + (j - i + 1) * s_max * sizes[order[i - 1]][1] + GROUP_COST
            if cost < best[j]:
                best[j], cut[j] = cost, i - 1
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def _gather_layout(blocks: list[Block], ancestry: list[list[int]], tokens: int, device) -> TreeLayout:
    sizes = [(b.length, sum(blocks[a].length for a in anc) + b.length) for b, anc in zip(blocks, ancestry)]
    groups, order = [], []
    for members in _split_by_size(sizes):
        keys = [[(blocks[a].start, blocks[a].length) for a in ancestry[i]] for i in members]
        prefix = [sum(n for _, n in k) for k in keys]
        S = max(blocks[i].length for i in members)
        L = max(p + blocks[i].length for p, i in zip(prefix, members))
        m = len(members)
        q_index = torch.zeros(m, S, dtype=torch.long)
        kv_index = torch.zeros(m, L, dtype=torch.long)
        mask = torch.zeros(m, S, L, dtype=torch.bool)
        rows = []
        for j, (i, k, p) in enumerate(zip(members, keys, prefix)):
            b = blocks[i]
            q_index[j, :b.length] = torch.arange(b.start, b.start + b.length)
            spans = [torch.arange(s, s + n) for s, n in k] + [torch.arange(b.start, b.start + b.length)]
            kv = torch.cat(spans)
            kv_index[j, :len(kv)] = kv
            # query t of the block sees the prefix and its own tokens up to t: keys [0, p + t]
            mask[j, :b.length] = torch.arange(L)[None, :] <= (p + torch.arange(b.length))[:, None]
            mask[j, b.length:, 0] = True  # padding rows attend to something (no NaN), their output is dropped
            rows.append(torch.arange(j * S, j * S + b.length))
            order.append(q_index[j, :b.length])
        rows_t = torch.cat(rows)
        groups.append(GatherGroup(q_index.flatten().to(device), kv_index.flatten().to(device),
                                  mask[:, None].to(device), None if len(rows_t) == m * S else rows_t.to(device),
                                  m, S, L))
    order_t = torch.cat(order)
    inverse = torch.empty(tokens, dtype=torch.long)
    inverse[order_t] = torch.arange(tokens)
    return TreeLayout("gather", tokens, groups=groups, inverse=inverse.to(device))


def tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   tree_layout: TreeLayout | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """The registered attention function: query [1, H, T, D], key/value [1, Hkv, T, D] -> ([1, T, H, D], None)."""
    if tree_layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None:
        raise ValueError("tree attention does not support sliding-window attention layers")
    if query.shape[0] != 1 or query.shape[2] != tree_layout.tokens:
        raise ValueError(f"tree attention expects one packed row of {tree_layout.tokens} tokens, got query "
                         f"{tuple(query.shape)}")
    gqa = query.shape[1] != key.shape[1]
    if tree_layout.mode == "sdpa":
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=tree_layout.dense_mask, dropout_p=dropout,
                                             scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    if tree_layout.mode == "flex":
        out = _flex()(query, key, value, block_mask=tree_layout.block_mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    H, D, Hkv = query.shape[1], query.shape[3], key.shape[1]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, D]
    outs = []
    for g in tree_layout.groups:
        qg = q.index_select(0, g.q_index).view(g.m, g.S, H, D).transpose(1, 2)
        kg = k.index_select(0, g.kv_index).view(g.m, g.L, Hkv, D).transpose(1, 2)
        vg = v.index_select(0, g.kv_index).view(g.m, g.L, Hkv, D).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, dropout_p=dropout, scale=scaling,
                                           enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(g.m * g.S, H, D)
        outs.append(o if g.rows is None else o.index_select(0, g.rows))
    out = torch.cat(outs).index_select(0, tree_layout.inverse)
    return out.unsqueeze(0), None


_FLEX = None


def _flex():
    """flex_attention, compiled once (uncompiled it materialises the whole score matrix)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX = torch.compile(flex_attention, dynamic=True) if torch.cuda.is_available() else flex_attention
    return _FLEX


def register() -> str:
    """Register the tree attention (and, for padded rows, SDPA's mask builder) under ATTENTION; returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, tree_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)
    return ATTENTION
