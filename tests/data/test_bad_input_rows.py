"""A training set with bad rows, through the training job's own set-up (job.config.load_config ->
runtime.train.set_up -> data layer): a clear error naming the row and field by default, the good rows only with
data.prompt.skip_bad_rows."""

import json

import pytest

from treepo_ray.data.prompts import Prompt
from treepo_ray.engines.tiny import build_tokenizer
from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.runtime.cluster import set_up

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
    """The data files, and a model directory holding only the tiny tokenizer and a config.json (all set_up reads of
    the model before Ray: the context length)."""
    data, model = tmp_path / "data", tmp_path / "model"
    data.mkdir()
    (data / "train.jsonl").write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in ROWS) + "\n")
    (data / "test.jsonl").write_text(json.dumps({"problem": "5 + 5", "answer": "10"}) + "\n")
    build_tokenizer().save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 1024}))
    return [f"data.name={data}", f"model.path={model}"]


def test_bad_rows_are_named_by_default(bad_set):
    cfg = load_config(DEFAULT_CONFIG, bad_set)
    with pytest.raises(ValueError, match=r"train.jsonl: row 1: not valid JSON"):
        set_up(cfg)  # fails while reading the data, before Ray is started


@pytest.mark.slow
def test_bad_rows_are_skipped_when_asked(bad_set, capsys, ray_local):
    job = set_up(load_config(DEFAULT_CONFIG, [*bad_set, "data.prompt.skip_bad_rows=true"]))
    assert "train split: 4 bad rows skipped" in capsys.readouterr().err  # counted out loud, not silently
    assert all(isinstance(p, Prompt) for p in job.train_set + job.test_set)
    assert [p.ground_truth for p in job.train_set] == ["2", "8"]
    assert [p.prompt_text for p in job.train_set] == ["1 + 1", "4 + 4"]
    assert [p.ground_truth for p in job.test_set] == ["10"]
