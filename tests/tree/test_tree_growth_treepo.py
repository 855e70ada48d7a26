import numpy as np
import pytest
from scripted_engine import EOS, by_round, child, decode, drive

from treepo_ray.tree import (
    Segment,
    Tree,
    TreePOConfig,
    TreePOGrower,
    allocate_logprob,
    allocate_uniform,
    branch_budget,
    scheduled,
)


def cfg(**kw) -> TreePOConfig:
    base = dict(width=16, max_depth=14, segment_len=4, repetition_substr_len=8, repetition_min_count=3)
    base.update(kw)
    return TreePOConfig(**base)


def grower(c: TreePOConfig, seed: int = 0) -> TreePOGrower:
    return TreePOGrower(Tree(prompt_ids=[100, 101], query_id="q"), c, eos_token_id=EOS, decode=decode, seed=seed)


# ---- budget transfer ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "finished, finished_now, active, expected",
    [
        (0, 0, 2, 4),  # depth 1 of a binary tree: 2 paths x b=2
        (1, 1, 3, 8),  # one finished: its 2 branches go to the 3 survivors, b * (1 + 3) = 8 <= 15 left
        (4, 3, 5, 12),  # b * (3 + 5) = 16, but only 16 - 4 = 12 trajectories are missing
        (14, 10, 2, 2),  # 2 missing
        (15, 0, 3, 3),  # 1 missing, but every active path continues: at least `active`
        (20, 1, 2, 2),  # more finished than w: nothing remains, still one child per active path
    ],
)
def test_branch_budget_hand_computed(finished, finished_now, active, expected):
    assert branch_budget(16, 2, finished, finished_now, active) == expected


def test_budget_transfer_round_by_round():
    plan = {
        2: {0: "eos"},
        3: {0: "boxed", 1: "eos", 2: "rep"},
        4: {k: "eos" for k in range(10)},
        5: {0: "eos", 1: "eos"},
    }
    g = grower(cfg())
    batches = drive(g, by_round(plan))
    steps = [(s.depth, s.finished, s.finished_now, s.active, s.total) for s in g.history]
    assert steps == [(1, 0, 0, 2, 4), (2, 1, 1, 3, 8), (3, 4, 3, 5, 12), (4, 14, 10, 2, 2), (5, 16, 2, 0, 0)]
    shares = [sorted(s.shares) for s in g.history]
    assert shares == [[2, 2], [2, 3, 3], [2, 2, 2, 3, 3], [1, 1], []]
    # Each round's asks are exactly one ask per active path, n = its share.
    assert [[a.n for a in b] for b in batches] == [[2]] + [s.shares for s in g.history[:-1]]
    assert [len(b) for b in batches] == [1, 2, 3, 5, 2]
    t = g.tree
    assert len(t.trajectories) == 16 and len(set(t.trajectories)) == 16
    assert all(t.finish[n] != "none" and not t.children(n) for n in t.trajectories)
    st = g.stats()
    assert st["finish/eos"] == 14 and st["finish/boxed"] == 1 and st["finish/repetition"] == 1
    assert st["asks"] == 13 and st["rounds"] == 5 and st["fallbacks"] == 0
    assert st["branches"] == 11  # asks with n >= 2: the root, then 2 + 3 + 5 in rounds 1-3
    # Rounds 2 and 3 gave the finished paths' budget to the survivors (8 > b * 3 = 6, 12 > b * 5 = 10); in
    # round 4 the 2 survivors get only what is missing, which their own budget covers.
    assert st["budget_transfers"] == 2 and st["random_divergence"] == 0 and st["logprob_branchings"] == 0
    assert st["max_depth_reached"] == 5 and st["trajectories"] == 16
    assert t.meta["growth"] == st


def test_uniform_remainder_goes_to_random_paths():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(50):
        shares = allocate_uniform(8, 3, rng)
        assert sorted(shares) == [2, 3, 3]
        seen.add(tuple(shares))
    assert seen == {(2, 3, 3), (3, 2, 3), (3, 3, 2)}


def test_round_waits_for_every_active_path():
    g = grower(cfg())
    (root,) = g.asks()
    g.receive(root.request_id, [child(root, j) for j in range(2)])
    a1, a2 = g.asks()
    assert g.asks() == []  # each ask is returned once
    g.receive(a1.request_id, [child(a1, j) for j in range(a1.n)])
    assert g.asks() == [] and not g.done()  # depth 2 of path 2 is still missing
    g.receive(a2.request_id, [child(a2, j) for j in range(a2.n)])
    assert sum(a.n for a in g.asks()) == 8  # the next depth is branched at once


