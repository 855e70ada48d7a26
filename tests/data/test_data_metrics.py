"""Evaluation metrics against hand-computed values."""

import pytest

from treepo_ray.data.metrics import major_at_k, majority_correct, mean_accuracy, pass_at_k, summarize, vote_keys


def test_pass_at_k_by_hand():
    # 1 - C(n-c, k) / C(n, k)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1)
    assert pass_at_k(16, 4, 8) == pytest.approx(1 - 495 / 12870)  # C(12,8)=495, C(16,8)=12870
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k wrong samples: every set of k holds a right one
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def test_mean_accuracy_is_avg_at_k():
    assert mean_accuracy([1, 0, 0, 1, 1, 0, 0, 0]) == 3 / 8
    with pytest.raises(ValueError):
        mean_accuracy([])


def test_major_at_k_hand_case():
    preds, correct = ["5", "5", "7", "7", "7"], [1, 1, 0, 0, 0]
    assert major_at_k(preds, correct, 5) == 0.0  # 7 wins 3:2
    # k=3: of the C(5,3)=10 sets, the 3 holding both 5s vote 5; all others vote 7
    assert major_at_k(preds, correct, 3, resamples=4000, seed=1) == pytest.approx(0.3, abs=0.03)
    assert major_at_k(preds, correct, 1, resamples=4000, seed=2) == pytest.approx(0.4, abs=0.03)


def test_votes_group_equivalent_answers_and_split_ties():
    # the two correct answers are written differently but vote together; 2:2 tie with the wrong "3" -> 1/2
    assert majority_correct(vote_keys(["1/2", "0.5", "3", " 3 "], [1, 1, 0, 0])) == 0.5
    assert majority_correct(vote_keys(["1/2", "0.5", "3", "4"], [1, 1, 0, 0])) == 1.0
    # samples without an answer do not vote: one right answer against two empty ones wins
    assert majority_correct(vote_keys(["", "", "9"], [0, 0, 1])) == 1.0
    assert majority_correct(vote_keys(["", ""], [0, 0])) == 0.0
    # a three-way tie with one right answer
    assert majority_correct(vote_keys(["1", "2", "3"], [0, 1, 0])) == pytest.approx(1 / 3)


def test_summarize_per_source_and_weighted_overall():
    problems = [
        {"data_source": "a", "preds": ["1", "1"], "correct": [1, 1]},
        {"data_source": "b", "preds": ["2", "3"], "correct": [0, 1]},
        {"data_source": "b", "preds": ["2", "2"], "correct": [0, 0]},
        {"data_source": "b", "preds": ["2", "2"], "correct": [0, 0]},
    ]
    out = summarize(problems, ks=[2, 4])
    assert out["a/pass@1"] == 1.0 and out["a/problems"] == 1
    assert out["b/pass@1"] == pytest.approx(0.5 / 3)
    assert out["b/pass@2"] == pytest.approx(1 / 3)
    assert out["b/major@2"] == pytest.approx(0.5 / 3)  # the 1:1 tie of problem 2 counts 1/2
    # overall = mean over the 4 problems, not the mean of the two sources
    assert out["overall/pass@1"] == pytest.approx((1 + 0.5) / 4)
    assert out["overall/major@2"] == pytest.approx((1 + 0.5) / 4)
    assert "overall/pass@4" not in out  # k > n is left out
    with pytest.raises(ValueError):
        summarize([])
