"""Packed trees (learner/packing.py, tree_attention.py): the layout, subtree splitting under a token budget, loss
weights, the three attention modes, and packed == unpacked loss and gradients for every algorithm on random trees.
The model is a tiny Qwen2 built in memory from its config (no files, no tokenizer)."""

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from treepo_ray.algo.losses import LossConfig, tree_policy_loss
from treepo_ray.algo import ALGORITHMS
from treepo_ray.learner import TrainTree
from treepo_ray.learner.learner import micro_batch_logprobs, prepare_model
from treepo_ray.learner.packing import (COUNT, NEG, POS, WEIGHT, TreeIndex, denominators, loss_weights,
                                        packed_micro_batch, padded_micro_batch, plan, split_tree)
from treepo_ray.learner.tree_attention import Block, build_layout, tree_attention
from learner_testlib import random_train_trees

CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def small_tree() -> TrainTree:
    """prompt [1, 2]; node 1 [3, 4] under the root with children 3 [6, 7, 8] and 4 [9]; node 2 [5] under the root;
    trajectories end at 3, 4 and 2."""
    return TrainTree([1, 2], [-1, 0, 0, 1, 1], [[], [3, 4], [5], [6, 7, 8], [9]], [3, 4, 2], [1.0, -2.0, 0.5],
                     logprobs=[[], [-1.0, -1.0], [-1.0], [-1.0] * 3, [-1.0]])


def test_packed_layout_is_depth_first_with_path_positions_and_predicting_positions():
    ix = TreeIndex(small_tree())
    w = loss_weights(ix, "token-mean", denominators([ix]))
    mb = packed_micro_batch(plan([ix], "tree", 100, 4)[0], [ix], [w], "gather", CPU)
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 6, 7, 8, 9, 5]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 4, 2]]
    # Token 6 (first of node 3) is predicted from token 4 (the end of node 1, index 3); token 9 likewise; token 5
    # (node 2) from the prompt's last token.
    assert mb.keep.tolist() == [1, 2, 3, 4, 5, 3, 1]
    assert mb.targets.tolist() == [[3, 4, 6, 7, 8, 9, 5]]
    assert mb.forward_tokens == 9 and ix.tokens == 9 and ix.path_tokens == 7 + 5 + 3
    # Loss weights: token-mean over the 6 + 3 + 1... response tokens of the trajectories (5 + 3 + 1 = 9... here
    # 5, 3 and 1 tokens): node 1's tokens carry trajectories 3 (A = 1) and 4 (A = -2).
    d = 5 + 3 + 1
    np.testing.assert_allclose(mb.weights[:2, POS].numpy(), 1.0 / d)
    np.testing.assert_allclose(mb.weights[:2, NEG].numpy(), -2.0 / d)
    np.testing.assert_allclose(mb.weights[:2, WEIGHT].numpy(), 2.0 / d)
    np.testing.assert_allclose(mb.weights[:, COUNT].numpy(), [2, 2, 1, 1, 1, 1, 1])


def test_subtree_splitting_repeats_only_ancestors_and_trains_each_node_once():
    rng = np.random.default_rng(1)
    for budget in (6, 10, 25):
        for tree in random_train_trees(rng, "treepo", n=4, depth=(3, 5), branch=(1, 3), seg=(2, 5)):
            ix = TreeIndex(tree)
            pieces = split_tree(ix, 0, budget)
            owned = [n for p in pieces for n in p.owned]
            trained = [n for n in range(1, len(tree.parent)) if ix.multiplicity[n]]
            assert sorted(n for n in owned if n) == trained  # every node trained in exactly one piece
            for p in pieces:
                top = min(p.owned)
                context = [n for n in p.nodes if n not in p.owned]
                assert context == ix.ancestors(top)  # context: exactly the ancestors of the piece's top
                assert p.owned <= set(ix.subtree_nodes(top))
                assert p.tokens == sum(ix.length[n] for n in p.nodes)
                # Over budget only for a single-child chain (never cut: each cut would repeat its ancestors).
                branching = any(sum(c in p.owned for c in ix.children[n]) > 1 for n in p.owned)
                assert p.tokens <= budget or not branching
            if ix.tokens <= budget:
                assert len(pieces) == 1 and pieces[0].owned == set(ix.dfs)


def test_a_small_budget_splits_into_micro_batches_within_it():
    rng = np.random.default_rng(2)
    trees = random_train_trees(rng, "treerpo", n=3, depth=(3, 4), branch=(2, 4), seg=(3, 5))
    indices = [TreeIndex(t) for t in trees]
    batches = plan(indices, "tree", 30, 4)
    assert len(batches) > len(trees)
    longest_path = max(ix.ctx[n] + ix.length[n] for ix in indices for n in range(len(ix.length)))
    for pieces in batches:
        assert sum(p.tokens for p in pieces) <= max(30, longest_path)
        assert len({p.tree for p in pieces}) == len(pieces)  # one piece per tree: shared ancestors once
    # Each node trained once; context repeated only across micro-batches.
    owned = sorted((p.tree, n) for pieces in batches for p in pieces for n in p.owned if n)
    assert owned == sorted((t, n) for t, ix in enumerate(indices) for n in range(1, len(ix.length)))
    forward = sum(p.tokens for pieces in batches for p in pieces)
    assert forward < sum(p.tokens for t, ix in enumerate(indices) for p in split_tree(ix, t, 30))