# ---- initial divergence -------------------------------------------------------------------------------------------


def test_fixed_initial_divergence():
    g = grower(cfg(init_divergence=5))
    (root,) = g.asks()
    assert (root.node, root.n, root.max_new_tokens) == (0, 5, 4)
    assert g.stats()["init_divergence"] == 5


def test_random_initial_divergence_per_prompt():
    values = []
    for seed in range(40):
        g = grower(cfg(init_divergence_min=2, init_divergence_max=8), seed=seed)
        (root,) = g.asks()
        assert 2 <= root.n <= 8 and root.n == g.stats()["init_divergence"]
        assert g.stats()["random_divergence"] == 1
        assert grower(cfg(init_divergence_min=2, init_divergence_max=8), seed=seed).asks()[0].n == root.n
        values.append(root.n)
    assert len(set(values)) >= 5


def test_random_initial_divergence_still_gives_w():
    g = grower(cfg(init_divergence_min=2, init_divergence_max=8, max_depth=4), seed=3)
    drive(g, by_round({}))
    assert len(g.tree.trajectories) == 16


# ---- log-prob weighted allocation ---------------------------------------------------------------------------------


def test_logprob_allocation_hand_computed():
    # softmax([-1, -3, -9] / 2) = [0.7214, 0.2654, 0.0132]; x 8 = [5.77, 2.12, 0.11] -> [6, 2, max(1, 0)], 9 in
    # all: the one past the budget comes off the largest share
    assert allocate_logprob(8, [-1.0, -3.0, -9.0], 2.0, +1.0) == [5, 2, 1]
    # low: softmax([1, 3, 9] / 2) x 8 = [0.14, 0.37, 7.49] -> [1, 1, 7] -> [1, 1, 6]
    assert allocate_logprob(8, [-1.0, -3.0, -9.0], 2.0, -1.0) == [1, 1, 6]
    # a high temperature flattens it: near uniform
    assert allocate_logprob(8, [-1.0, -3.0], 1000.0, +1.0) == [4, 4]
    # equal log-probs: x 8 = [2.67] * 3 -> [3, 3, 3], one past the budget off the first largest
    assert allocate_logprob(8, [-1.0, -1.0, -1.0], 1.0, +1.0) == [2, 3, 3]
    # below the budget stays below (fallback makes it up): x 8 = [3.44, 3.44, 1.12] -> [3, 3, 1]
    assert allocate_logprob(8, [-1.0, -1.0, -2.12], 1.0, +1.0) == [3, 3, 1]
    # as many paths as the budget: one each, whatever the log-probs
    assert allocate_logprob(3, [-1.0, -30.0, -60.0], 0.5, +1.0) == [1, 1, 1]


@pytest.mark.parametrize("policy", ["logprob_high", "logprob_low"])
def test_logprob_policy_in_the_grower(policy):
    # Round 1: the first root child has segment log-prob 4 * -0.25 = -1, the second 4 * -1 = -4.
    def script(tree, ask, j, k):
        lp = -0.25 if (tree.depth[ask.node] == 0 and j == 0) else -1.0
        kind = "eos" if tree.depth[ask.node] >= 1 else "go"
        return child(ask, j, kind, lp)

    g = grower(cfg(width=8, divergence_policy=policy, logprob_temperature=2.0))
    drive(g, script)
    first = g.history[0]
    assert first.total == 4 and min(first.shares) >= 1
    # softmax([-1, -4] / 2) = [0.818, 0.182]: x 4 = [3.27, 0.73] -> [3, 1]
    assert first.shares == ([3, 1] if policy == "logprob_high" else [1, 3])
    # 4 paths end at depth 2; 4 are missing and none is active: fallback fills the width.
    assert len(g.tree.trajectories) == 8 and g.stats()["fallbacks"] == 1
    assert g.stats()["logprob_branchings"] == 1  # round 1 spread by log-probs; the fallback asks from one node


def test_scheduled_logprob_temperature():
    c = cfg(width=8, divergence_policy="logprob_low", logprob_temperature=5.0, logprob_temperature_end=1.0)
    assert [scheduled(c, p).logprob_temperature for p in (0.0, 0.5, 1.0, 2.0)] == [5.0, 3.0, 1.0, 1.0]
    assert scheduled(c, 0.5).logprob_temperature_end == 0.0 and c.logprob_temperature == 5.0  # a copy
    plain = cfg()
    assert scheduled(plain, 0.7) is plain


