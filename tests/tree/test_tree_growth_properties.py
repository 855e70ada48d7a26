"""Property tests: TreePO growth under random scripted engines and random configurations."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from scripted_engine import BOX, CLOSE, EOS, SEVEN, A, decode

from treepo_ray.tree import Segment, Tree, TreePOConfig, TreePOGrower


@st.composite
def configs(draw):
    width = draw(st.integers(1, 12))
    kw = dict(
        width=width,
        max_depth=draw(st.integers(1, 6)),
        segment_len=draw(st.integers(1, 5)),
        branch_factor=draw(st.integers(1, 3)),
        divergence_policy=draw(st.sampled_from(["uniform", "logprob_high", "logprob_low"])),
        logprob_temperature=draw(st.sampled_from([0.2, 1.0, 2.0, 50.0])),
        fallback_policy=draw(st.sampled_from(["finished_first", "random"])),
        require_eos_after_boxed=draw(st.booleans()),
        repetition_substr_len=8,
        repetition_min_count=3,
        max_response_len=draw(st.sampled_from([None, 7, 30])),
    )
    if draw(st.booleans()):
        lo = draw(st.integers(1, width))
        kw.update(init_divergence_min=lo, init_divergence_max=draw(st.integers(lo, width)))
    else:
        kw.update(init_divergence=draw(st.integers(1, width)))
    return TreePOConfig(**kw)


def random_child(rng: np.random.Generator, max_new: int, p_stop: float) -> Segment:
    """A segment of random length whose content may end the path in any way."""
    n = int(rng.integers(1, max_new + 1))
    ids = [int(t) for t in rng.integers(10, 10**6, size=n)]
    r = rng.random()
    if r < p_stop:
        ids[-1], reason = EOS, "eos"
    elif r < 1.5 * p_stop:
        ids = ([BOX, SEVEN, CLOSE] + ids)[:n]  # a box, complete when n >= 3
        reason = "length"
    elif r < 1.8 * p_stop:
        ids, reason = [A] * n, "length"
    else:
        reason = "length"
    return Segment(ids, [float(x) for x in -rng.exponential(size=n)], reason)


@settings(max_examples=80, deadline=None)
@given(
    cfg=configs(),
    seed=st.integers(0, 2**16),
    engine_seed=st.integers(0, 2**16),
    p_stop=st.sampled_from([0.0, 0.1, 0.3, 0.6]),
)
def test_treepo_always_ends_with_exactly_w_finished_trajectories(cfg, seed, engine_seed, p_stop):
    g = TreePOGrower(Tree(prompt_ids=[100], query_id="h"), cfg, eos_token_id=EOS, decode=decode, seed=seed)
    t = g.tree
    seen: set[str] = set()
    asked_from: list[int] = []
    for _ in range(500):
        if g.done():
            break
        asks = g.asks()
        assert asks
        for a in asks:
            assert a.request_id not in seen  # no ask is returned twice
            seen.add(a.request_id)
            # Branch points sit on segment boundaries: the end of an existing node that may still continue.
            assert 0 <= a.node < len(t) and t.finish[a.node] == "none"
            assert a.n >= 1 and 1 <= a.max_new_tokens <= cfg.segment_len
            asked_from.append(a.node)
        answers = [
            (a.request_id, [random_child(np.random.default_rng([engine_seed, a.seed, j]), a.max_new_tokens, p_stop)
                            for j in range(a.n)])
            for a in asks
        ]
        order = np.random.default_rng(engine_seed).permutation(len(answers))  # any arrival order
        for i in order:
            g.receive(*answers[i])
    assert g.done() and g.asks() == []
    assert len(t.trajectories) == cfg.width and len(set(t.trajectories)) == cfg.width
    assert all(t.finish[n] != "none" and not t.children(n) for n in t.trajectories)
    # Every node continues an asked-from node; no node is deeper or longer than the limits.
    assert set(t.parent[1:]) <= set(asked_from)
    assert max(t.depth) <= cfg.max_depth
    assert all(len(t.response_ids(n)) <= cfg.response_limit() for n in range(len(t)))
    # Nodes left unfinished have children; the finished ones are leaves.
    assert all(t.children(n) for n in range(1, len(t)) if t.finish[n] == "none")
    st_ = g.stats()
    assert st_["trajectories"] == cfg.width == len(t.trajectories)
    finished = sum(st_[f"finish/{r}"] for r in ("eos", "boxed", "repetition", "max_length", "max_depth"))
    assert finished == cfg.width  # no path is grown past the width only to be dropped
    assert Tree.from_json(t.to_json()) == t
