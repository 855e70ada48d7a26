"""The answer forms math-verify misjudges (rewards/forms.py), both ways, and the labelled set as a whole."""

from pathlib import Path

import pytest

from treepo_ray.benchmarks.verifier import load_pairs, per_category
from treepo_ray.rewards import BatchScorer, default_compute_score
from treepo_ray.rewards.forms import equal, options_of, prepare
from treepo_ray.rewards.math import MathVerifier, MathVerifyConfig

PAIRS = Path(__file__).with_name("answer_pairs.jsonl")
OPTIONS = {"A": "6", "B": "8", "C": r"\frac{1}{2}", "D": "12", "E": "14"}


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(MathVerifyConfig(timeout_s=5.0, num_workers=2)) as v:
        yield v


@pytest.mark.parametrize("pred, gold, verdict", [
    ("30°", "30", True), ("30 degrees", r"30^{\circ}", True), (r"\angle B = 40^\circ", "40", True),
    (r"\varnothing", r"\emptyset", True), (r"\{ \}", r"\O", True), (r"\{0\}", r"\emptyset", False),
    (r"x \neq 5", "5", False), (r"5 \text{ is impossible}", "5", False), (r"x \neq 5", r"x \ne 5", None),
    (r"\frac{3}{2} < t", r"\frac32", False), ("x > 2", r"(2,\infty)", None),
    ("(1,2)", r"\{1,2\}", False), (r"\{3,5\}", "(3, 5)", False), (r"\{x : x > 2\}", r"(2, \infty)", None),
])
def test_string_rules(pred, gold, verdict):
    assert prepare(pred, gold).verdict is verdict


@pytest.mark.parametrize("pred, verdict", [
    ("B", True), ("(B)", True), (r"\textbf{(B) } 8", True), (r"\textbf{(B)}~8", True), ("B) 8", True), ("b", True),
    ("8", True),
    ("C", False), ("6", False), ("(B) 10", None), (r"\text{(D)}", False),
])
def test_multiple_choice_letter_against_options(pred, verdict):
    assert prepare(pred, "B", OPTIONS).verdict is verdict  # None: the option's text against the symbolic comparison


def test_multiple_choice_option_text_in_another_form_goes_to_the_symbolic_comparison():
    got = prepare("0.5", "C", OPTIONS)
    assert got.verdict is None and (got.pred, got.gold) == ("0.5", r"\frac{1}{2}")
    assert prepare("8", "B").verdict is False  # no options: a bare value cannot be matched to the letter


def test_options_from_a_list_or_a_dict():
    assert options_of({"options": ["A) 6", "B) 8"]}) == {"A": "6", "B": "8"}
    assert options_of({"options": ["6", "(B) 8"]}) == {"A": "6", "B": "8"}
    assert options_of({"options": {"(a)": 6}}) == {"A": "6"}
    assert options_of({"index": 3}) == {} and options_of(None) == {}


@pytest.mark.parametrize("pred, gold", [
    (r"\text{three}", "3"), (r"0.\overline{4}", r"\frac{4}{9}"), (r"-1.1\overline{6}", r"-\frac{7}{6}"),
    (r"\text{all real numbers}", r"(-\infty, \infty)"), (r"\text{the function is odd}", r"\text{odd}"),
    (r"\text{The minimum value is } 10", "10"), (r"\text{Answer: } 7", "7"), (r"\text{No solution}", r"\emptyset"),
    (r"\text{No, it is not possible}", r"\text{No}"), (r"\text{There are 2 solutions.}", "2"), (r"\$875.", "875"),
    (r"\Pr(\text{red}) = \dfrac{2}{3}", r"\dfrac{2}{3}"),
])
def test_words_repeating_decimals_and_lead_ins_are_the_answer_they_state(pred, gold, verifier):
    assert verifier.score(rf"\boxed{{{pred}}}", gold)["acc"] == 1.0


@pytest.mark.parametrize("pred, gold", [
    (r"\text{four}", "3"), (r"0.\overline{4}", r"\frac{4}{10}"), (r"\text{the function is even}", r"\text{odd}"),
    (r"\text{The maximum value is } 10", "12"), (r"\text{there is no solution}", "3"), ("(2, 4)", "2, 4"),
    (r"\text{Yes, it is}", r"\text{No}"), (r"\text{There are 3 solutions.}", "2"), ("f(2) = 8", "9"),
])
def test_near_misses_of_those_forms_stay_wrong(pred, gold, verifier):
    assert verifier.score(rf"\boxed{{{pred}}}", gold)["acc"] == 0.0


def test_vectors_and_articles_are_rewritten_for_the_comparison():
    assert prepare(r"\begin{pmatrix} 1 \\ -2 \end{pmatrix}", "(1,-2)").pred == "(1, -2)"
    assert prepare(r"\begin{bmatrix} 1 & 2 \end{bmatrix}", "(1,2)").pred == "(1, 2)"
    assert prepare(r"\text{a circle}", r"\text{circle}").pred == r"\text{circle}"
    assert prepare(r"5 \text{ or } 7", "5").pred == "5, 7"


@pytest.mark.parametrize("pred, gold, same", [
    ("i^2", "-1", True), ("(1+i)^2", "2i", True), (r"\sqrt{-4}", "2i", True), ("-i", "i", False),
    ("3-4i", "3+4i", False), ("x+i", "x+1", False),
    (r"x \le 2", r"(-\infty, 2]", True), (r"1 \le x < 3", "[1,3)", True), (r"0<x<1", "[0,1]", False),
    (r"x<1, x>2", r"(-\infty,1)\cup(2,\infty)", True), (r"x \le -1, x \ge 1", r"(-\infty,-1)\cup(1,\infty)", False),
    ("2+2=5", "5", False), ("3+2=5", "5", True),
])
def test_symbolic_rules(pred, gold, same):
    assert equal(pred, gold) is same


def test_multiple_choice_rows_through_the_reward_entry_points():
    right, wrong = r"The answer is $\boxed{8}$.", r"The answer is $\boxed{12}$."
    info = {"options": OPTIONS, "index": 0}
    assert default_compute_score("math", right, "B", info)["score"] == 1.0
    assert default_compute_score("math", wrong, "B", info)["score"] == 0.0
    assert default_compute_score("math", right, "B")["score"] == 0.0  # no options: the letter alone counts
    with BatchScorer() as scorer:
        assert scorer.score_batch([("math", right, "B", info), ("math", r"\boxed{0.5}", "C", info),
                                   ("math", wrong, "B", info), ("math", r"\boxed{(B) 10}", "B", info),
                                   ("math", r"\boxed{(B)}", "B")]) == [1.0, 1.0, 0.0, 0.0, 1.0]


@pytest.mark.slow
def test_labelled_pairs_judged_as_a_grader_would(verifier):
    rows = load_pairs(PAIRS)
    assert len(rows) >= 300
    results = verifier.score_batch([r["answer"] for r in rows], [r["gold"] for r in rows],
                                   [options_of(r) or None for r in rows])
    judged = [r["acc"] == 1.0 for r in results]
    wrong = [(r["category"], r["gold"], r["answer"]) for r, j in zip(rows, judged) if j != r["verdict"]]
    assert len(wrong) <= 0.01 * len(rows), wrong
    assert all(c["accuracy"] >= 0.95 for c in per_category(rows, judged).values()), wrong