def test_context_limit_ends_long_prompts_earlier():
    # Prompt of 2 tokens, context of 12: at most 10 response tokens, so the third segment is cut to 2 tokens
    # and ends as max_length at depth 3; a depth limit of 3 alone would have ended 12-token paths as max_depth.
    g = grower(cfg(width=2, init_divergence=2, max_depth=3, max_response_len=100, max_total_len=12))
    batches = drive(g, by_round({}))
    assert [a.max_new_tokens for b in batches for a in b] == [4, 4, 4, 2, 2]
    assert {g.tree.finish[n] for n in g.tree.trajectories} == {"max_length"}
    g = grower(cfg(width=2, init_divergence=2, max_depth=3, max_response_len=100, max_total_len=15))
    drive(g, by_round({}))
    assert {g.tree.finish[n] for n in g.tree.trajectories} == {"max_depth"}
    with pytest.raises(ValueError, match="no room"):
        grower(cfg(max_total_len=2))


def test_temperature_may_change_between_rounds():
    # Every first child has segment log-prob -1, every second -8.
    c = cfg(width=8, divergence_policy="logprob_high", logprob_temperature=1000.0)
    g = grower(c)

    def answer(ask):
        g.receive(ask.request_id, [child(ask, j, "go", -0.25 if j == 0 else -2.0) for j in range(ask.n)])

    answer(*g.asks())
    asks = g.asks()
    assert [a.n for a in asks] == [2, 2]  # nearly uniform at T = 1000
    c.logprob_temperature = 0.1  # a schedule lowers T for the next round
    for a in asks:
        answer(a)
    # softmax([-1, -8, -1, -8] / 0.1) = [.5, 0, .5, 0]: x 8 -> [4, 0, 4, 0], every path gets one at least, and the
    # two past the budget of 8 come off the largest shares
    assert [a.n for a in g.asks()] == [3, 1, 3, 1]


def test_rounding_never_grows_a_path_past_the_width():
    # w = 4; round 1 log-probs -1 and -3 at T = 1: softmax x 4 = [3.52, 0.48] -> [4, 1] by the paper's rounding,
    # 5 paths for 4 trajectories; capped at the budget: [3, 1], and every grown path is a trajectory.
    def script(tree, ask, j, k):
        if tree.depth[ask.node] == 0:
            return child(ask, j, "go", -0.25 if j == 0 else -0.75)
        return child(ask, j, "eos")

    g = grower(cfg(width=4, divergence_policy="logprob_high", logprob_temperature=1.0))
    drive(g, script)
    t = g.tree
    assert g.history[0].shares == [3, 1]
    finished = [n for n in range(len(t)) if t.finish[n] != "none"]
    assert sorted(finished) == sorted(t.trajectories) and len(finished) == 4


# ---- fallback -----------------------------------------------------------------------------------------------------


def fallback_tree(kinds: dict[int, str], policy: str = "finished_first", seed: int = 0):
    # w = 8: round 1 branches 2 paths into 4 (nodes 3, 4 under 1; 5, 6 under 2), which all end at depth 2.
    c = cfg(width=8, fallback_policy=policy)
    g = grower(c, seed)
    batches = drive(g, by_round({2: kinds, 3: {k: "eos" for k in range(8)}}))
    return g, batches


def test_fallback_from_most_recently_finished_boxed_or_eos_path():
    g, batches = fallback_tree({0: "eos", 1: "rep", 2: "boxed", 3: "rep"})
    t = g.tree
    assert [t.finish[n] for n in (3, 4, 5, 6)] == ["eos", "repetition", "boxed", "repetition"]
    assert g.fallback_candidates() == [3, 5, 7, 9]  # the fallback children end like round 2: eos, rep, boxed, rep
    (fb,) = batches[2]
    # Most recently finished qualifying path: node 5; branch from the end of the segment before it (node 2).
    assert (fb.node, fb.n) == (2, 4)
    assert g.stats()["fallbacks"] == 1
    assert [t.parent[n] for n in (7, 8, 9, 10)] == [2, 2, 2, 2] and t.depth[7] == 2
    assert len(t.trajectories) == 8 and sorted(t.trajectories) == [3, 4, 5, 6, 7, 8, 9, 10]


def test_random_fallback_picks_only_qualifying_paths():
    points = set()
    for seed in range(30):
        g, batches = fallback_tree({0: "eos", 1: "rep", 2: "boxed", 3: "rep"}, "random", seed)
        (fb,) = batches[2]
        points.add(fb.node)
        assert len(g.tree.trajectories) == 8
    assert points == {1, 2}  # parents of the eos (3) and boxed (5) leaves, never of the repetitive ones


