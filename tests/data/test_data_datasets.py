"""Dataset loading: verl and plain layouts, JSONL and Parquet, templates, length limits, bad rows, routing."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treepo_ray.config import UserError
from treepo_ray.data.datasets import DatasetConfig, PromptBudget, load_dataset, load_records
from treepo_ray.data.synthetic import SyntheticTaskConfig, write_splits
from treepo_ray.engines.tiny import build_tokenizer
from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.rewards.synthetic import DATA_SOURCE

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

VERL_ROWS = [
    {
        "data_source": "aime",
        "prompt": [{"role": "user", "content": "What is 1+1?"}],
        "reward_model": {"style": "rule", "ground_truth": "2"},
        "extra_info": {"index": 7},
    },
    {"data_source": "openai/gsm8k", "prompt": "Half of 3?", "reward_model": {"ground_truth": 1.5}},
]
PLAIN_ROWS = [{"problem": "Q: 12+30\n", "answer": "42"}, {"problem": "Q: 1+2\n", "answer": 3, "id": "p2"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def chat_tok():
    t = build_tokenizer()
    t.chat_template = CHAT
    return t


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_verl_layout_jsonl_plain_template(tmp_path, tok):
    recs = load_dataset(write_jsonl(tmp_path / "v.jsonl", VERL_ROWS), tok)
    assert [r.id for r in recs] == ["v/7", "v/1"]  # <file>/<extra_info.index or row number>
    assert recs[0].prompt_text == "What is 1+1?"
    assert recs[0].ground_truth == "2" and recs[1].ground_truth == "1.5"
    assert [r.data_source for r in recs] == ["aime", "openai/gsm8k"]
    assert recs[0].extra_info == {"index": 7} and recs[1].extra_info == {}
    assert list(recs[0].prompt_ids) == tok("What is 1+1?", add_special_tokens=False).input_ids


def test_verl_layout_parquet_chat_template(tmp_path, chat_tok):
    path = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROWS[0], {**VERL_ROWS[0], "extra_info": {"index": 8}}]), path)
    recs = load_dataset(path, chat_tok, DatasetConfig(system_prompt="Box it."))
    assert len(recs) == 2
    assert recs[0].prompt_text == "<|user|>What is 1+1?\n<|assistant|>"
    assert list(recs[0].prompt_ids) == chat_tok(recs[0].prompt_text, add_special_tokens=False).input_ids
    # a text prompt under a chat template becomes a user message, after the configured system prompt
    recs = load_dataset(write_jsonl(tmp_path / "t.jsonl", VERL_ROWS[1:]), chat_tok, DatasetConfig(system_prompt="Box it."))
    assert recs[0].prompt_text == "<|system|>Box it.\n<|user|>Half of 3?\n<|assistant|>"


def test_plain_layout_both_formats(tmp_path, tok):
    j = load_dataset(write_jsonl(tmp_path / "p.jsonl", PLAIN_ROWS), tok, DatasetConfig(default_data_source="arith"),
                     custom_reward=True)  # 'arith' has no built-in scorer
    path = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in PLAIN_ROWS]), path)
    p = load_dataset(path, tok, DatasetConfig(plain_template="Problem: {problem}Answer:"))
    assert [r.prompt_text for r in j] == ["Q: 12+30\n", "Q: 1+2\n"]
    assert [r.ground_truth for r in j] == ["42", "3"] and j[1].id == "p/p2"
    assert j[0].data_source == "arith"
    assert p[0].prompt_text == "Problem: Q: 12+30\nAnswer:"


@pytest.mark.parametrize(
    "row, field",
    [
        ({"prompt": "x"}, "reward_model.ground_truth"),
        ({"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}, "prompt[0]"),
        ({"prompt": 5, "reward_model": {"ground_truth": "1"}}, "prompt"),
        ({"problem": "x", "answer": True}, "answer"),
        ({"problem": "x", "answer": []}, "answer"),
        ({"problem": "x", "answer": "1", "data_source": "my/task"}, "data_source"),  # no built-in scorer
        ({"problem": "", "answer": "1"}, "problem"),
        ({"question": "x"}, "problem"),
    ],
)
def test_bad_row_error_names_file_row_and_field(tmp_path, tok, row, field):
    path = write_jsonl(tmp_path / "bad.jsonl", [PLAIN_ROWS[0], row])
    with pytest.raises(ValueError) as e:
        load_dataset(path, tok)
    assert str(path) in str(e.value) and "row 1" in str(e.value) and repr(field) in str(e.value)


def test_skip_bad_rows_counts(tmp_path, tok):
    path = write_jsonl(tmp_path / "mixed.jsonl", [PLAIN_ROWS[0], "{not json", {"problem": "x"}, PLAIN_ROWS[1], "[1]"])
    with pytest.raises(ValueError, match="row 1: not valid JSON"):
        load_dataset(path, tok)
    ds = load_dataset(path, tok, DatasetConfig(skip_bad_rows=True))
    assert len(ds) == 2 and ds.bad_rows == 3 and len(ds.errors) == 3
    assert "field 'answer' is missing" in ds.errors[1]
    # a repeated id is a bad row too
    dup = write_jsonl(tmp_path / "dup.jsonl", [PLAIN_ROWS[1], PLAIN_ROWS[1]])
    with pytest.raises(ValueError, match="row 1: field 'id' repeats"):
        load_dataset(dup, tok)


def test_prompt_length_filter_truncate_error(tmp_path, tok):
    rows = [{"problem": "a" * 5, "answer": "1"}, {"problem": "b" * 20, "answer": "2"}]
    path = write_jsonl(tmp_path / "len.jsonl", rows)
    ds = load_dataset(path, tok, DatasetConfig(max_prompt_tokens=10))
    assert [r.ground_truth for r in ds] == ["1"] and ds.overlong_rows == 1
    ds = load_dataset(path, tok, DatasetConfig(max_prompt_tokens=10, overlong="truncate_left"))
    assert len(ds[1].prompt_ids) == 10 and ds[1].prompt_text == "b" * 10
    with pytest.raises(ValueError, match="row 1: field 'prompt' has 20 tokens"):
        load_dataset(path, tok, DatasetConfig(max_prompt_tokens=10, overlong="error"))
    with pytest.raises(ValueError, match="overlong"):
        DatasetConfig(overlong="drop")


def test_unknown_file_format(tmp_path, tok):
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown format"):
        load_dataset(tmp_path / "d.csv", tok)
    with pytest.raises(ValueError, match="does not exist"):
        load_dataset(tmp_path / "none.jsonl", tok)


def data_cfg(name, seed=0):
    """The job's data section (data.name, data.seed), loaded as `treepo-ray train` loads it."""
    return load_config(DEFAULT_CONFIG, [f"data.name={name}", f"data.seed={seed}"]).data


