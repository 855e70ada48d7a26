"""Prompt datasets from local JSONL or Parquet files, as uniform records.

Two row layouts are read:

- verl's RL layout: `prompt` (a list of chat messages {"role", "content"}, or a string; the field named by
  data.prompt_key), `reward_model.ground_truth` (a string, a number, a list of acceptable answers, or any JSON value
  a custom reward function reads), `data_source` (the field named by data.reward_fn_key), optionally `extra_info`
  (passed to the reward function; its `index` names the row);
- a plain layout: `problem` and `answer` (optionally `data_source`, `id`).

Every row becomes a `Prompt` record (data/prompts.py) whose id is `<file>/<row id>`, so ids stay unique across files
(verl's extra_info.index restarts in every file). The prompt text comes from the tokenizer's chat template when it
has one, from `plain_template` otherwise. A row that cannot be read (or whose data source has no built-in scorer
when no custom reward function is set) raises BadRow naming the file, the row and the field, unless
`skip_bad_rows` is set: then it is counted and skipped. A prompt longer than the limit (max_prompt_tokens, and the
model's context less the response budget) is handled as `overlong` says.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from treepo_ray.config import UserError
from treepo_ray.data.prompts import Prompt
from treepo_ray.rewards.router import check_row

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

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Prompt]:
        return iter(self.records)

    def __getitem__(self, i):
        return self.records[i]


class BadRow(UserError):
    """A row that cannot be read; the message names the file, the row and the field."""


def read_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(row number, row) of a .jsonl/.json-lines or .parquet file; a line that is not JSON is passed on as a
    BadRow instance so the caller can count or raise it."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"dataset file {str(path)!r} does not exist")
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
        raise UserError(f"dataset file {str(path)!r}: unknown format {suffix!r} (use .jsonl or .parquet)")


def _field(row: dict, name: str, where: str) -> Any:
    """row[name] for a dotted name; BadRow naming the field when it is missing."""
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value or value[part] is None:
            raise BadRow(f"{where}: field {name!r} is missing")
        value = value[part]
    return value


def _messages(prompt: Any, where: str, name: str = "prompt") -> list[dict] | str:
    """The prompt as chat messages (validated) or as text."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise BadRow(f"{where}: field {name!r} is empty")
        return prompt
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise BadRow(f"{where}: field {name!r} must be a string or a non-empty list of messages")
    out = []
    for j, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise BadRow(f"{where}: field '{name}[{j}]' must be a message {{'role': str, 'content': str}}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _ground_truth(value: Any, where: str, name: str) -> object:
    """A scalar as its stripped text; a list (acceptable answers) or a dict (for a custom reward function) as is."""
    if isinstance(value, (list, tuple, dict)):
        if not value:
            raise BadRow(f"{where}: field {name!r} is empty")
        return list(value) if isinstance(value, tuple) else value
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


def parse_row(row: Any, where: str, default_source: str, keys: RowKeys = RowKeys()) -> ParsedRow:
    """The prompt, ground truth, data source, id (or None) and extra_info of a row in either layout."""
    if isinstance(row, BadRow):
        raise row
    if not isinstance(row, dict):
        raise BadRow(f"{where}: a row must be an object, got {type(row).__name__}")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    if keys.prompt_key in row or "reward_model" in row:  # verl's layout
        prompt = _messages(_field(row, keys.prompt_key, where), where, keys.prompt_key)
        gt = _ground_truth(_field(row, "reward_model.ground_truth", where), where, "reward_model.ground_truth")
        rid = row.get("id", extra.get("index"))
    elif "problem" in row or "answer" in row:  # plain layout
        prompt = _messages(_field(row, "problem", where), where, "problem")
        gt = _ground_truth(_field(row, "answer", where), where, "answer")
        rid = row.get("id")
    else:
        raise BadRow(f"{where}: field {keys.prompt_key!r} (verl layout) or 'problem' (plain layout) is missing")
    source = row.get(keys.reward_fn_key) or default_source
    if not isinstance(source, str):
        raise BadRow(f"{where}: field {keys.reward_fn_key!r} must be a string")
    return ParsedRow(prompt, gt, source, None if rid is None else str(rid), extra)


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


def _file_tags(paths: list[Path]) -> list[str]:
    """A short name per file for its rows' ids: the file's stem, numbered when two files share one."""
    tags, used = [], set()
    for p in paths:
        tag, k = p.stem, 1
        while tag in used:
            k += 1
            tag = f"{p.stem}~{k}"
        used.add(tag)
        tags.append(tag)
    return tags


def load_dataset(paths: str | Path | list[str | Path], tokenizer, cfg: DatasetConfig | None = None,
                 keys: RowKeys = RowKeys(), budget: PromptBudget = PromptBudget(),
                 custom_reward: bool = False) -> LoadedDataset:
    """Read every row of the given files into records (see the module docstring). Without `custom_reward`, a row
    whose data source has no built-in scorer (or whose ground truth it cannot read) is a bad row."""
    cfg = cfg or DatasetConfig()
    paths = [Path(p).expanduser() for p in ([paths] if isinstance(paths, (str, Path)) else paths)]
    context_limit = budget.context_limit()
    if context_limit is not None and context_limit < 1:
        raise UserError(f"the model's context of {budget.context_tokens} tokens leaves no room for a prompt after "
                        f"the {budget.response_tokens}-token response budget")
    limit, why = _limit(cfg, context_limit, budget)
    out = LoadedDataset()
    seen: set[str] = set()
    for path, tag in zip(paths, _file_tags(paths)):
        rows: list[tuple[str, str, str, ParsedRow]] = []  # (where, id, text, row)
        for i, row in read_rows(path):
            where = f"{path}: row {i}"
            try:
                parsed = parse_row(row, where, cfg.default_data_source, keys)
                rid = f"{tag}/{parsed.id if parsed.id is not None else i}"
                if rid in seen:
                    raise BadRow(f"{where}: field 'id' repeats {rid!r}")
                if not custom_reward:
                    try:
                        check_row(parsed.data_source, parsed.ground_truth)
                    except ValueError as err:
                        raise BadRow(f"{where}: field {keys.reward_fn_key!r}: {err}") from None
                text = render_prompt(parsed.prompt, tokenizer, cfg)
            except BadRow as e:
                if not cfg.skip_bad_rows:
                    raise
                out.bad_rows += 1
                if len(out.errors) < 10:
                    out.errors.append(str(e))
                continue
            seen.add(rid)
            rows.append((where, rid, text, parsed))
        # One tokenizer call per file: a fast tokenizer encodes the batch in parallel.
        all_ids = tokenizer([r[2] for r in rows], add_special_tokens=False).input_ids if rows else []
        for (where, rid, text, parsed), ids in zip(rows, all_ids):
            if limit is not None and len(ids) > limit:
                if cfg.overlong in ("error", "keep"):  # 'keep' has only the context's limit, which cannot be kept
                    raise BadRow(f"{where}: field {keys.prompt_key!r} has {len(ids)} tokens > {why}")
                if cfg.overlong == "filter":
                    out.overlong_rows += 1
                    continue
                if cfg.overlong == "truncate_left":
                    out.overlong_rows += 1
                    ids = ids[-limit:]
                    text = tokenizer.decode(ids)
            out.records.append(Prompt(rid, tuple(ids), parsed.ground_truth, parsed.data_source, text,
                                      extra_info=parsed.extra_info))
    return out


def _limit(cfg: DatasetConfig, context_limit: int | None, budget: PromptBudget) -> tuple[int | None, str]:
    """The prompt length limit in tokens and how to name it in a message."""
    own = None if cfg.overlong == "keep" else cfg.max_prompt_tokens
    if context_limit is not None and (own is None or context_limit < own):
        return context_limit, (f"{context_limit}, what the model's context of {budget.context_tokens} tokens leaves "
                               f"after the {budget.response_tokens}-token response budget")
    return own, f"max_prompt_tokens {cfg.max_prompt_tokens}"


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
    raise UserError(f"data.name = {name!r}: not 'synthetic', 'synthetic_addition' (the built-in tasks), a dataset "
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
    'synthetic_addition' (one addition, the easy task); a folder with train/test files, 'train.jsonl,test.jsonl',
    or one file (then nothing is held out). With model.path empty the tiny base model is pretrained for the
    built-in task named."""
    prompt_key: str = "prompt"
    """The field of a verl-layout row that holds the prompt (verl's data.prompt_key)."""
    reward_fn_key: str = "data_source"
    """The field whose value picks a row's reward function (verl's data.reward_fn_key)."""
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
            return [Path(p).expanduser() for p in self.train_files], [Path(p).expanduser() for p in self.val_files]
        from treepo_ray.data.synthetic import TASKS

        if self.name in TASKS:
            train, test = synthetic_files(cache_dir, self.seed, *synthetic_rows, task=self.name)
            return [train], [test]
        return _split_files(self.name)


def load_records(data_cfg: DataConfig, tokenizer, cache_dir: str | Path = ".cache/treepo-ray",
                 synthetic_rows: tuple[int, int] = (SYNTHETIC_TRAIN_ROWS, SYNTHETIC_TEST_ROWS),
                 budget: PromptBudget = PromptBudget(), custom_reward: bool = False
                 ) -> tuple[list[Prompt], list[Prompt]]:
    """Training and held-out records of the files `data_cfg` names (the synthetic task's are written first:
    `synthetic_rows` problems seeded by data_cfg.seed, cached under `cache_dir`). Bad and overlong rows raise or
    are counted as data_cfg.prompt says; see load_dataset for `budget` and `custom_reward`."""
    train_files, test_files = data_cfg.files(cache_dir, synthetic_rows)
    keys = RowKeys(data_cfg.prompt_key, data_cfg.reward_fn_key)
    load = lambda files: load_dataset(files, tokenizer, data_cfg.prompt, keys, budget, custom_reward)  # noqa: E731
    train_set = load(train_files)
    test_set = load(test_files) if test_files else LoadedDataset()
    for split, loaded in (("train", train_set), ("test", test_set)):
        if loaded.bad_rows or loaded.overlong_rows:  # skipped rows are counted out loud, never silently
            first = f"; first: {loaded.errors[0]}" if loaded.errors else ""
            print(f"data: {split} split: {loaded.bad_rows} bad rows skipped, {loaded.overlong_rows} over the prompt "
                  f"length limit{first}", file=sys.stderr)
    if not train_set.records:
        raise UserError(f"data: the training set is empty ({len(train_files)} file(s), {train_set.bad_rows} bad rows "
                        f"and {train_set.overlong_rows} over the prompt length limit skipped)")
    return train_set.records, test_set.records
