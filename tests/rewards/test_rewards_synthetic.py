"""The synthetic task's exact verifier, and the router that sends its data_source there (and the rest to math)."""

import pytest

from treepo_ray.rewards import BatchScorer, MathVerifyConfig, score
from treepo_ray.rewards.synthetic import DATA_SOURCE, verify
from treepo_ray.rewards.synthetic import score as score_synthetic


def test_verifier_is_exact():
    assert verify("...\\boxed{843}", "843")
    assert verify("\\boxed{ 843 }", " 843")
    assert not verify("\\boxed{0843}", "843")
    assert not verify("\\boxed{843.0}", "843")
    assert not verify("843", "843")  # no box
    assert verify("\\boxed{1} then \\boxed{843}", "843")  # the last box counts


def test_score_has_the_math_verifiers_layout():
    assert score_synthetic("7+6+0=13\n\\boxed{13}", 13) == {"score": 1.0, "acc": 1.0, "pred": "13"}
    assert score_synthetic("\\boxed{ 12 }", "13") == {"score": 0.0, "acc": 0.0, "pred": "12"}
    assert score_synthetic("no answer", "13") == {"score": 0.0, "acc": 0.0, "pred": ""}


def test_router_judges_the_synthetic_source_exactly_and_the_rest_by_math():
    assert score(DATA_SOURCE, r"\boxed{42}", "42")["score"] == 1.0
    assert score(DATA_SOURCE, r"\boxed{42.0}", "42")["score"] == 0.0
    # one scale for both verifiers: the exact one is rescaled to correct_score / wrong_score
    assert score(DATA_SOURCE, r"\boxed{41}", "42", MathVerifyConfig(wrong_score=-1.0))["score"] == -1.0
    with BatchScorer(timeout_s=3.0) as scorer:
        assert scorer.score_batch(
            [(DATA_SOURCE, r"\boxed{42.0}", "42"), ("math", r"\boxed{42.0}", "42"), ("math", r"\boxed{7}", "42")]
        ) == [0.0, 1.0, 0.0]
        with pytest.raises(ValueError, match="item 0"):
            scorer.score_details([(DATA_SOURCE, r"\boxed{1}")])