def test_fallback_from_the_prompt_when_no_path_qualifies():
    g, batches = fallback_tree({k: "rep" for k in range(4)})
    (fb,) = batches[2]
    assert (fb.node, fb.n, fb.max_new_tokens) == (0, 4, 4)
    assert len(g.tree.trajectories) == 8


def test_boxed_answer_without_eos_qualifies_for_fallback():
    # require_eos_after_boxed: node 1 holds a box but goes on; its child (node 2) stops on repetition. That path
    # holds a boxed answer, so fallback branches from node 1, before the repetitive segment.
    c = cfg(width=4, init_divergence=1, branch_factor=1, require_eos_after_boxed=True)
    g = grower(c)
    batches = drive(g, by_round({1: {0: "box"}, 2: {0: "rep"}, 3: {k: "eos" for k in range(4)}}))
    t = g.tree
    assert t.finish[1] == "none" and t.finish[2] == "repetition"
    (fb,) = batches[2]
    assert (fb.node, fb.n) == (1, 3)
    assert len(t.trajectories) == 4


def test_no_fallback_while_a_path_is_active():
    # b = 1, w = 8: one root child ends at depth 1, the other path (2 children from then on) goes on to depth 5.
    # The tree is far short of w all along, but fallback waits until no path is active.
    c = cfg(width=8, init_divergence=2, branch_factor=1, max_depth=5)
    g = grower(c)
    batches = drive(g, by_round({1: {0: "eos"}}))
    assert [(s.depth, s.finished, s.active, s.total) for s in g.history[:5]] == [
        (1, 1, 1, 2), (2, 1, 2, 2), (3, 1, 2, 2), (4, 1, 2, 2), (5, 3, 0, 0)
    ]
    # Then one fallback from the prompt (parent of the EOS leaf, node 1) for the 5 missing trajectories.
    assert (batches[5][0].node, batches[5][0].n) == (0, 5) and g.stats()["fallbacks"] == 1
    assert len(g.tree.trajectories) == 8


# ---- width, depth, determinism ------------------------------------------------------------------------------------


@pytest.mark.parametrize("limit, reason", [(100, "max_depth"), (None, "max_length")])
def test_max_depth_ends_every_path_then_fallback_from_prompt(limit, reason):
    # With the default limit d * l = 12 tokens a full path hits both limits; max_length is checked first.
    g = grower(cfg(max_depth=3, max_response_len=limit))
    drive(g, by_round({}))
    t = g.tree
    assert max(t.depth) == 3 and len(t.trajectories) == 16
    assert all(t.finish[n] == reason and t.depth[n] == 3 for n in t.trajectories)
    # 8 paths reach depth 3; max_depth paths do not qualify, so the other 8 come from the prompt.
    assert g.stats()["fallbacks"] == 1 and len(t.children(0)) == 2 + 8


def test_max_response_len_caps_the_last_segment():
    g = grower(cfg(width=2, init_divergence=2, max_response_len=10))
    batches = drive(g, by_round({}))
    assert [a.max_new_tokens for b in batches for a in b] == [4, 4, 4, 2, 2]
    t = g.tree
    assert all(t.finish[n] == "max_length" and len(t.response_ids(n)) == 10 for n in t.trajectories)


def test_same_seed_same_tree_and_arrival_order_does_not_matter():
    def script(tree, ask, j, k):
        r = np.random.default_rng([ask.seed, j]).random()
        kind = "eos" if r < 0.25 else "rep" if r < 0.35 else "go"
        return child(ask, j, kind, lp=-float(r))

    def grow(seed, reverse=False, policy="uniform"):
        g = grower(cfg(max_depth=6, divergence_policy=policy, fallback_policy="random"), seed)
        drive(g, script, reverse=reverse)
        return g

    for policy in ("uniform", "logprob_low"):
        a, b = grow(7, policy=policy).tree, grow(7, policy=policy).tree
        assert a.to_dict() == b.to_dict()
        assert len(a.trajectories) == 16
        # Results delivered in the opposite order: the same tree under other node ids, until both are renumbered.
        ga, gr = grow(7, policy=policy), grow(7, reverse=True, policy=policy)
        assert gr.tree.tokens != ga.tree.tokens
        for g in (ga, gr):
            g.tree.renumber(g.depth_first_order())
        assert gr.tree.to_dict() == ga.tree.to_dict()
    assert grow(8).tree.to_dict() != grow(7).tree.to_dict()


