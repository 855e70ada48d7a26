"""Prompt datasets from local JSONL or Parquet files, as uniform records.

Two row layouts are read:

- verl's RL layout: `prompt` (a list of chat messages {"role", "content"}, or a string; the field named by
  data.prompt_key), `reward_model.ground_truth` (a string, a number, a list of acceptable answers, or any JSON value
  a custom reward function reads), `data_source` (the field named by data.reward_fn_key), optionally `extra_info`
  (passed to the reward function; its `index` names the row, and may repeat, as verl allows: it is metadata there,
  and restarts in each source of a file that concatenates several, so a repeat gets its row number added);
- a plain layout: `problem` and `answer` (optionally `data_source`, `id`).

Every row becomes a `Prompt` record (data/prompts.py) whose id is `<file>/<row id>`, so ids stay unique across files
(verl's extra_info.index restarts in every file; a repeat within one is `<file>/<index>@<row>`). A file is a local
path or an `s3://` / `gs://` URI (read through treepo_ray/storage.py). Loading is two steps, so that every row is
checked before any model is loaded (job/inputs.py):

- read (`read_dataset`, `read_records`; no tokenizer): each row decoded (UTF-8, JSON), its fields found, its text
  free of lone surrogates, its ground truth free of NaN and infinities, its data source and ground truth taken by a
  built-in scorer when no custom reward function is set, its extra_info made recordable as JSON (timestamps and
  dates become ISO 8601 text, bytes base64, said once per split). A row that fails raises BadRow naming the file,
  the row and the field, unless `skip_bad_rows` is set: then it is counted and skipped. A file that cannot be read
  at all (missing, corrupt parquet) is a UserError naming it.
- encode (`encode_dataset`, `encode_records`): the prompt text from the tokenizer's chat template when it has one,
  from `plain_template` otherwise, tokenized; a prompt longer than the limit (max_prompt_tokens, and the model's
  context less the response budget) is handled as `overlong` says.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import io
import json
import math
import os
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, NamedTuple

from treepo_ray import storage
from treepo_ray.config import UserError
from treepo_ray.data.prompts import Prompt
from treepo_ray.rewards.router import check_row, scorer_of

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
    """'filter' (drop and count), 'error' (raise naming the row), 'truncate_left' (keep the last tokens), or 'keep'
    (no max_prompt_tokens limit; a prompt that leaves the response no room in the model's context is still an
    error)."""
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
    """Rows over the prompt length limit that were filtered out (or truncated, with truncate_left)."""
    errors: list[str] = field(default_factory=list)
    """The first few messages of skipped rows."""
    converted: int = 0
    """extra_info values JSON has no form for, recorded in another form (ISO 8601 text, base64, ...)."""
    first_converted: str = ""
    """Where the first of them was: 'file: row i: field (type)'."""
    rows: list[tuple[str, str, ParsedRow]] = field(default_factory=list)
    """Rows read and checked by read_dataset, as (where, id, row), waiting for the tokenizer (encode_dataset)."""

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.records)

    def __getitem__(self, i):
        return self.records[i]


class BadRow(UserError):
    """A row that cannot be read; the message names the file, the row and the field."""


def data_path(location: str | Path) -> Path | str:
    """A data file as given: a local path (`~` expanded), or an s3:// / gs:// URI kept as text (a Path would fold
    its `//`)."""
    return str(location) if storage.is_uri(location) else Path(location).expanduser()


def file_exists(location: str | Path) -> bool:
    return storage.exists(str(location)) if storage.is_uri(location) else Path(location).is_file()


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a .jsonl/.json-lines or .parquet file, local or at a URI; a row that cannot be decoded
    (not UTF-8, not JSON) is passed on as a BadRow instance so the caller can count or raise it. A file that cannot be
    read at all (missing, not parquet) is a UserError naming it."""
    path = data_path(path)
    if not file_exists(path):
        raise UserError(f"dataset file {str(path)!r} does not exist")
    suffix = Path(str(path)).suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".json", ".ndjson"):
        raise UserError(f"dataset file {str(path)!r}: unknown format {suffix!r} (use .jsonl or .parquet)")
    if storage.is_uri(path):  # read whole, once: the rows are checked on the driver anyway
        source = io.BytesIO(storage.read_bytes(path))
    else:
        source = path
    if suffix == ".parquet":
        yield from _parquet_rows(source, path)
    else:
        yield from _jsonl_rows(source, path)