def test_synthetic_splits_through_the_same_loader(tmp_path, tok):
    train, test = write_splits(tmp_path / "syn", SyntheticTaskConfig(digits=2), 20, 4, seed=0)
    for name in (str(tmp_path / "syn"), f"{train},{test}"):
        tr, te = load_records(data_cfg(name), tok)
        assert len(tr) == 20 and len(te) == 4
        assert tr[0].data_source == DATA_SOURCE and tr[0].prompt_text.startswith("Q: ")
    tr, te = load_records(data_cfg(str(train)), tok)
    assert len(tr) == 20 and te == []
    with pytest.raises(ValueError, match="data.name"):
        load_records(data_cfg(str(tmp_path / "missing")), tok)


def test_synthetic_default_files_are_cached(tmp_path, tok):
    tr, te = load_records(data_cfg("synthetic", seed=3), tok, cache_dir=tmp_path, synthetic_rows=(300, 30))
    (folder,) = [p for p in tmp_path.iterdir()]
    before = (folder / "train.jsonl").stat().st_mtime_ns
    tr2, te2 = load_records(data_cfg("synthetic", seed=3), tok, cache_dir=tmp_path, synthetic_rows=(300, 30))
    assert (folder / "train.jsonl").stat().st_mtime_ns == before
    assert tr2 == tr and te2 == te and (len(tr), len(te)) == (300, 30)
    assert not {r.id for r in tr} & {r.id for r in te}