def test_ask_seeds_are_distinct_and_ids_carry_the_query():
    g = grower(cfg(max_depth=4))
    batches = drive(g, by_round({}))
    asks = [a for b in batches for a in b]
    assert len({a.seed for a in asks}) == len(asks)
    assert [a.request_id for a in asks] == [f"q/{i}" for i in range(len(asks))]


def test_json_round_trip_of_a_grown_tree():
    g, _ = fallback_tree({0: "eos", 1: "rep", 2: "boxed", 3: "rep"})
    t = g.tree
    t.set_trajectory_rewards([1.0] * 8)
    back = Tree.from_json(t.to_json())
    assert back == t and back.meta["growth"]["fallbacks"] == 1


def test_propagate_rewards_on_a_grown_tree():
    # w = 4: nodes 1, 2 at depth 1; 3, 4 under 1 and 5, 6 under 2 all end with EOS.
    g = grower(cfg(width=4))
    drive(g, by_round({2: {k: "eos" for k in range(4)}}))
    t = g.tree
    assert t.trajectories == [3, 4, 5, 6] and t.children(1) == [3, 4] and t.children(2) == [5, 6]
    t.set_trajectory_rewards([1.0, 0.0, 1.0, 1.0])
    assert t.reward[1] == 0.5 and t.reward[2] == 1.0 and t.reward[0] == 0.75


# ---- bad input ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(init_divergence=17), "init_divergence 17 exceeds width"),
        (dict(init_divergence_min=2), "set together"),
        (dict(init_divergence_min=4, init_divergence_max=3), "init_divergence_min <= init_divergence_max"),
        (dict(divergence_policy="greedy"), "divergence_policy"),
        (dict(fallback_policy="bfs"), "fallback_policy"),
        (dict(width=0), "width must be > 0"),
        (dict(logprob_temperature=0.0), "logprob_temperature"),
        (dict(max_response_len=-1), "max_response_len"),
    ],
)
def test_bad_config_is_rejected(kw, message):
    with pytest.raises(ValueError, match=message):
        cfg(**kw)


def test_bad_results_are_rejected():
    g = grower(cfg())
    with pytest.raises(ValueError, match="not yet returned"):
        g.receive("q/0", [])
    (root,) = g.asks()
    with pytest.raises(ValueError, match="never issued"):
        g.receive("q/99", [])
    with pytest.raises(ValueError, match="asked for 2 children, got 1"):
        g.receive(root.request_id, [child(root, 0)])
    with pytest.raises(ValueError, match="finish_reason 'stop'"):
        g.receive(root.request_id, [Segment([11], [0.0], "stop")] * 2)
    with pytest.raises(ValueError, match="5 tokens > max_new_tokens 4"):
        g.receive(root.request_id, [Segment([11] * 5, [0.0] * 5, "length")] * 2)
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        g.receive(root.request_id, [Segment([11, 12], [0.0], "length")] * 2)
    assert len(g.tree) == 1  # nothing was added by the rejected results
    g.receive(root.request_id, [child(root, 0), child(root, 1)])
    with pytest.raises(ValueError, match="already received"):
        g.receive(root.request_id, [child(root, 0), child(root, 1)])


def test_grower_needs_a_fresh_tree_and_a_valid_seed():
    t = Tree(prompt_ids=[1])
    t.add_node(0, [2], [0.0])
    with pytest.raises(ValueError, match="only the prompt"):
        TreePOGrower(t, cfg(), eos_token_id=EOS, decode=decode, seed=0)
    with pytest.raises(ValueError, match="seed"):
        TreePOGrower(Tree(prompt_ids=[1]), cfg(), eos_token_id=EOS, decode=decode, seed=-1)


# ---- segment ends on KV-cache block boundaries (segment_align) ----------------------------------------------------


