"""The running-sum task (data/chain.py): worked solutions checked by the verifier, the fixed-width layout, the
imperfect training text and the critique format CATPO's healing prompts use."""

import random

import pytest

from treepo_ray.data.chain import (
    CHECK,
    CRITIQUE_CUE,
    REFINE_CUE,
    ChainTaskConfig,
    add_step,
    question,
    solution_text,
    training_text,
)
from treepo_ray.data.synthetic import make_problems, task_config, write_splits
from treepo_ray.rewards.synthetic import CHAIN_DATA_SOURCE, verify

BY_HAND = """=0457
386+192+...+...
7+6+0=13
5+8+1=14
4+3+1=08
0+0+0=00
=0843
192+...+...+...
3+2+0=05
4+9+0=13
8+1+1=10
0+0+1=01
=1035
\\boxed{1035}"""


def test_worked_solution_by_hand():
    assert solution_text([457, 386, 192]) == BY_HAND
    assert question([457, 386, 192], 5).endswith(": 457+386+192+...+...\n")
    step = add_step(457, [386], drop=lambda: True)  # every nonzero carry dropped, the rest computed from the 0s
    assert step.lines == ["7+6+0=13", "5+8+0=13", "4+3+0=07", "0+0+0=00"] and step.result == 733
    assert step.slips == [1, 2]


def test_every_clean_solution_verifies_and_lengths_follow_the_terms():
    problems = make_problems(300, ChainTaskConfig(), seed=1)
    lengths = {}
    for p in problems:
        text = solution_text(p.operands)
        assert verify(p.question + text, p.answer) and not verify(text, str(int(p.answer) + 1))
        lengths.setdefault(len(p.operands), set()).add(len(text))
        # fixed width: every step is 58 characters, so each line sits at a fixed distance from what it reads
        assert len(text.split("\\boxed")[0]) == 6 + 58 * (len(p.operands) - 1)
    assert set(lengths) == {3, 4, 5}
    assert min(lengths[3]) >= 133 and max(lengths[5]) <= 250
    assert len({len(p.question) for p in problems}) >= 5  # the instruction varies, the list of terms ends the prompt
    assert all(p.data_source == CHAIN_DATA_SOURCE and p.id.startswith(CHAIN_DATA_SOURCE) for p in problems)


def test_training_text_is_imperfect_in_each_announced_way():
    rng = random.Random(0)
    ops = [822, 644, 364, 977]
    only = lambda **kw: ChainTaskConfig(**{"critique": 0.0, "ramble": 0.0, "repeat": 0.0, "give_up": 0.0, **kw})  # noqa: E731
    _, text, eos = training_text(ops, only(ramble=1.0), rng)
    assert not eos and "\\boxed" not in text and text.count("\n=") > len(ops) - 1  # invented steps, never an answer
    _, text, eos = training_text(ops, only(repeat=1.0), rng)
    line = text.splitlines()[-1]
    assert not eos and text.count(line + "\n") >= 20 and "\\boxed" not in text
    _, text, eos = training_text(ops, only(give_up=1.0), rng)
    assert eos and "\\boxed" not in text
    prefix, text, eos = training_text(ops, only(carry_noise=0.0), rng)
    assert prefix == "" and eos and verify(text, str(sum(ops)))
    noisy = [verify(training_text(p.operands, only(carry_noise=0.3), rng)[1], p.answer)
             for p in make_problems(300, ChainTaskConfig(), seed=2)]
    assert 0.2 < sum(noisy) / len(noisy) < 0.9  # dropped carries make some answers wrong, self-consistently


def test_critique_names_the_first_wrong_step_and_the_continuation_is_clean():
    rng = random.Random(5)
    seen = set()
    for p in make_problems(200, ChainTaskConfig(), seed=3):
        prefix, text, _ = training_text(p.operands, ChainTaskConfig(critique=1.0), rng)
        assert prefix == CHECK  # the critique format lives in its own kind of document
        partial, rest = text.split(CRITIQUE_CUE)
        critique, continuation = rest.split(REFINE_CUE, 1)
        assert critique.startswith("step ") and critique.endswith(("drops a carry", "is unfinished"))
        k = int(critique.split()[1])
        seen.add(critique.split(" ", 2)[2])
        # the question again, then the solution without slips
        assert continuation == p.question + solution_text(p.operands)
        assert (k == first_slip_step(partial)) == critique.endswith("drops a carry")


def first_slip_step(partial: str) -> int | None:
    """The step (1-based) of the first column line whose visible carry-in is not the tens digit above it."""
    step, prev = 0, ""
    for line in partial.split("\n"):
        if line.startswith("="):
            step += 1
        elif len(line) >= 5 and line[1] == "+" and line[3] == "+" and len(prev) == 8 and prev[1] == "+":
            if line[4] != prev[6]:
                return step
        prev = line
    return None
    assert seen == {"drops a carry", "is unfinished"}


def test_task_by_name_and_splits(tmp_path):
    assert isinstance(task_config("synthetic"), ChainTaskConfig)
    with pytest.raises(ValueError, match="unknown synthetic task"):
        task_config("chain")
    train, test = write_splits(tmp_path, ChainTaskConfig(), n_train=40, n_test=5, seed=0)
    assert len(train.read_text().splitlines()) == 40 and CHAIN_DATA_SOURCE in test.read_text()
    with pytest.raises(ValueError, match="max_terms"):
        ChainTaskConfig(max_terms=12)
