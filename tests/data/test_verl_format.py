"""verl's dataset layout: files written by `treepo-ray data` and by verl's own scripts load as verl loads them."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from treepo_ray.cli import main
from treepo_ray.config import UserError
from treepo_ray.data.datasets import DataConfig, read_dataset, read_records
from treepo_ray.data.verl_format import gsm8k_answer, last_boxed


def verl_row(source, question, truth, index):
    return {"data_source": source, "prompt": [{"role": "user", "content": question}], "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"split": "test", "index": index}}


def test_repeated_extra_info_index_loads_with_unique_ids(tmp_path):
    # One validation file of GSM8K and MATH rows, each numbered from 0, as verl's preprocessing writes them when
    # concatenated: verl loads it (the index is metadata), so must this.
    rows = [verl_row("openai/gsm8k", "1+1?", "2", 0), verl_row("openai/gsm8k", "2+2?", "4", 1),
            verl_row("lighteval/MATH", "x?", "3", 0), verl_row("lighteval/MATH", "y?", "\\frac{1}{2}", 1)]
    path = tmp_path / "test.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    loaded = read_dataset(path)
    ids = [rid for _, rid, _ in loaded.rows]
    assert ids == ["test/0", "test/1", "test/0@2", "test/1@3"]
    assert [row.extra_info["index"] for _, _, row in loaded.rows] == [0, 1, 0, 1]  # passed on as it was


def test_a_repeated_id_field_is_still_an_error(tmp_path):
    rows = [{**verl_row("openai/gsm8k", "1+1?", "2", 0), "id": "a"},
            {**verl_row("openai/gsm8k", "2?", "2", 1), "id": "a"}]
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError, match="row 1: field 'id' repeats"):
        read_dataset(path)


def test_gsm8k_command_round_trips_through_the_loader(tmp_path, capsys):
    source = tmp_path / "gsm8k_train.jsonl"
    rows = [{"question": "Tom has 1,200 apples and eats 2. How many?", "answer": "1200 - 2 = 1198\n#### 1,198"},
            {"question": "2+2?", "answer": "2+2=4\n#### 4"}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    test_source = tmp_path / "gsm8k_test.jsonl"
    test_source.write_text(json.dumps({"question": "3+3?", "answer": "#### 6"}) + "\n")
    out = tmp_path / "out"
    assert main(["data", "gsm8k", "--from", str(source), "--from", str(test_source), "--out", str(out)]) == 0
    assert "2 train rows, 1 test rows" in capsys.readouterr().out
    written = pq.read_table(out / "train.parquet").to_pylist()[0]
    assert written["reward_model"] == {"style": "rule", "ground_truth": "1198"}
    assert written["extra_info"] == {"split": "train", "index": 0, "answer": rows[0]["answer"],
                                     "question": rows[0]["question"]}
    assert written["prompt"][0]["content"].startswith(rows[0]["question"] + " Let's think step by step")
    splits = read_records(DataConfig(name=str(out)))  # the folder's train/test.parquet, checked against the scorers
    train = [(rid, row.ground_truth, row.data_source) for _, rid, row in splits.train.rows]
    assert train == [("train/0", "1198", "openai/gsm8k"), ("train/1", "4", "openai/gsm8k")]
    assert [row.ground_truth for _, _, row in splits.test.rows] == ["6"]


def test_math_command_reads_a_datasets_cache_folder(tmp_path):
    # The Hugging Face datasets cache: Arrow IPC streams named <name>-<split>.arrow under the dataset's folder.
    folder = tmp_path / "cache" / "DigitalLearningGmbH___math-lighteval" / "default" / "0.0.0" / "abc123"
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist([{"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$.",
                                   "level": "Level 1", "type": "Algebra"}])
    for split in ("train", "test"):
        with pa.ipc.new_stream(folder / f"math-lighteval-{split}.arrow", table.schema) as writer:
            writer.write_table(table)
    out = tmp_path / "math"
    assert main(["data", "math", "--from", str(tmp_path / "cache"), "--out", str(out)]) == 0
    splits = read_records(DataConfig(train_files=[str(out / "train.parquet")], val_files=[str(out / "test.parquet")]))
    (_, rid, row), = splits.train.rows
    assert (rid, row.ground_truth, row.data_source) == ("train/0", "\\frac{1}{2}", "DigitalLearningGmbH/MATH-lighteval")
    assert row.extra_info["split"] == "train" and len(splits.test.rows) == 1


@pytest.mark.parametrize("solution, answer", [
    ("so $x = \\boxed{5}$.", "5"),
    ("first \\boxed{1}, then $\\boxed{\\frac{a}{b^{2}}}$", "\\frac{a}{b^{2}}"),  # the last one, braces matched
    ("$\\boxed 7$", "7"),
    ("\\fbox{x+1}", "x+1"),
    ("no box here", None),
    ("\\boxed{unclosed", None),
])
def test_last_boxed(solution, answer):
    assert last_boxed(solution) == answer


def test_gsm8k_answer():
    assert gsm8k_answer("a #### b\n#### 1,234 ") == "1234"
    assert gsm8k_answer("no marker") is None


def test_a_source_row_without_its_fields_is_one_line(tmp_path, capsys):
    source = tmp_path / "train.jsonl"
    source.write_text(json.dumps({"problem": "x"}) + "\n")
    assert main(["data", "gsm8k", "--from", str(source), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"treepo-ray data: {source}: row 0: fields 'question' and 'answer' must be text (the row's "
                   "fields: 'problem')")


def test_data_at_a_uri_is_written_and_read_through_run_storage(tmp_path):
    # file:// takes the same path as s3:// and gs:// (storage.py's pyarrow filesystems), without a network.
    source = tmp_path / "train.jsonl"
    source.write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n")
    out = f"file://{tmp_path}/remote/gsm8k"
    assert main(["data", "gsm8k", "--from", f"file://{source}", "--out", out]) == 0
    splits = read_records(DataConfig(train_files=[f"{out}/train.parquet"]))
    assert [(rid, row.ground_truth) for _, rid, row in splits.train.rows] == [("train/0", "4")]
    with pytest.raises(UserError, match="does not exist"):
        read_records(DataConfig(train_files=[f"{out}/missing.parquet"]))