def _jsonl_rows(source: Path | io.BytesIO, path: Path | str) -> Iterator[tuple[int, Any]]:
    # Bytes, decoded line by line: one undecodable line is a bad row naming itself, not a traceback for the file.
    with (source.open("rb") if isinstance(source, Path) else source) as f:
        for i, raw in enumerate(f):
            try:
                line = raw.decode("utf-8-sig" if i == 0 else "utf-8")  # a byte-order mark may open the file
            except UnicodeDecodeError as e:
                yield i, BadRow(f"{path}: row {i}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} "
                                "of the line)")
                continue
            if not line.strip():
                continue
            try:
                yield i, json.loads(line)
            except json.JSONDecodeError as e:
                yield i, BadRow(f"{path}: row {i}: not valid JSON ({e.msg} at column {e.colno})")


def _parquet_rows(source: Path | io.BytesIO, path: Path | str) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(source)
    except (pa.ArrowException, OSError) as err:  # not parquet, truncated, corrupt pages
        why = " ".join(str(err).replace(f"Could not open Parquet input source '{path}': ", "").split())
        raise UserError(f"{path}: not a readable parquet file ({why})") from None
    i = 0
    for batch in table.to_batches(max_chunksize=4096):
        try:
            rows = batch.to_pylist()
        except UnicodeDecodeError:  # a text column holding bytes that are not UTF-8: find the rows, name them
            rows = [_parquet_row(batch, j, f"{path}: row {i + j}") for j in range(batch.num_rows)]
        for row in rows:
            yield i, row
            i += 1


def _parquet_row(batch, j: int, where: str) -> dict | BadRow:
    row = {}
    for name, column in zip(batch.schema.names, batch.columns):
        try:
            row[name] = column[j].as_py()
        except UnicodeDecodeError as e:
            return BadRow(f"{where}: field {name!r} is not valid UTF-8 (byte 0x{e.object[e.start]:02x})")
    return row


def _recordable(value: Any, where: str, name: str, converted: list[str] | None) -> Any:
    """`value` as JSON records it (trees.jsonl, checkpoints' waiting batches, the reward workers), checked now so
    that a row that cannot be recorded fails here, naming itself, and not at the first tree record after Ray is up.
    Every string must be text (no lone surrogate, such as a JSON "\\ud800"). With `converted` (extra_info), a
    timestamp, date or time becomes ISO 8601 text, a duration its seconds, a decimal or uuid its text and bytes
    base64 (_AS_JSON), each named in `converted`; without it (prompts, ground truths) such a value, and a NaN or
    infinite number, is refused. Any other type is refused either way."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRow(f"{where}: field {name!r} holds a lone surrogate {value[e.start]!r} at character {e.start} "
                         "(not text; an unpaired \\ud800-\\udfff escape?)") from None
        return value
    if value is None or isinstance(value, (bool, int)):
        return value
    if isinstance(value, float):
        if converted is None and math.isnan(value):
            raise BadRow(f"{where}: field {name!r} is NaN, not an answer (a missing value?)")
        if converted is None and math.isinf(value):
            raise BadRow(f"{where}: field {name!r} is {value}, not an answer (write infinity as text, e.g. '\\infty')")
        return value
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise BadRow(f"{where}: field {name!r} has a key of type {type(k).__name__}; JSON keys are text")
            out[_recordable(k, where, name, None)] = _recordable(v, where, f"{name}.{k}", converted)
        return out
    if isinstance(value, (list, tuple)):
        return [_recordable(v, where, f"{name}[{j}]", converted) for j, v in enumerate(value)]
    as_json = next((f for t, f in _AS_JSON.items() if isinstance(value, t)), None) if converted is not None else None
    if as_json is None:
        raise BadRow(f"{where}: field {name!r} holds a value of type {type(value).__name__}, which cannot be recorded "
                     "as JSON (give text, numbers, lists or mappings)")
    converted.append(f"{where}: {name} ({type(value).__name__})")
    return as_json(value)


# extra_info values JSON has no form for (parquet's timestamp, date, time, duration, decimal, binary and uuid columns),
# in the form each is passed on: converted once as the row is read, so that the reward function, trees.jsonl and a
# checkpoint's waiting batches all see the same value.
_AS_JSON = {
    datetime.datetime: datetime.datetime.isoformat,  # before date: a datetime is a date
    datetime.date: datetime.date.isoformat,
    datetime.time: datetime.time.isoformat,
    datetime.timedelta: datetime.timedelta.total_seconds,
    decimal.Decimal: str,
    bytes: lambda b: base64.b64encode(b).decode("ascii"),
    uuid.UUID: str,
}


def _field(row: dict, name: str, where: str) -> Any:
    """row[name] for a dotted name; BadRow naming the field when it is missing."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value or value[part] is None:
            raise BadRow(f"{where}: field {name!r} is missing")
        value = value[part]
    return value


