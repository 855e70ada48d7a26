"""Prompt datasets from local JSONL or Parquet files, as uniform records.

Two row layouts are read:

- verl's RL layout: `prompt` (a list of chat messages {"role", "content"}, or a string),
  `reward_model.ground_truth`, `data_source`, optionally `extra_info.index`;
- a plain layout: `problem` and `answer` (optionally `data_source`, `id`).

Every row becomes a `Prompt` record (data/prompts.py). The prompt text comes from the tokenizer's chat template when it has one, from
`plain_template` otherwise. A row that cannot be read raises ValueError naming the file, the row and the field,
unless `skip_bad_rows` is set: then it is counted and skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from treepo_ray.data.prompts import Prompt

OVERLONG = ("filter", "error", "truncate_left", "keep")


@dataclass
class DatasetConfig:
    """How rows become prompts."""

    plain_template: str = "{problem}"
    """Prompt text for tokenizers without a chat template; `{problem}` is the problem (or the messages joined)."""
    use_chat_template: bool = True
    """Apply the tokenizer's chat template when it has one."""
    system_prompt: str = ""
    """System message put before a text prompt under a chat template (empty = none)."""
    max_prompt_tokens: int = 1024
    """Longest prompt in tokens; what happens to longer ones is `overlong`."""
    overlong: str = "filter"
    """'filter' (drop and count), 'error' (raise naming the row), 'truncate_left' (keep the last tokens), 'keep'."""
    skip_bad_rows: bool = False
    """Count and skip rows that cannot be read instead of raising."""
    default_data_source: str = "math"
    """`data_source` of rows that name none (the reward router sends it to the math verifier)."""

    def __post_init__(self) -> None:
        if self.overlong not in OVERLONG:
            raise ValueError(f"overlong must be one of {OVERLONG}, got {self.overlong!r}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if "{problem}" not in self.plain_template:
            raise ValueError(f"plain_template must contain {{problem}}, got {self.plain_template!r}")


@dataclass
class LoadedDataset:
    """Records of one or more files, and what was left out."""

    records: list[Prompt] = field(default_factory=list)
    """One prompt per kept row, in file order."""
    bad_rows: int = 0
    """Rows skipped because they could not be read (only with skip_bad_rows)."""
    overlong_rows: int = 0
    """Rows over max_prompt_tokens that were filtered out (or truncated, with truncate_left)."""
    errors: list[str] = field(default_factory=list)
    """The first few messages of skipped rows."""

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.records)

    def __getitem__(self, i):
        return self.records[i]


class BadRow(ValueError):
    """A row that cannot be read; the message names the file, the row and the field."""


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a .jsonl/.json-lines or .parquet file; a line that is not JSON is passed on as a
    BadRow instance so the caller can count or raise it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"dataset file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield i, row
    elif suffix in (".jsonl", ".json", ".ndjson"):
        with path.open(encoding="utf-8") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, BadRow(f"{path}: row {i}: not valid JSON ({e.msg} at column {e.colno})")
    else:
        raise ValueError(f"dataset file {str(path)!r}: unknown format {suffix!r} (use .jsonl or .parquet)")