def verl_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def verl_row(question, truth, source, index, prompt_key="prompt"):
    return {"data_source": source, prompt_key: [{"role": "user", "content": question}],
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": index, "split": "train"}}


def test_train_files_lists_keep_ids_unique_across_files(tmp_path, tok, monkeypatch):
    """verl's extra_info.index restarts in every file: two files with indexes 0, 1 load as four distinct prompts."""
    a = verl_parquet(tmp_path / "gsm8k.parquet", [verl_row("2+2?", "4", "openai/gsm8k", i) for i in range(2)])
    b = verl_parquet(tmp_path / "math.parquet", [verl_row("1/2?", r"\frac12", "lighteval/MATH", i) for i in range(2)])
    (tmp_path / "sub").mkdir()
    c = write_jsonl(tmp_path / "sub" / "math.jsonl", [{"problem": "3?", "answer": "3", "id": "0"}])
    cfg = load_config(DEFAULT_CONFIG, [f"data.train_files=[{a},{b},{c}]", f"data.val_files={b}"]).data
    train, test = load_records(cfg, tok)
    assert [p.id for p in train] == ["gsm8k/0", "gsm8k/1", "math/0", "math/1", "math~2/0"]
    assert [p.data_source for p in train] == ["openai/gsm8k"] * 2 + ["lighteval/MATH"] * 2 + ["math"]
    assert [p.id for p in test] == ["math/0", "math/1"] and test[0].extra_info == {"index": 0, "split": "train"}
    # one path, with ~ expanded (verl's default is ~/data/...)
    home = tmp_path / "home"
    home.mkdir()
    verl_parquet(home / "g.parquet", [verl_row("2+2?", "4", "openai/gsm8k", 0)])
    monkeypatch.setenv("HOME", str(home))
    train, test = load_records(load_config(DEFAULT_CONFIG, ["data.train_files=~/g.parquet"]).data, tok)
    assert [p.id for p in train] == ["g/0"] and test == []


def test_prompt_key_reward_fn_key_and_structured_ground_truths(tmp_path, tok):
    rows = [{**verl_row("q1", ["7", "seven"], "x", 0, prompt_key="question"), "task": "math"},
            {**verl_row("q2", {"cases": [1, 2]}, "x", 1, prompt_key="question"), "task": "my/task"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)  # parquet wants one type per column: jsonl mixes them
    cfg = ["data.prompt_key=question", "data.reward_fn_key=task", f"data.train_files={path}"]
    data = load_config(DEFAULT_CONFIG, cfg).data
    with pytest.raises(UserError, match=r"row 1: field 'task': data_source 'my/task' has no built-in scorer"):
        load_records(data, tok)  # an unknown source without a custom reward function: named when the data loads
    train, _ = load_records(data, tok, custom_reward=True)
    assert [p.prompt_text for p in train] == ["q1", "q2"]
    assert [p.data_source for p in train] == ["math", "my/task"]
    assert train[0].ground_truth == ["7", "seven"] and train[1].ground_truth == {"cases": [1, 2]}
    with pytest.raises(UserError, match="row 0: field 'prompt' is missing"):
        load_records(load_config(DEFAULT_CONFIG, [f"data.train_files={path}"]).data, tok)  # 'prompt' is absent


def test_prompt_length_against_the_models_context(tmp_path, tok):
    rows = [{"problem": "a" * 5, "answer": "1"}, {"problem": "b" * 20, "answer": "2"}]
    path = write_jsonl(tmp_path / "len.jsonl", rows)
    budget = PromptBudget(context_tokens=40, response_tokens=30)  # room for 10 prompt tokens
    ds = load_dataset(path, tok, DatasetConfig(overlong="filter"), budget=budget)
    assert [r.ground_truth for r in ds] == ["1"] and ds.overlong_rows == 1
    for overlong in ("error", "keep"):  # 'keep' lifts max_prompt_tokens, not the model's context
        with pytest.raises(UserError, match=r"row 1: field 'prompt' has 20 tokens > 10, what the model's context "
                                            r"of 40 tokens leaves after the 30-token response budget"):
            load_dataset(path, tok, DatasetConfig(overlong=overlong), budget=budget)
    with pytest.raises(UserError, match="leaves no room"):
        load_dataset(path, tok, budget=PromptBudget(context_tokens=30, response_tokens=30))


def test_data_section_errors():
    with pytest.raises(UserError, match="both set"):
        load_config(DEFAULT_CONFIG, ["data.name=/x", "data.train_files=a.parquet"])
    with pytest.raises(UserError, match="without data.train_files"):
        load_config(DEFAULT_CONFIG, ["data.val_files=a.parquet"])