@pytest.mark.parametrize("prompt_len, extend", [(9, 0), (10, -1), (13, -4), (14, 3), (16, 1), (17, 0), (23, 2)])
def test_segment_align_puts_every_inner_prefix_one_past_a_block_boundary(prompt_len, extend):
    """Align 8, segments of 8: the first segment is cut or extended to the nearest boundary, so each later prefix
    is 1 past a multiple of 8 (the next segment feeds the parent's last sampled token first); the last segment
    gives or takes the difference, so every path still holds max_depth x segment_len tokens."""
    c = cfg(width=8, max_depth=4, segment_len=8, segment_align=8, repetition_substr_len=0)
    g = TreePOGrower(Tree(prompt_ids=list(range(100, 100 + prompt_len)), query_id="q"), c, eos_token_id=EOS,
                     decode=decode, seed=1)
    batches = drive(g, by_round({}))
    for asks in batches:
        for a in asks:
            depth = g.tree.depth[a.node] + 1
            assert a.max_new_tokens == {1: 8 + extend, 4: 8 - extend}.get(depth, 8)
            if depth > 1:
                assert len(g.tree.prefix_ids(a.node)) % 8 == 1
    assert len(g.tree.trajectories) == 8
    assert all(len(g.tree.response_ids(n)) == 32 for n in g.tree.trajectories)


def test_segment_align_off_or_already_aligned_asks_plain_segments():
    plain = grower(cfg(width=4, max_depth=3, segment_len=8, repetition_substr_len=0))
    aligned = TreePOGrower(Tree(prompt_ids=list(range(100, 109)), query_id="q"),  # 9 + 8 = 17 = 2 * 8 + 1
                           cfg(width=4, max_depth=3, segment_len=8, segment_align=8, repetition_substr_len=0),
                           eos_token_id=EOS, decode=decode, seed=0)
    for g in (plain, aligned):
        assert {a.max_new_tokens for asks in drive(g, by_round({})) for a in asks} == {8}
    with pytest.raises(ValueError, match="segment_align"):
        cfg(segment_len=8, segment_align=3)


# ---- entropy-guided branch points and budgets ---------------------------------------------------------------------


def entropic(ask, j, length=None) -> Segment:
    """A 'go' child with entropies: child j of an ask is as uncertain as j, so later children look less sure."""
    seg = child(ask, j, "go")
    seg.entropies = [0.1 * (j + 1)] * len(seg.token_ids)
    return seg


def test_entropy_branch_points_ask_for_stops_only_while_the_tree_can_still_branch():
    g = grower(cfg(width=8, init_divergence=2, segment_len=8, branch_point="entropy", branch_entropy=1.5,
                   min_segment_len=3))
    batches = drive(g, lambda tree, a, j, k: child(a, j, "boxed") if tree.depth[a.node] >= 3 else entropic(a, j))
    first, second, third = (b[0] for b in batches[:3])
    # Rounds whose children will be branched from stop at uncertain tokens: 2 -> 4 -> 8 paths, then width is full.
    assert (first.stop_entropy, first.min_new_tokens, first.n) == (1.5, 3, 2)
    assert (second.stop_entropy, second.min_new_tokens) == (1.5, 3) and sum(a.n for a in batches[1]) == 4
    assert third.stop_entropy == 0.0 and sum(a.n for a in batches[2]) == 8
    assert len(g.tree.trajectories) == 8


def test_a_segment_that_stopped_at_an_uncertain_token_is_branched_from_there():
    """The engine ends a segment before an uncertain token ('branch'); the grower continues the path from exactly
    that node, counts the stop and, under divergence_policy 'entropy', gives the most uncertain path most children."""
    g = grower(cfg(width=8, init_divergence=2, segment_len=8, branch_point="entropy", branch_entropy=1.0,
                   min_segment_len=2, divergence_policy="entropy", entropy_temperature=0.25))

    def script(tree, a, j, k):
        if tree.depth[a.node] >= 1:
            return child(a, j, "boxed")
        ids = child(a, j, "go").token_ids[: 2 + j]  # child j stopped after 2 + j tokens
        return Segment(ids, [-1.0] * len(ids), "branch", entropies=[0.5] * len(ids), branch_entropy=1.0 + 2 * j)

    batches = drive(g, script)
    depth1 = g.tree.children(0)
    assert [len(g.tree.tokens[n]) for n in depth1] == [2, 3]
    asks = {a.node: a.n for a in batches[1]}
    assert asks[depth1[1]] > asks[depth1[0]]  # entropy 3.0 against 1.0 at T 0.25: most of the 4 children
    assert sum(asks.values()) == 4
    stats = g.tree.meta["growth"]
    assert stats["entropy_stops"] == 2 and stats["entropy_branchings"] == 1
    assert g.tree.entropy[depth1[0]] == [0.5, 0.5]


def test_entropy_divergence_without_entropies_is_a_clear_error():
    g = grower(cfg(width=8, init_divergence=2, divergence_policy="entropy"))
    with pytest.raises(ValueError, match="rollout.entropy"):
        drive(g, lambda tree, a, j, k: child(a, j, "go"))
