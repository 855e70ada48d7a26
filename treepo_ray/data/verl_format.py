"""`treepo-ray data gsm8k|math --from SOURCE --out DIR`: GSM8K or MATH in verl's parquet layout, as verl's own
examples/data_preprocess scripts write it, from files already on this machine (or in an object store): no download.

    treepo-ray data gsm8k --from ~/.cache/huggingface/datasets/openai___gsm8k --out ~/data/gsm8k
    treepo-ray data math --from math_train.jsonl --from math_test.jsonl --out s3://bucket/data/math

SOURCE is a .jsonl / .json / .parquet / .arrow file, or a folder of .jsonl / .parquet / .arrow files (a Hugging Face
datasets cache folder, a `save_to_disk` folder, a hub snapshot); a file's split is `test` when its name or folder
says test or validation, `train` when it says train, else --split. DIR gets train.parquet and test.parquet (each
split that has rows), one row per problem: data_source, prompt (chat messages), ability, reward_model {style: rule,
ground_truth}, extra_info {split, index, answer, question}. The ground truth is GSM8K's number after '####' (commas
removed), or the content of the last \\boxed{} of MATH's solution. `data.name=DIR` (or data.train_files /
data.val_files) trains on it.
"""

from __future__ import annotations

import argparse
import io
import json
import os
from pathlib import Path
from typing import Callable, NamedTuple

from treepo_ray import storage
from treepo_ray.config import UserError

SUFFIXES = (".jsonl", ".json", ".ndjson", ".parquet", ".arrow")


class Task(NamedTuple):
    data_source: str
    """The row's data_source: picks the built-in scorer (rewards/router.py), as verl's scripts name it."""
    question: str
    """The source row's field holding the problem."""
    answer: str
    """The source row's field holding the worked answer."""
    instruction: str
    """Appended to the problem, as verl's scripts do."""
    ground_truth: Callable[[str], str | None]
    """The final answer from the worked answer (None: it has none)."""


def gsm8k_answer(answer: str) -> str | None:
    """GSM8K's final answer: the number after the last '####', without thousands separators."""
    if "####" not in answer:
        return None
    return answer.rsplit("####", 1)[1].strip().replace(",", "") or None


def last_boxed(text: str) -> str | None:
    r"""The content of the last \boxed{...} (or \fbox{...}) in `text`, braces matched; `\boxed 5` gives 5."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:].removeprefix("\\boxed").removeprefix("\\fbox")
    if rest.startswith(" "):  # \boxed 5$: the answer runs to the closing $
        return rest[1:].split("$", 1)[0].strip() or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return rest[1:i].strip() or None
    return None  # unbalanced braces


TASKS = {
    "gsm8k": Task("openai/gsm8k", "question", "answer",
                  "Let's think step by step and output the final answer after \"####\".", gsm8k_answer),
    "math": Task("DigitalLearningGmbH/MATH-lighteval", "problem", "solution",
                 "Let's think step by step and output the final answer within \\boxed{}.", last_boxed),
}


def source_files(source: str, default_split: str) -> list[tuple[str, str]]:
    """(file, split) of every data file SOURCE names: itself, or those under a local folder (sorted)."""
    if not storage.is_uri(source) and Path(source).expanduser().is_dir():
        root = Path(source).expanduser()
        files = sorted(str(p) for p in root.rglob("*") if p.suffix in (".jsonl", ".parquet", ".arrow")
                       and not p.name.startswith("."))
        if not files:
            raise UserError(f"--from {source}: the folder holds no .jsonl, .parquet or .arrow file")
    else:
        source = source if storage.is_uri(source) else str(Path(source).expanduser())
        if not (storage.exists(source) if storage.is_uri(source) else Path(source).is_file()):
            raise UserError(f"--from {source}: no such file or folder")
        if Path(source).suffix.lower() not in SUFFIXES:
            raise UserError(f"--from {source}: unknown format (use {', '.join(SUFFIXES)})")
        files = [source]
    return [(f, split_of(f, default_split)) for f in files]


def split_of(location: str, default: str) -> str:
    """'test' or 'train' from the file's name or folders (gsm8k-test.arrow, test/data-0.arrow, validation-*.parquet)."""
    words = location.replace("\\", "/").lower().rsplit("/", 3)[-3:]
    for word in reversed(words):
        if "test" in word or "validation" in word:
            return "test"
        if "train" in word:
            return "train"
    return default


