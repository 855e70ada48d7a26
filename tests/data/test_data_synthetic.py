"""The synthetic addition task: worked solutions (checked by the task's verifier), noise, splits, difficulty."""

import json
import random

import pytest

from treepo_ray.data.synthetic import (
    Problem,
    SyntheticTaskConfig,
    is_test_problem,
    make_problems,
    worked_solution,
    write_splits,
)
from treepo_ray.rewards.synthetic import DATA_SOURCE, verify


def test_worked_solution_by_hand():
    p = Problem("x", [457, 386])
    assert p.question == "Q: 457+386\n"
    assert p.answer == "843"
    assert worked_solution(p) == "7+6+0=13\n5+8+1=14\n4+3+1=08\n\\boxed{843}"
    # a final carry becomes the leading digit
    assert worked_solution(Problem("y", [95, 17])) == "5+7+0=12\n9+1+1=11\n\\boxed{112}"
    # three operands
    assert worked_solution(Problem("z", [99, 99, 99])) == "9+9+9+0=27\n9+9+9+2=29\n\\boxed{297}"


def test_round_trip_every_clean_solution_verifies():
    for cfg in (SyntheticTaskConfig(digits=1), SyntheticTaskConfig(digits=3), SyntheticTaskConfig(digits=6, terms=4)):
        for p in make_problems(200 if cfg.digits > 1 else 40, cfg, seed=3):
            text = p.question + worked_solution(p)
            assert verify(text, p.answer), text
            assert not verify(text, str(int(p.answer) + 1))


def test_noise_drops_carries_and_stays_self_consistent():
    rng = random.Random(0)
    p = Problem("x", [457, 386])
    # noise 1: every nonzero carry is dropped, and the next column uses the written 0
    assert worked_solution(p, 1.0, rng) == "7+6+0=13\n5+8+0=13\n4+3+0=07\n\\boxed{733}"
    problems = make_problems(400, SyntheticTaskConfig(), seed=0)
    wrong = sum(not verify(worked_solution(p, 0.3, rng), p.answer) for p in problems)
    carrying = sum(any(int(a) + int(b) >= 9 for a, b in zip(str(p.operands[0]), str(p.operands[1]))) for p in problems)
    assert 0 < wrong < carrying  # only problems with a carry can go wrong, and not all of them do
    with pytest.raises(ValueError, match="rng"):
        worked_solution(p, 0.5)


def test_splits_are_disjoint_deterministic_and_distinct():
    cfg = SyntheticTaskConfig(digits=3)
    train = make_problems(2000, cfg, seed=7, split="train")
    test = make_problems(200, cfg, seed=7, split="test")
    assert not {p.question for p in train} & {p.question for p in test}
    assert all(is_test_problem(p.question) for p in test)
    assert len({p.question for p in train}) == 2000
    assert [p.operands for p in make_problems(50, cfg, seed=7)] == [p.operands for p in train[:50]]
    assert [p.operands for p in make_problems(50, cfg, seed=8)] != [p.operands for p in train[:50]]


def test_difficulty_knob():
    for digits in (1, 2, 5):
        for p in make_problems(30, SyntheticTaskConfig(digits=digits, terms=3), seed=0):
            assert all(len(str(x)) == digits for x in p.operands) and len(p.operands) == 3
            assert worked_solution(p).count("\n") == digits  # one line per column, then the box
    with pytest.raises(ValueError, match="digits"):
        make_problems(1, SyntheticTaskConfig(digits=0), seed=0)
    with pytest.raises(ValueError, match="terms"):
        make_problems(1, SyntheticTaskConfig(terms=12), seed=0)
    with pytest.raises(ValueError, match="distinct"):  # one-digit pairs: only 81 problems exist
        make_problems(100, SyntheticTaskConfig(digits=1), seed=0)


def test_write_splits_plain_layout(tmp_path):
    train, test = write_splits(tmp_path, SyntheticTaskConfig(digits=2), n_train=30, n_test=5, seed=1)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 30 and len(test.read_text().splitlines()) == 5
    assert set(rows[0]) == {"id", "problem", "answer", "data_source"}
    assert rows[0]["data_source"] == DATA_SOURCE
    a, b = rows[0]["problem"][3:-1].split("+")
    assert int(a) + int(b) == int(rows[0]["answer"])