def _field(row: dict, name: str, where: str) -> Any:
    """row[name] for a dotted name; BadRow naming the field when it is missing."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value or value[part] is None:
            raise BadRow(f"{where}: field {name!r} is missing")
        value = value[part]
    return value


def _messages(prompt: Any, where: str) -> list[dict] | str:
    """The prompt as chat messages (validated) or as text."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow(f"{where}: field 'prompt' is empty")
        return prompt
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise BadRow(f"{where}: field 'prompt' must be a string or a non-empty list of messages")
    out = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRow(f"{where}: field 'prompt[{j}]' must be a message {{'role': str, 'content': str}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _ground_truth(value: Any, where: str, name: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise BadRow(f"{where}: field {name!r} must be a string or a number, got {type(value).__name__}")
    text = str(value).strip()
    if not text:
        raise BadRow(f"{where}: field {name!r} is empty")
    return text


def render_prompt(prompt: list[dict] | str, tokenizer, cfg: DatasetConfig) -> str:
    """Prompt text: the chat template (generation prompt added) when the tokenizer has one, else the plain one."""
    if cfg.use_chat_template and getattr(tokenizer, "chat_template", None):
        if isinstance(prompt, str):
            system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
            prompt = system + [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)
    return cfg.plain_template.replace("{problem}", text)


def parse_row(row: Any, where: str, default_source: str) -> tuple[list[dict] | str, str, str, str | None]:
    """(prompt, ground truth, data source, id or None) of a row in either layout."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"{where}: a row must be an object, got {type(row).__name__}")
    if "prompt" in row or "reward_model" in row:  # verl's layout
        prompt = _messages(_field(row, "prompt", where), where)
        gt = _ground_truth(_field(row, "reward_model.ground_truth", where), where, "reward_model.ground_truth")
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        rid = row.get("id", extra.get("index"))
    elif "problem" in row or "answer" in row:  # plain layout
        prompt = _messages(_field(row, "problem", where), where)
        gt = _ground_truth(_field(row, "answer", where), where, "answer")
        rid = row.get("id")
    else:
        raise BadRow(f"{where}: field 'prompt' (verl layout) or 'problem' (plain layout) is missing")
    source = row.get("data_source") or default_source
    if not isinstance(source, str):
        raise BadRow(f"{where}: field 'data_source' must be a string")
    return prompt, gt, source, None if rid is None else str(rid)


def load_dataset(paths: str | Path | list[str | Path], tokenizer, cfg: DatasetConfig | None = None) -> LoadedDataset:
    """Read every row of the given files into records (see the module docstring)."""
    cfg = cfg or DatasetConfig()
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    out = LoadedDataset()
    seen: set[str] = set()
    for path in paths:
        path = Path(path)
        rows: list[tuple[str, str, str, str, str]] = []  # (where, id, text, ground truth, source)
        for i, row in read_rows(path):
            where = f"{path}: row {i}"
            try:
                prompt, gt, source, rid = parse_row(row, where, cfg.default_data_source)
                rid = rid if rid is not None else f"{path.stem}/{i}"
                if rid in seen:
                    raise BadRow(f"{where}: field 'id' repeats {rid!r}")
                text = render_prompt(prompt, tokenizer, cfg)
            except BadRow as e:
                if not cfg.skip_bad_rows:
                    raise
                out.bad_rows += 1
                if len(out.errors) < 10:
                    out.errors.append(str(e))
                continue
            seen.add(rid)
            rows.append((where, rid, text, gt, source))
        # One tokenizer call per file: a fast tokenizer encodes the batch in parallel.
        all_ids = tokenizer([r[2] for r in rows], add_special_tokens=False).input_ids if rows else []
        for (where, rid, text, gt, source), ids in zip(rows, all_ids):
            if len(ids) > cfg.max_prompt_tokens:
                if cfg.overlong == "error":
                    raise ValueError(f"{where}: field 'prompt' has {len(ids)} tokens > max_prompt_tokens "
                                     f"{cfg.max_prompt_tokens}")
                if cfg.overlong == "filter":
                    out.overlong_rows += 1
                    continue
                if cfg.overlong == "truncate_left":
                    out.overlong_rows += 1
                    ids = ids[-cfg.max_prompt_tokens :]
                    text = tokenizer.decode(ids)
            out.records.append(Prompt(rid, tuple(ids), gt, source, text))
    return out


SYNTHETIC_TRAIN_ROWS = 5_000
"""Training problems written for the synthetic task (the stream reshuffles them every epoch)."""
SYNTHETIC_TEST_ROWS = 500
"""Held-out problems written for the synthetic task."""


def synthetic_files(cache_dir: str | Path, seed: int = 0, n_train: int = SYNTHETIC_TRAIN_ROWS,
                    n_test: int = SYNTHETIC_TEST_ROWS, task: str = "synthetic") -> tuple[Path, Path]:
    """train.jsonl and test.jsonl of the synthetic task `task` (data/synthetic.py TASKS) under `cache_dir` (written
    once per setting)."""
    import hashlib

    from treepo_ray.data.synthetic import task_config, write_splits

    cfg = task_config(task)
    tag = hashlib.sha256(repr(cfg).encode()).hexdigest()[:8]  # the task's settings name the folder
    out = Path(cache_dir) / f"{task}-{tag}-s{seed}-{n_train}-{n_test}"
    train, test = out / "train.jsonl", out / "test.jsonl"
    if not (train.is_file() and test.is_file()):
        tmp = Path(str(out) + f".tmp{os.getpid()}")
        write_splits(tmp, cfg, n_train, n_test, seed)
        try:
            os.rename(tmp, out)
        except OSError:  # written meanwhile by another process
            shutil.rmtree(tmp, ignore_errors=True)
    return train, test


def _split_files(name: str) -> tuple[list[Path], list[Path]]:
    """Train and test files named by `name`: 'train.jsonl,test.jsonl', one file (no test split), or a folder
    holding train.* and test.* files (.jsonl or .parquet)."""
    if "," in name:
        train, test = name.split(",", 1)
        return [Path(train)], [Path(test)]
    path = Path(name)
    if path.is_dir():
        pick = lambda stem: sorted(p for p in path.iterdir() if p.stem == stem and p.suffix in (".jsonl", ".parquet"))  # noqa: E731
        train, test = pick("train"), pick("test")
        if not train:
            raise ValueError(f"dataset folder {name!r} holds no train.jsonl or train.parquet")
        return train, test
    if path.is_file():
        return [path], []
    raise ValueError(f"data.name = {name!r}: not a synthetic task ('synthetic', 'synthetic_addition'), a dataset "
                     "file, a folder or 'train,test' files")


def load_records(data_cfg, tokenizer, cache_dir: str | Path = ".cache/treepo-ray", cfg: DatasetConfig | None = None,
                 synthetic_rows: tuple[int, int] = (SYNTHETIC_TRAIN_ROWS, SYNTHETIC_TEST_ROWS)
                 ) -> tuple[list[Prompt], list[Prompt]]:
    """Training and held-out records of the dataset named by `data_cfg.name` (see `_split_files`), or of a
    synthetic task (`name` 'synthetic' or 'synthetic_addition': `synthetic_rows` problems seeded by
    `data_cfg.seed`, cached under `cache_dir`)."""
    from treepo_ray.data.synthetic import TASKS

    name = str(data_cfg.name)
    if name in TASKS:
        train, test = synthetic_files(cache_dir, int(getattr(data_cfg, "seed", 0)), *synthetic_rows, task=name)
        train_files, test_files = [train], [test]
    else:
        train_files, test_files = _split_files(name)
    train_set = load_dataset(train_files, tokenizer, cfg)
    test_set = load_dataset(test_files, tokenizer, cfg) if test_files else LoadedDataset()
    for split, loaded in (("train", train_set), ("test", test_set)):
        if loaded.bad_rows or loaded.overlong_rows:  # skipped rows are counted out loud, never silently
            first = f"; first: {loaded.errors[0]}" if loaded.errors else ""
            print(f"data: {split} split: {loaded.bad_rows} bad rows skipped, {loaded.overlong_rows} over the prompt "
                  f"length limit{first}", file=sys.stderr)
    return train_set.records, test_set.records
