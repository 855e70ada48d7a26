import math

import pytest

from treepo_ray.engines.base import SegmentResult
from treepo_ray.tree import Segment
from treepo_ray.engines.tiny import build_tokenizer
from treepo_ray.algo.catpo import HealingConfig
from treepo_ray.healing.critique import CritiqueHealer, find_failure_node, load_prompts
from treepo_ray.tree.tree import Tree


def tree_with_rewards(parent, rewards):
    """parent[i] for nodes 1..; rewards for every leaf, in node order."""
    t = Tree(prompt_ids=[5, 6], query_id="q")
    for p in parent:
        t.add_node(p, [10], [-1.0])
    t.trajectories = t.leaves()
    t.set_trajectory_rewards(rewards)
    return t


def test_failure_node_is_root_when_every_branch_fails():
    t = tree_with_rewards([0, 0, 1, 1, 2, 2], [0, 0, 0, 0])
    assert find_failure_node(t) == 0


def test_failure_node_is_the_shallowest_all_failing_parent():
    #      0
    #    1     2          node 1 holds the only success; node 2's children 5, 6 both fail
    #  3   4  5  6
    t = tree_with_rewards([0, 0, 1, 1, 2, 2], [1, 0, 0, 0])
    assert t.reward[1] == 0.5 and t.reward[2] == 0.0
    assert find_failure_node(t) == 2  # the root has a child with reward 0.5 >= epsilon; BFS reaches 1 before 2
    # node 1 has one good child, so it does not qualify even though it is visited first


def test_no_failure_node_when_every_parent_has_a_good_child():
    t = tree_with_rewards([0, 0, 1, 2], [1, 1])
    assert find_failure_node(t) is None


def test_unrewarded_children_are_ignored():
    t = tree_with_rewards([0, 0, 1, 1], [0, 0, 0])  # leaves 2, 3, 4
    t.trajectories = [3, 4]
    t.reward = [math.nan] * len(t)
    t.set_trajectory_rewards([0.0, 0.0])  # node 2 (a leaf, no trajectory) stays NaN
    assert math.isnan(t.reward[2])
    assert find_failure_node(t) == 0  # root's rewarded child 1 has reward 0


class ScriptedGenerator:
    """Test input: returns fixed continuations and records every request it was sent."""

    def __init__(self, tokenizer, critique: str, refinements: list[str]):
        self.tok, self.critique, self.refinements, self.requests = tokenizer, critique, refinements, []

    def __call__(self, requests):
        self.requests.extend(requests)
        out = []
        for r in requests:
            texts = [self.critique] if r.request_id.endswith("critique") else self.refinements[: r.n]
            segs = []
            for text in texts:
                ids = self.tok.encode(text, add_special_tokens=False)
                segs.append(Segment(ids, [-0.5] * len(ids), "length"))
            out.append(SegmentResult(r.request_id, segs))
        return out


def test_heal_grafts_scores_and_repropagates():
    tok = build_tokenizer()
    t = Tree(prompt_ids=tok.encode("Q: 1+1\n", add_special_tokens=False), query_id="q")
    for text in ["1+1=3\n", "1+1=4\n"]:
        t.add_node(0, tok.encode(text, add_special_tokens=False), [-1.0] * len(text))
    t.trajectories = [1, 2]
    t.set_trajectory_rewards([0.0, 0.0])
    gen = ScriptedGenerator(tok, "the sum is wrong", ["\\boxed{2}", "\\boxed{5}", "\\boxed{2}", "x" * 50])
    calls = []

    def logprob_fn(prefix, ids):
        calls.append((list(prefix), list(ids)))
        return [-0.25] * len(ids)

    def score(tree, node):
        return 1.0 if tok.decode(tree.response_ids(node)).endswith("\\boxed{2}") else 0.0

    healer = CritiqueHealer(tok, gen, logprob_fn, score, HealingConfig(num_refinements=4, step_len=20))
    res = healer.heal(t, seed=3)

    assert res.failure_node == 0 and res.critique == "the sum is wrong"
    assert res.grafted == [3, 4, 5, 6] and t.trajectories == [1, 2, 3, 4, 5, 6]
    assert [t.parent[n] for n in res.grafted] == [0, 0, 0, 0]
    assert len(t.tokens[6]) == 20  # truncated to the step length
    assert [t.reward[n] for n in res.grafted] == res.rewards == [1.0, 0.0, 1.0, 0.0]
    assert t.reward[0] == pytest.approx(2 / 6)  # re-propagated over all six children
    # grafted log-probs are those given the ORIGINAL prefix, not the critique prompt
    assert all(prefix == t.prompt_ids for prefix, _ in calls) and t.logprobs[3] == [-0.25] * len(t.tokens[3])
    # the critique request: low temperature, its cap; the refine request: k children at 0.6, prompt holds the critique
    crit, refine = gen.requests
    assert (crit.n, crit.params.temperature, crit.max_new_tokens) == (1, 0.3, 256)
    assert (refine.n, refine.params.temperature, refine.max_new_tokens) == (4, 0.6, 20)
    assert "the sum is wrong" in tok.decode(refine.prefix_ids)
    assert res.generated_tokens == len("the sum is wrong") + 9 + 9 + 9 + 50