def read_source(location: str) -> list[dict]:
    """The rows of a .jsonl / .json (lines or one array) / .parquet / .arrow (Arrow IPC stream or file: the
    Hugging Face datasets cache) file, local or at a URI."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = storage.read_bytes(location) if storage.is_uri(location) else Path(location).read_bytes()
    suffix = Path(location).suffix.lower()
    try:
        if suffix == ".parquet":
            return pq.read_table(io.BytesIO(data)).to_pylist()
        if suffix == ".arrow":
            try:
                return pa.ipc.open_stream(data).read_all().to_pylist()
            except pa.ArrowInvalid:  # the file format rather than the stream format
                return pa.ipc.open_file(data).read_all().to_pylist()
        text = data.decode("utf-8-sig")
        if text.lstrip().startswith("["):
            return json.loads(text)
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except (pa.ArrowException, OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"--from {location}: cannot be read ({' '.join(str(err).split())[:200]})") from None


def verl_rows(task: Task, rows: list[dict], split: str, where: str, start: int = 0) -> list[dict]:
    """Rows of verl's layout (as its gsm8k.py / math_dataset.py write them), indexed from `start` within the split."""
    out = []
    for i, row in enumerate(rows):
        question, answer = row.get(task.question), row.get(task.answer)
        if not isinstance(question, str) or not isinstance(answer, str):
            raise UserError(f"{where}: row {i}: fields {task.question!r} and {task.answer!r} must be text (the row's "
                            f"fields: {', '.join(map(repr, row)) if isinstance(row, dict) else type(row).__name__})")
        truth = task.ground_truth(answer)
        if truth is None and isinstance(row.get("answer"), str) and task.answer != "answer":
            truth = row["answer"].strip() or None  # MATH-500 keeps the final answer in a field of its own
        if truth is None:
            raise UserError(f"{where}: row {i}: no final answer in field {task.answer!r}")
        out.append({
            "data_source": task.data_source,
            "prompt": [{"role": "user", "content": f"{question} {task.instruction}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"split": split, "index": start + len(out), "answer": answer, "question": question},
        })
    return out


def write_parquet(rows: list[dict], location: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    storage.write_bytes(location, buffer.getvalue())


def convert(task_name: str, sources: list[str], out: str, default_split: str = "train") -> dict[str, int]:
    """Write `out`/train.parquet and test.parquet from `sources`; returns the rows written per split."""
    task = TASKS[task_name]
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for source in sources:
        for location, split in source_files(source, default_split):
            splits[split] += verl_rows(task, read_source(location), split, location, len(splits[split]))
    if not any(splits.values()):
        raise UserError(f"--from {', '.join(sources)}: no rows")
    out = out if storage.is_uri(out) else os.path.abspath(os.path.expanduser(out))
    storage.makedirs(out)
    for split, rows in splits.items():
        if rows:
            write_parquet(rows, storage.join(out, f"{split}.parquet"))
    return {split: len(rows) for split, rows in splits.items() if rows}


def main(argv: list[str] | None = None) -> int:
    intro, rest = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="treepo-ray data", description=" ".join(intro.split()),
                                 epilog=rest,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("task", choices=sorted(TASKS), help="the dataset's layout")
    ap.add_argument("--from", dest="sources", action="append", required=True, metavar="SOURCE",
                    help="a local file or folder, or a file's s3:// / gs:// URI (may be given more than once)")
    ap.add_argument("--out", required=True, help="folder (or s3:// / gs:// URI) for train.parquet and test.parquet")
    ap.add_argument("--split", choices=("train", "test"), default="train",
                    help="the split of a file whose name does not say (default train)")
    args = ap.parse_args(argv)
    written = convert(args.task, args.sources, args.out, args.split)
    print(", ".join(f"{n} {split} rows" for split, n in written.items()) + f" written to {args.out}")
    return 0
