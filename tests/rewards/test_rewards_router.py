"""default_compute_score picks the scorer by data_source as verl's does: gsm8k `####`, boxed math, the synthetic
task."""

import pytest

from treepo_ray.rewards import BatchScorer, check_row, default_compute_score
from treepo_ray.rewards.gsm8k import extract_answer
from treepo_ray.rewards.synthetic import DATA_SOURCE


def test_gsm8k_is_strict_like_verls():
    assert extract_answer("so she has 8 + 64 = 72 eggs.\n#### 72") == "72"
    assert extract_answer("#### 1,234 dollars") == "1234"
    assert extract_answer("#### -5 then #### 6") == "6"  # the last one counts
    assert extract_answer("####72") is None  # `#### ` with its space, as verl's strict method
    assert extract_answer("#### 72" + "x" * 400) is None  # only the last 300 characters are searched
    assert default_compute_score("openai/gsm8k", "... #### 72", "72")["score"] == 1.0
    assert default_compute_score("openai/gsm8k", "... #### 72.0", "72")["score"] == 0.0  # exact string
    assert default_compute_score("openai/gsm8k", r"\boxed{72}", "72")["score"] == 0.0  # gsm8k answers use ####


@pytest.mark.parametrize("source", ["lighteval/MATH", "HuggingFaceH4/MATH-500", "math_dapo", "aime2024", "math"])
def test_boxed_math_sources(source):
    assert default_compute_score(source, r"so $\boxed{\frac{1}{2}}$", "0.5") == {"score": 1.0, "acc": 1.0,
                                                                                  "pred": r"\frac{1}{2}"}
    assert default_compute_score(source, r"\boxed{3}", "4", extra_info={"index": 3})["score"] == 0.0


def test_synthetic_source_and_list_ground_truths():
    assert default_compute_score(DATA_SOURCE, r"\boxed{843}", "843")["score"] == 1.0
    assert default_compute_score("openai/gsm8k", "#### 9", ["8", "9"])["score"] == 1.0  # any acceptable answer
    assert default_compute_score("math", r"\boxed{2}", ["1", r"\frac{4}{2}"])["score"] == 1.0
    assert default_compute_score("math", r"\boxed{3}", ["1", "2"])["score"] == 0.0


def test_unknown_sources_and_dict_ground_truths_are_clear_errors():
    with pytest.raises(ValueError, match="'my/task' has no built-in scorer.*custom_reward_function.path"):
        default_compute_score("my/task", r"\boxed{1}", "1")
    with pytest.raises(ValueError, match="dict needs custom_reward_function"):
        check_row("math", {"answer": "1"})
    check_row("aime_2025", ["1", 2])


def test_batch_scorer_routes_each_item_and_takes_extra_info():
    items = [("openai/gsm8k", "#### 72", "72", {"index": 0}), ("lighteval/MATH", r"\boxed{0.5}", r"\frac12", {}),
             (DATA_SOURCE, r"\boxed{7}", "7"), ("openai/gsm8k", "#### 71", "72"), ("math", "no box", ["1", "2"])]
    with BatchScorer(timeout_s=3.0) as scorer:
        assert scorer.score_batch(items) == [1.0, 1.0, 1.0, 0.0, 0.0]
        with pytest.raises(ValueError, match="no built-in scorer"):
            scorer.score_batch([("nope", "x", "1")])
