import pytest
from scripted_engine import EOS, child, decode, drive

from treepo_ray.tree import SequentialConfig, SequentialGrower, Tree, TreeRPOConfig, TreeRPOGrower


def treerpo(**kw) -> TreeRPOGrower:
    return TreeRPOGrower(Tree(prompt_ids=[100], query_id="p"), TreeRPOConfig(**kw), eos_token_id=EOS, decode=decode,
                         seed=0)


def sequential(**kw) -> SequentialGrower:
    base = dict(repetition_substr_len=8, repetition_min_count=3)
    base.update(kw)
    return SequentialGrower(Tree(prompt_ids=[100], query_id="p"), SequentialConfig(**base), eos_token_id=EOS,
                            decode=decode, seed=0)


def go(tree, ask, j, k):
    return child(ask, j, "go")


# ---- TreeRPO ------------------------------------------------------------------------------------------------------


def test_treerpo_full_tree_has_n_to_the_d_leaves():
    g = treerpo(n_children=3, max_depth=3, step_len=4)
    batches = drive(g, go)
    t = g.tree
    assert len(t) == 1 + 3 + 9 + 27
    assert sorted(t.trajectories) == t.leaves() and len(t.trajectories) == 27
    assert all(t.depth[n] == 3 and t.finish[n] == "max_length" for n in t.trajectories)  # 12 = D * L tokens
    assert all(len(t.children(n)) == 3 for n in range(len(t)) if t.depth[n] < 3)
    assert all(a.n == 3 and a.max_new_tokens == 4 for b in batches for a in b)
    assert g.stats()["asks"] == 1 + 3 + 9


def test_treerpo_early_ends():
    # Child 0 of the root ends with EOS; under child 1, child 2 is a boxed answer (TreeRPO does not stop there).
    def script(tree, ask, j, k):
        if ask.node == 0 and j == 0:
            return child(ask, j, "eos")
        return child(ask, j, "box" if tree.depth[ask.node] == 1 and j == 2 else "go")

    g = treerpo(n_children=3, max_depth=2, step_len=4, max_response_len=100)
    drive(g, script)
    t = g.tree
    assert len(t.trajectories) == 1 + 2 * 3
    assert sorted(t.trajectories) == t.leaves()
    reasons = sorted(t.finish[n] for n in t.trajectories)
    assert reasons == ["eos"] + ["max_depth"] * 6
    # Trajectories are listed depth-first: the EOS leaf (child 0 of the root) first.
    assert t.depth[t.trajectories[0]] == 1 and t.finish[t.trajectories[0]] == "eos"


def test_treerpo_response_limit_shortens_the_last_step():
    g = treerpo(n_children=2, max_depth=3, step_len=4, max_response_len=10)
    batches = drive(g, go)
    assert [a.max_new_tokens for a in batches[-1]] == [2] * 4
    assert all(g.tree.finish[n] == "max_length" for n in g.tree.trajectories) and len(g.tree.trajectories) == 8


def test_treerpo_same_seed_same_tree_and_json_round_trip():
    a, b = treerpo(n_children=2, max_depth=3, step_len=3), treerpo(n_children=2, max_depth=3, step_len=3)
    drive(a, go)
    drive(b, go)
    assert a.tree.to_dict() == b.tree.to_dict()
    a.tree.set_trajectory_rewards([float(i % 2) for i in range(8)])
    assert Tree.from_json(a.tree.to_json()) == a.tree
    assert a.tree.reward[0] == 0.5


def test_treerpo_bad_config():
    with pytest.raises(ValueError, match="n_children"):
        TreeRPOConfig(n_children=0)


# ---- sequential ---------------------------------------------------------------------------------------------------


def test_sequential_grows_g_independent_paths():
    # Path k ends with EOS at depth k + 1; path 4 would at depth 5, but reaches the 16-token limit at depth 4 first.
    def script(tree, ask, j, k):
        path = j if ask.node == 0 else tree.path(ask.node)[0] - 1
        return child(ask, j, "eos" if tree.depth[ask.node] + 1 == path + 1 else "go")

    g = sequential(group_size=5, segment_len=4, max_depth=4)
    batches = drive(g, script)
    t = g.tree
    assert batches[0][0].n == 5 and all(a.n == 1 for b in batches[1:] for a in b)
    assert len(t.trajectories) == 5
    assert [t.depth[n] for n in t.trajectories] == [1, 2, 3, 4, 4]
    assert [t.finish[n] for n in t.trajectories] == ["eos", "eos", "eos", "eos", "max_length"]
    assert all(len(t.children(n)) <= 1 for n in range(1, len(t)))  # no branching below the root
    assert g.stats()["branches"] == 1 and g.stats()["fallbacks"] == 0


def test_sequential_uses_treepo_early_stops():
    def script(tree, ask, j, k):
        return child(ask, j, ["boxed", "rep", "go", "box"][j] if ask.node == 0 else "go")

    g = sequential(group_size=4, segment_len=4, max_depth=3, max_response_len=100)
    drive(g, script)
    t = g.tree
    assert [t.finish[n] for n in t.trajectories] == ["boxed", "repetition", "max_depth", "boxed"]
    g2 = sequential(group_size=4, segment_len=4, max_depth=3, max_response_len=100, require_eos_after_boxed=True)
    drive(g2, script)
    assert [g2.tree.finish[n] for n in g2.tree.trajectories] == ["boxed", "repetition", "max_depth", "max_depth"]


def test_sequential_and_treepo_share_outputs_for_the_same_asks():
    # The first ask of either grower is n children of the prompt with the same seed rule.
    from treepo_ray.tree import TreePOConfig, TreePOGrower

    s = sequential(group_size=4)
    p = TreePOGrower(Tree(prompt_ids=[100], query_id="p"), TreePOConfig(width=4, init_divergence=4), eos_token_id=EOS,
                     decode=decode, seed=0)
    (a,), (b,) = s.asks(), p.asks()
    assert a == b  # same id, node, n, max_new_tokens and seed