def test_nothing_happens_without_a_failure_node():
    tok = build_tokenizer()
    t = tree_with_rewards([0, 0], [1, 0])
    gen = ScriptedGenerator(tok, "c", ["r"])
    res = CritiqueHealer(tok, gen, lambda p, i: [0.0] * len(i), lambda tr, n: 1.0, HealingConfig(step_len=8)).heal(t)
    assert res.failure_node is None and res.grafted == [] and gen.requests == []


def test_healer_needs_the_step_length():
    tok = build_tokenizer()
    with pytest.raises(ValueError, match="step_len"):
        CritiqueHealer(tok, ScriptedGenerator(tok, "c", ["r"]), lambda p, i: [], lambda tr, n: 0.0, HealingConfig())


def test_prompt_file_must_hold_both_templates(tmp_path):
    sets = load_prompts()
    assert {"critique", "refine"} <= set(sets["default"]) and {"critique", "refine"} <= set(sets["synthetic_chain"])
    single = tmp_path / "one.yaml"
    single.write_text("critique: c\nrefine: r\n")
    assert load_prompts(str(single)) == {"default": {"critique": "c", "refine": "r"}}  # one set serves every source
    bad = tmp_path / "p.yaml"
    bad.write_text("critique: hi\n")
    with pytest.raises(ValueError, match="refine"):
        load_prompts(str(bad))


def test_each_data_source_heals_in_its_own_format():
    # The running-sum task's format, as its pretraining text writes it: "<partial>\n? <critique>\n<question>
    # <corrected solution>"; the critique is cut at its first newline (the model goes on writing after it).
    from treepo_ray.data.chain import CHECK, CRITIQUE_CUE, REFINE_CUE

    tok = build_tokenizer()

    def dead_tree(source):
        t = Tree(prompt_ids=tok.encode("Q: 1+1\n", add_special_tokens=False), query_id="q",
                 meta={"data_source": source})
        t.add_node(0, tok.encode("=0001\n1+", add_special_tokens=False), [-1.0] * 8)
        t.trajectories = [1]
        t.set_trajectory_rewards([0.0])
        return t

    gen = ScriptedGenerator(tok, "step 1 is unfinished\nQ: 1+1\n=0001", ["=0001\n\\boxed{2}"])
    healer = CritiqueHealer(tok, gen, lambda p, i: [-0.1] * len(i), lambda tr, n: 1.0,
                            HealingConfig(num_refinements=1, step_len=32))
    res = healer.heal(dead_tree("synthetic_chain"))
    crit, refine = gen.requests
    assert res.critique == "step 1 is unfinished"
    assert tok.decode(crit.prefix_ids) == CHECK + "Q: 1+1\n" + CRITIQUE_CUE  # the root failed: an empty partial
    assert tok.decode(refine.prefix_ids) == (CHECK + "Q: 1+1\n" + CRITIQUE_CUE + "step 1 is unfinished" + REFINE_CUE
                                             + "Q: 1+1\n")
    healer.heal(dead_tree("math"))
    assert "Critique:" in tok.decode(gen.requests[2].prefix_ids)  # other sources: the default set


def test_tree_informativeness_rises_when_healing_adds_a_correct_branch():
    from treepo_ray.algo import classify_tree, tree_informativeness

    tok = build_tokenizer()
    t = tree_with_rewards([0, 0, 1, 1, 2, 2], [0, 0, 0, 0])
    F, p = tree_informativeness(t)
    assert (F, p) == (0.0, 0.0) and classify_tree(F, p) == "dead_wrong"
    gen = ScriptedGenerator(tok, "c", ["good", "bad"])
    healer = CritiqueHealer(tok, gen, lambda pre, ids: [-0.1] * len(ids),
                            lambda tr, n: 1.0 if tok.decode(tr.tokens[n]) == "good" else 0.0,
                            HealingConfig(num_refinements=2, step_len=8))
    healer.heal(t)
    F2, p2 = tree_informativeness(t)
    assert p2 == pytest.approx(1 / 6) and F2 > 0