def deep_wide_tree(width=16, depth=14, seg=512, prompt=1024) -> TrainTree:
    """TreePO's paper-sized tree: binary splits until `width` paths, each path then alone to `depth` segments."""
    parent, tokens, frontier = [-1], [[]], [0]
    for _ in range(depth):
        split = 2 if len(frontier) * 2 <= width else 1
        nxt = []
        for node in frontier:
            for _ in range(split):
                parent.append(node)
                tokens.append([5] * seg)
                nxt.append(len(parent) - 1)
        frontier = nxt
    return TrainTree([1] * prompt, parent, tokens, frontier, [1.0 - 2 * (k % 2) for k in range(width)])


def forward_per_unique(tree: TrainTree, budget: int) -> float:
    ix = TreeIndex(tree)
    return sum(p.tokens for pieces in plan([ix], "tree", budget, 4) for p in pieces) / ix.tokens


def test_a_deep_wide_tree_under_the_paper_budget_repeats_few_tokens():
    from treepo_ray.job.config import CONFIG_DIR, load_config

    tree = deep_wide_tree()
    assert forward_per_unique(tree, load_config(CONFIG_DIR / "treepo_paper.yaml").learner.micro_batch_tokens) <= 1.10


@pytest.mark.parametrize("budget", [1024, 4096, 8192])
def test_a_budget_below_two_paths_packs_no_worse_than_one_row_per_path(budget):
    # Splitting a chain node by node computed the whole path again per node: 9x the tree's tokens at 4096.
    tree = deep_wide_tree()
    ix = TreeIndex(tree)
    assert forward_per_unique(tree, budget) <= ix.path_tokens / ix.tokens


def attend_reference(q, k, v, blocks, tokens):
    """Each token attends to the tokens of its block up to itself and to all tokens of its ancestor blocks."""
    visible = torch.zeros(tokens, tokens, dtype=torch.bool)
    anc = []
    for b in blocks:
        anc.append([] if b.parent < 0 else anc[b.parent] + [b.parent])
    for i, b in enumerate(blocks):
        for t in range(b.start, b.start + b.length):
            for a in anc[i]:
                visible[t, blocks[a].start:blocks[a].start + blocks[a].length] = True
            visible[t, b.start:t + 1] = True
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    vv = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = (q @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(~visible, float("-inf"))
    return (s.softmax(-1) @ vv).transpose(1, 2)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mode", ["gather", "sdpa", "flex"])
def test_attention_modes_match_a_per_token_reference(mode):
    # Two trees in one row: [0..3) prompt, [3..5) and [5..8) its two children, [8..9) a grandchild of the first;
    # then a second tree [9..11) with one child [11..14).
    blocks = [Block(0, 3, -1), Block(3, 2, 0), Block(5, 3, 0), Block(8, 1, 1), Block(9, 2, -1), Block(11, 3, 4)]
    T = 14
    torch.manual_seed(0)
    q = torch.randn(1, 4, T, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, T, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, T, 8, dtype=torch.float64, requires_grad=True)
    want = attend_reference(q, k, v, blocks, T)
    module = torch.nn.Module()
    layout = build_layout(blocks, T, mode, CPU)
    if mode == "flex":  # FlexAttention has no backward on CPU: the forward (and the block mask) is checked here
        with torch.no_grad():
            got, _ = tree_attention(module, q.detach(), k.detach(), v.detach(), None, tree_layout=layout)
        torch.testing.assert_close(got, want.detach())
        return
    got, _ = tree_attention(module, q, k, v, None, tree_layout=layout)
    torch.testing.assert_close(got, want)
    g_got = torch.autograd.grad(got.square().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b)


def tiny_qwen(seed=0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, pad_token_id=1)
    return prepare_model(Qwen2ForCausalLM(cfg).double().eval(), logprob_chunk=5)


def gradients(model, trees, packing, off_policy, loss_cfg, budget=40, rows=3, attention="gather"):
    """One mini-batch's loss and gradient the way the learner forms them: global denominators, per-token weights,
    micro-batch by micro-batch (no optimizer). Reference log-probs for the KL term: the behaviour ones."""
    indices = [TreeIndex(t) for t in trees]
    denoms = denominators(indices)
    weights = [loss_weights(ix, loss_cfg.aggregation, denoms) for ix in indices]
    behaviour = [[np.asarray(lp, dtype=np.float64) for lp in ix.tree.logprobs] for ix in indices]
    model.zero_grad()
    total = 0.0
    for items in plan(indices, packing, budget, rows):
        mb = (packed_micro_batch(items, indices, weights, attention, CPU) if packing == "tree"
              else padded_micro_batch(items, indices, weights, 1, CPU))
        logp, ent = micro_batch_logprobs(model, model, mb)
        behav = torch.from_numpy(mb.gather(behaviour))
        old = behav if off_policy == "behaviour" else logp.detach()
        loss, _ = tree_policy_loss(logp, old, mb.weights, loss_cfg, ref_logprobs=behav, entropy=ent)
        loss.backward()
        total += loss.item()
    return total, {k: p.grad.clone() for k, p in model.named_parameters()}


def assert_same_gradient(got: dict, want: dict) -> None:
    # The model runs in float64, but Qwen2's RMSNorm computes in float32 (its backward rounds gradients to it):
    # two layouts agree to about 1e-8 of each parameter's largest gradient, not to float64's 1e-16.
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-6, atol=1e-6 * float(w.abs().max()), msg=name)