def _fields_of(row: dict) -> str:
    return ", ".join(repr(k) for k in row) or "none"


def _messages(prompt: Any, where: str, name: str = "prompt") -> list[dict] | str:
    """The prompt as chat messages (validated) or as text."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow(f"{where}: field {name!r} is empty")
        return _recordable(prompt, where, name, None)
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise BadRow(f"{where}: field {name!r} must be a string or a non-empty list of messages")
    out = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRow(f"{where}: field '{name}[{j}]' must be a message {{'role': str, 'content': str}}")
        out.append({"role": m["role"], "content": m["content"]})
    return _recordable(out, where, name, None)


def _ground_truth(value: Any, where: str, name: str) -> object:
    """A scalar as its stripped text; a list (acceptable answers) or a dict (for a custom reward function) as is.
    NaN, infinities and values JSON cannot hold are refused anywhere in it."""
    value = _recordable(value, where, name, None)
    if isinstance(value, (list, dict)):
        if not value:
            raise BadRow(f"{where}: field {name!r} is empty")
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise BadRow(f"{where}: field {name!r} must be a string, a number, a list or a mapping, "
                     f"got {type(value).__name__}")
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


@dataclass(frozen=True)
class RowKeys:
    """Which fields of a row hold what (verl's data.prompt_key and data.reward_fn_key)."""

    prompt_key: str = "prompt"
    """The field holding the prompt in verl's layout."""
    reward_fn_key: str = "data_source"
    """The field whose value picks the reward function (the row's data_source)."""


@dataclass(frozen=True)
class ParsedRow:
    prompt: list[dict] | str
    ground_truth: object
    data_source: str
    id: str | None
    extra_info: dict
    truth_field: str = "answer"
    """The field the ground truth came from (named in errors)."""
    converted: tuple[str, ...] = ()
    """extra_info values recorded in another form (see _recordable), as 'where: field (type)'."""
    id_from_index: bool = False
    """The id is verl's extra_info.index: metadata that may repeat, not a key (an `id` field must not repeat)."""


def parse_row(row: Any, where: str, default_source: str, keys: RowKeys = RowKeys()) -> ParsedRow:
    """The prompt, ground truth, data source, id (or None) and extra_info of a row in either layout."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"{where}: a row must be an object, got {type(row).__name__}")
    if keys.prompt_key in row or "reward_model" in row:  # verl's layout
        if row.get(keys.prompt_key) is None:  # most often data.prompt_key naming a column the data lacks
            raise BadRow(f"{where}: field {keys.prompt_key!r} is missing (data.prompt_key; the row's fields: "
                         f"{_fields_of(row)})")
        prompt = _messages(row[keys.prompt_key], where, keys.prompt_key)
        truth_field = "reward_model.ground_truth"
    elif "problem" in row or "answer" in row:  # plain layout
        prompt = _messages(_field(row, "problem", where), where, "problem")
        truth_field = "answer"
    else:
        raise BadRow(f"{where}: field {keys.prompt_key!r} (verl layout) or 'problem' (plain layout) is missing; the "
                     f"row's fields: {_fields_of(row)}")
    gt = _ground_truth(_field(row, truth_field, where), where, truth_field)
    source = _data_source(row, where, default_source, keys.reward_fn_key)
    converted: list[str] = []
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise BadRow(f"{where}: field 'extra_info' must be a mapping, got {type(extra).__name__}")
    extra = _recordable(extra or {}, where, "extra_info", converted)
    rid = row.get("id")
    from_index = rid is None and extra.get("index") is not None
    rid = extra["index"] if from_index else rid
    rid = None if rid is None else _recordable(str(rid), where, "id", None)
    return ParsedRow(prompt, gt, source, rid, extra, truth_field, tuple(converted), from_index)


def _data_source(row: dict, where: str, default_source: str, key: str) -> str:
    """The row's data source: its `key` field; the default when it has none, unless `key` was set to a field of
    the user's own (data.reward_fn_key), which every row must then have."""
    source = row.get(key)
    if source is None and key != "data_source":
        raise BadRow(f"{where}: field {key!r} is missing (data.reward_fn_key; the row's fields: {_fields_of(row)})")
    if not source:
        return default_source
    if not isinstance(source, str):
        raise BadRow(f"{where}: field {key!r} must be a string")
    return _recordable(source, where, key, None)


@dataclass(frozen=True)
class PromptBudget:
    """The longest prompt a dataset may hold: max_prompt_tokens, and what the model's context leaves after the
    response budget."""

    context_tokens: int | None = None
    """The model's context length (max_position_embeddings; None = not known, no check)."""
    response_tokens: int = 0
    """Tokens a response may take (the sampler's response limit)."""

    def context_limit(self) -> int | None:
        return None if self.context_tokens is None else self.context_tokens - self.response_tokens


def _file_tags(paths: list[Path | str]) -> list[str]:
    """A short name per file for its rows' ids: the file's stem, numbered when two files share one."""
    tags, used = [], set()
    for p in paths:
        stem = Path(str(p)).stem
        tag, k = stem, 1
        while tag in used:
            k += 1
            tag = f"{stem}~{k}"
        used.add(tag)
        tags.append(tag)
    return tags


def _paths(paths: str | Path | list[str | Path]) -> list[Path | str]:
    return [data_path(p) for p in ([paths] if isinstance(paths, (str, Path)) else paths)]


def read_dataset(paths: str | Path | list[str | Path], cfg: DatasetConfig | None = None,
                 keys: RowKeys = RowKeys(), custom_reward: bool = False) -> LoadedDataset:
    """Every row of the given files read and checked, without a tokenizer (so before any model is loaded): decoded,
    parsed, its ground truth and data source checked against the built-in scorers (without `custom_reward`), its
    extra_info made recordable. The rows wait in `.rows` for `encode_dataset`."""
    cfg = cfg or DatasetConfig()
    out = LoadedDataset()
    seen: set[str] = set()
    paths = _paths(paths)
    for path, tag in zip(paths, _file_tags(paths)):
        for i, row in read_rows(path):
            where = f"{path}: row {i}"
            try:
                parsed = parse_row(row, where, cfg.default_data_source, keys)
                rid = f"{tag}/{parsed.id if parsed.id is not None else i}"
                if rid in seen and parsed.id_from_index:  # verl numbers each source from 0: the row makes it unique
                    rid = f"{rid}@{i}"
                if rid in seen:
                    raise BadRow(f"{where}: field 'id' repeats {rid!r}")
                if not custom_reward:
                    _check_scorer(parsed, where, keys)
            except BadRow as e:
                if not cfg.skip_bad_rows:
                    raise
                out.bad_rows += 1
                if len(out.errors) < 10:
                    out.errors.append(str(e))
                continue
            seen.add(rid)
            if parsed.converted:
                out.converted += len(parsed.converted)
                out.first_converted = out.first_converted or parsed.converted[0]
            out.rows.append((where, rid, parsed))
    return out


def _check_scorer(parsed: ParsedRow, where: str, keys: RowKeys) -> None:
    """BadRow when no built-in scorer takes the row: its data source (none for it) or its ground truth."""
    try:
        check_row(parsed.data_source, parsed.ground_truth)
    except ValueError as err:
        name = keys.reward_fn_key if scorer_of(parsed.data_source) is None else parsed.truth_field
        raise BadRow(f"{where}: field {name!r}: {err}") from None


def encode_dataset(loaded: LoadedDataset, tokenizer, cfg: DatasetConfig | None = None, keys: RowKeys = RowKeys(),
                   budget: PromptBudget = PromptBudget()) -> LoadedDataset:
    """The rows read by read_dataset as prompt records: rendered, tokenized and held to the length limit (module
    docstring); `loaded` gets them in `.records`."""
    cfg = cfg or DatasetConfig()
    context_limit = budget.context_limit()
    if context_limit is not None and context_limit < 1:
        raise UserError(f"the model's context of {budget.context_tokens} tokens leaves no room for a prompt after "
                        f"the {budget.response_tokens}-token response budget")
    limit, why = _limit(cfg, context_limit, budget)
    texts = [render_prompt(parsed.prompt, tokenizer, cfg) for _, _, parsed in loaded.rows]
    # One tokenizer call for the whole set: a fast tokenizer encodes the batch in parallel.
    all_ids = tokenizer(texts, add_special_tokens=False).input_ids if texts else []
    for (where, rid, parsed), text, ids in zip(loaded.rows, texts, all_ids):
        if limit is not None and len(ids) > limit:
            if cfg.overlong in ("error", "keep"):  # 'keep' has only the context's limit, which cannot be kept
                raise BadRow(f"{where}: field {keys.prompt_key!r} has {len(ids)} tokens > {why}")
            if cfg.overlong == "filter":
                loaded.overlong_rows += 1
                continue
            if cfg.overlong == "truncate_left":
                loaded.overlong_rows += 1
                ids = ids[-limit:]
                text = tokenizer.decode(ids)
        loaded.records.append(Prompt(rid, tuple(ids), parsed.ground_truth, parsed.data_source, text,
                                     extra_info=parsed.extra_info))
    loaded.rows = []
    return loaded


def load_dataset(paths: str | Path | list[str | Path], tokenizer, cfg: DatasetConfig | None = None,
                 keys: RowKeys = RowKeys(), budget: PromptBudget = PromptBudget(),
                 custom_reward: bool = False) -> LoadedDataset:
    """Read every row of the given files into records (see the module docstring). Without `custom_reward`, a row
    whose data source has no built-in scorer (or whose ground truth it cannot read) is a bad row."""
    return encode_dataset(read_dataset(paths, cfg, keys, custom_reward), tokenizer, cfg, keys, budget)


def _limit(cfg: DatasetConfig, context_limit: int | None, budget: PromptBudget) -> tuple[int | None, str]:
    """The prompt length limit in tokens and how to name it in a message."""
    own = None if cfg.overlong == "keep" else cfg.max_prompt_tokens
    if context_limit is not None and (own is None or context_limit < own):
        return context_limit, (f"{context_limit}, what the model's context of {budget.context_tokens} tokens leaves "
                               f"after the {budget.response_tokens}-token response budget")
    return own, f"max_prompt_tokens {cfg.max_prompt_tokens}"


WORD_PROBLEMS = "word_problems"
"""The built-in task of English word problems for a real model (data/word_problems.py)."""
SYNTHETIC_TRAIN_ROWS = 5_000
"""Training problems written for the synthetic task (the stream reshuffles them every epoch)."""
SYNTHETIC_TEST_ROWS = 500
"""Held-out problems written for the synthetic task."""


def synthetic_files(cache_dir: str | Path, seed: int = 0, n_train: int = SYNTHETIC_TRAIN_ROWS,
                    n_test: int = SYNTHETIC_TEST_ROWS, task: str = "synthetic") -> tuple[Path, Path]:
    """train.jsonl and test.jsonl of the built-in task `task` (data/synthetic.py TASKS, or WORD_PROBLEMS) under
    `cache_dir` (written once per setting)."""
    import hashlib

    if task == WORD_PROBLEMS:
        from treepo_ray.data.word_problems import WordProblemConfig, write_splits

        cfg = WordProblemConfig()
    else:
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
        return [Path(train).expanduser()], [Path(test).expanduser()]
    path = Path(name).expanduser()
    if path.is_dir():
        pick = lambda stem: sorted(p for p in path.iterdir() if p.stem == stem and p.suffix in (".jsonl", ".parquet"))  # noqa: E731
        train, test = pick("train"), pick("test")
        if not train:
            raise UserError(f"data.name = {name!r}: the folder holds no train.jsonl or train.parquet")
        return train, test
    if path.is_file():
        return [path], []
    raise UserError(f"data.name = {name!r}: not 'synthetic', 'synthetic_addition', 'word_problems' (the built-in "
                    "tasks), a dataset "
                    "file, a folder or 'train,test' files")


@dataclass
class DataConfig:
    """The prompts: verl's data.train_files / data.val_files, or `name` (the synthetic task, a folder, files)."""

    train_files: list[str] = field(default_factory=list)
    """Training files, .parquet or .jsonl: one path or a list (verl's data.train_files; `~` is expanded). When set,
    they are the dataset and `name` must be left at 'synthetic'."""
    val_files: list[str] = field(default_factory=list)
    """Held-out files, one path or a list (verl's data.val_files; none = nothing held out)."""
    name: str = "synthetic"
    """Without train_files: a built-in task, 'synthetic' (running sums, several dependent steps: data/chain.py) or
    'synthetic_addition' (one addition, the easy task), 'word_problems' (English GSM8K-like problems for a real
    model: data/word_problems.py); a folder with train/test files, 'train.jsonl,test.jsonl',
    or one file (then nothing is held out). With model.path empty the tiny base model is pretrained for the
    built-in task named."""
    prompt_key: str = "prompt"
    """The field of a verl-layout row that holds the prompt (verl's data.prompt_key)."""
    reward_fn_key: str = "data_source"
    """The field whose value picks a row's reward function (verl's data.reward_fn_key). A row without `data_source`
    gets prompt.default_data_source; set to another field, every row must have that field."""
    seed: int = 0
    """Seed of the synthetic task's problems and of the base model's pretraining."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (deterministically from trainer.seed and the epoch)."""
    prompt: DatasetConfig = field(default_factory=DatasetConfig)
    """How rows become prompts (chat template, length limit, bad rows)."""

    def __post_init__(self) -> None:
        if self.train_files and self.name != "synthetic":
            raise UserError(f"data.name = {self.name!r} and data.train_files are both set; use one of them")
        if self.val_files and not self.train_files:
            raise UserError("data.val_files is set without data.train_files")
        if not self.prompt_key or not self.reward_fn_key:
            raise UserError("data.prompt_key and data.reward_fn_key must name a field")

    def files(self, cache_dir: str | Path, synthetic_rows: tuple[int, int]) -> tuple[list[Path], list[Path]]:
        """The training and held-out files this section names."""
        if self.train_files:
            return [data_path(p) for p in self.train_files], [data_path(p) for p in self.val_files]
        from treepo_ray.data.synthetic import TASKS

        if self.name in TASKS or self.name == WORD_PROBLEMS:
            train, test = synthetic_files(cache_dir, self.seed, *synthetic_rows, task=self.name)
            return [train], [test]
        return _split_files(self.name)


class Splits(NamedTuple):
    """The training and held-out rows read by read_records, waiting for the tokenizer (encode_records)."""

    train: LoadedDataset
    test: LoadedDataset
    files: int
    """Training files (named when the training set ends up empty)."""


def read_records(data_cfg: DataConfig, cache_dir: str | Path = ".cache/treepo-ray",
                 synthetic_rows: tuple[int, int] = (SYNTHETIC_TRAIN_ROWS, SYNTHETIC_TEST_ROWS),
                 custom_reward: bool = False) -> Splits:
    """Every row of the files `data_cfg` names, read and checked (read_dataset) with no model needed: a bad row is
    named before anything slow starts. The synthetic task's files are written first (`synthetic_rows` problems
    seeded by data_cfg.seed, cached under `cache_dir`)."""
    train_files, test_files = data_cfg.files(cache_dir, synthetic_rows)
    keys = RowKeys(data_cfg.prompt_key, data_cfg.reward_fn_key)
    read = lambda files: read_dataset(files, data_cfg.prompt, keys, custom_reward)  # noqa: E731
    splits = Splits(read(train_files), read(test_files) if test_files else LoadedDataset(), len(train_files))
    for split, loaded in (("train", splits.train), ("test", splits.test)):
        if loaded.converted:  # said once, so that a reward function's author knows the form it gets
            print(f"data: {split} split: {loaded.converted} extra_info values that JSON has no form for are passed "
                  f"on as JSON (timestamps, dates and times as ISO 8601 text, durations as seconds, decimals as text, "
                  f"bytes as base64); first: {loaded.first_converted}", file=sys.stderr)
    if not splits.train.rows:
        _empty(splits)
    return splits


def encode_records(data_cfg: DataConfig, splits: Splits, tokenizer, budget: PromptBudget = PromptBudget()
                   ) -> tuple[list[Prompt], list[Prompt]]:
    """The training and held-out records of rows read by read_records (encode_dataset); bad and overlong rows that
    were skipped are counted out loud."""
    keys = RowKeys(data_cfg.prompt_key, data_cfg.reward_fn_key)
    for loaded in splits[:2]:
        encode_dataset(loaded, tokenizer, data_cfg.prompt, keys, budget)
    for split, loaded in (("train", splits.train), ("test", splits.test)):
        if loaded.bad_rows or loaded.overlong_rows:  # skipped rows are counted out loud, never silently
            first = f"; first: {loaded.errors[0]}" if loaded.errors else ""
            print(f"data: {split} split: {loaded.bad_rows} bad rows skipped, {loaded.overlong_rows} over the prompt "
                  f"length limit{first}", file=sys.stderr)
    if not splits.train.records:
        _empty(splits)
    return splits.train.records, splits.test.records


def _empty(splits: Splits) -> None:
    train = splits.train
    raise UserError(f"data: the training set is empty ({splits.files} file(s), {train.bad_rows} bad rows and "
                    f"{train.overlong_rows} over the prompt length limit skipped)")


def load_records(data_cfg: DataConfig, tokenizer, cache_dir: str | Path = ".cache/treepo-ray",
                 synthetic_rows: tuple[int, int] = (SYNTHETIC_TRAIN_ROWS, SYNTHETIC_TEST_ROWS),
                 budget: PromptBudget = PromptBudget(), custom_reward: bool = False
                 ) -> tuple[list[Prompt], list[Prompt]]:
    """Training and held-out records of the files `data_cfg` names: read_records, then encode_records. Bad and
    overlong rows raise or are counted as data_cfg.prompt says; see load_dataset for `budget` and `custom_reward`."""
    splits = read_records(data_cfg, cache_dir, synthetic_rows, custom_reward)
    return encode_records(data_cfg, splits, tokenizer, budget)
