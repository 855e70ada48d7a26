"""A training set with bad rows, through the training job's own loader (config -> runtime.train.load_task -> data
layer): a clear error naming the row and field by default, the good rows only with data.prompt.skip_bad_rows."""

import json

import pytest

from treepo_ray.engines.tiny import build_tokenizer
from treepo_ray.runtime.config import DEFAULT_CONFIG, load_config
from treepo_ray.runtime.train import load_task

ROWS = [
    {"problem": "1 + 1", "answer": "2"},
    "{not json",
    {"problem": "2 + 2"},  # no answer
    {"problem": "", "answer": "0"},  # empty prompt
    {"problem": "3 + 3", "answer": {"value": 6}},  # ground truth of the wrong type
    {"problem": "4 + 4", "answer": 8},
]


@pytest.fixture
def bad_set(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in ROWS) + "\n")
    test.write_text(json.dumps({"problem": "5 + 5", "answer": "10"}) + "\n")
    return tmp_path


def test_bad_rows_are_named_by_default(bad_set):
    cfg = load_config(DEFAULT_CONFIG, [f"data.name={bad_set}"])
    with pytest.raises(ValueError, match=r"train.jsonl: row 1: not valid JSON"):
        load_task(cfg, build_tokenizer())


def test_bad_rows_are_skipped_when_asked(bad_set, capsys):
    cfg = load_config(DEFAULT_CONFIG, [f"data.name={bad_set}", "data.prompt.skip_bad_rows=true"])
    train, test = load_task(cfg, build_tokenizer())
    assert "train split: 4 bad rows skipped" in capsys.readouterr().err  # counted out loud, not silently
    assert [r.ground_truth for r in train] == ["2", "8"]
    assert [r.prompt_text for r in train] == ["1 + 1", "4 + 4"]
    assert [r.ground_truth for r in test] == ["10"]