@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_packed_and_unpacked_give_the_same_loss_and_gradient(algorithm):
    rng = np.random.default_rng(list(ALGORITHMS).index(algorithm))
    trees = random_train_trees(rng, algorithm, n=3, depth=(2, 4), branch=(1, 3), seg=(2, 4))
    loss_cfg = LossConfig(**{**ALGORITHMS[algorithm].loss, "kl_coef": 0.05, "entropy_coef": 0.01, "dual_clip": 3.0})
    model = tiny_qwen()
    assert any(p.nodes[0] not in p.owned for t, tree in enumerate(trees) for p in split_tree(TreeIndex(tree), t, 10))
    # Old log-probs: the behaviour ones (ratios far from 1, clipping in play); for treepo also ratio 1.
    for off_policy in ("behaviour", "recompute") if algorithm == "treepo" else ("behaviour",):
        want_loss, want = gradients(model, trees, "none", off_policy, loss_cfg, rows=8)
        got_loss, got = gradients(model, trees, "tree", off_policy, loss_cfg, budget=10)  # split into subtrees
        assert got_loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
        assert_same_gradient(got, want)
        assert any(g.abs().sum() > 0 for g in want.values())


def test_attention_modes_train_alike():
    trees = random_train_trees(np.random.default_rng(7), "treepo", n=2)
    model = tiny_qwen()
    loss_cfg = LossConfig(**ALGORITHMS["treepo"].loss)
    base_loss, base = gradients(model, trees, "tree", "behaviour", loss_cfg, attention="gather")
    loss, grads = gradients(model, trees, "tree", "behaviour", loss_cfg, attention="sdpa")
    assert loss == pytest.approx(base_loss, rel=1e-9)
    assert_same_gradient(grads, base)


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3", "Llama"])
def test_packed_logprobs_equal_per_path_ones_in_each_model_family(family):
    import transformers

    config = getattr(transformers, f"{family}Config")(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=1)
    torch.manual_seed(0)
    model = prepare_model(getattr(transformers, f"{family}ForCausalLM")(config).double().eval(), logprob_chunk=8)
    trees = random_train_trees(np.random.default_rng(4), "treepo", n=2)
    indices = [TreeIndex(t) for t in trees]
    weights = [loss_weights(ix, "token-mean", denominators(indices)) for ix in indices]
    per_node = {}
    with torch.no_grad():
        for packing in ("none", "tree"):
            for items in plan(indices, packing, 12, 3):
                mb = (packed_micro_batch(items, indices, weights, "gather", CPU) if packing == "tree"
                      else padded_micro_batch(items, indices, weights, 1, CPU))
                logp, _ = micro_batch_logprobs(model, model, mb)
                for s in mb.scored:
                    per_node.setdefault((s.tree, s.node), []).append(logp[s.start:s.start + s.length])
    for runs in per_node.values():
        for other in runs[1:]:  # every path through a node, and the packed pass, agree
            torch.testing.assert_close(other, runs[0], rtol=1e-6, atol=1e-6)


def test_gather_groups_blocks_of_about_one_size_at_the_least_padded_cost():
    from itertools import combinations

    from treepo_ray.learner.tree_attention import GROUP_COST, _split_by_size

    def cost(groups, sizes):
        return sum(len(g) * max(sizes[i][0] for i in g) * max(sizes[i][1] for i in g) + GROUP_COST for g in groups)

    # Paths that end early and late: two groups beat one padded to the longest, and every block is placed once.
    sizes = [(32, 64)] * 6 + [(224, 288)] * 6
    groups = _split_by_size(sizes)
    assert sorted(i for g in groups for i in g) == list(range(12))
    assert sorted(len(g) for g in groups) == [6, 6] and cost(groups, sizes) < cost([list(range(12))], sizes)
    assert _split_by_size([(40, 90)] * 5) == [[0, 1, 2, 3, 4]]  # one size: one call
    # No cut of the keys-sorted order does better (brute force over every cut of small random sets).
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(1, 8))
        sizes = [(int(q), int(q + rng.integers(0, 300))) for q in rng.integers(1, 250, n)]
        order = sorted(range(n), key=lambda i: (-sizes[i][1], -sizes[i][0]))
        best = min(cost([order[a:b] for a, b in zip((0,) + cuts, cuts + (n,))], sizes)
                   for r in range(n) for cuts in combinations(range(1, n), r))
        assert cost(_split_by_size(sizes), sizes) == best
