"""The synthetic tasks, by name, and the easy one: multi-digit addition, worked column by column.

Two tasks are built in (data.name selects one; both are offline and exactly verified):

- `synthetic` (the default): running sums of 3 to 5 numbers, several dependent steps, 135-251 tokens
  (data/chain.py);
- `synthetic_addition`: one addition of two 3-digit numbers, about 40 tokens (this module).

Both write questions as `Q: a+b+...` and answer with the sum in `\\boxed{}`; they share the held-out split below.

The addition task:

A problem and its worked solution look like this (one line per digit column, least significant first, each
line `digits + carry-in = two-digit column sum`, whose tens digit is the next column's carry-in):

    Q: 457+386
    7+6+0=13
    5+8+1=14
    4+3+1=08
    \\boxed{843}

The step format is what makes it learnable: a small model that has to write the sum at once stays near chance,
while one that writes a fixed-width line per column learns each line from the line above. `digits` (length of
each operand) and `terms` (how many operands) set the difficulty. Noisy training text drops a carry now and then
(writes 0 instead of the tens digit above it) and finishes the computation from the wrong carry, so the worked
solution stays self-consistent but its answer is wrong: a model pretrained on it has room to learn from reward.

Held-out problems never occur in training: a problem belongs to the test split iff a hash of its text falls in
one bucket, and the training generator rejects those. The task's verifier (and its `data_source`) is
treepo_ray.rewards.synthetic.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

from treepo_ray.data.chain import ChainTaskConfig, draw_operands, training_text
from treepo_ray.data.chain import question as chain_question
from treepo_ray.rewards.synthetic import CHAIN_DATA_SOURCE, DATA_SOURCE

_TEST_BUCKETS = 20  # one problem in 20 is held out

TASKS = ("synthetic", "synthetic_addition")
"""Names of the built-in tasks (data.name): running sums (the default) and the easy addition."""


@dataclass
class SyntheticTaskConfig:
    """Difficulty and noise of the addition task (the defaults are the base model's and the train job's task)."""

    digits: int = 3
    """Digits of each operand (the difficulty knob: one solution line per digit)."""
    terms: int = 2
    """Operands per problem (2..9; a column sum then stays below 100)."""
    noise: float = 0.0
    """Probability that a worked solution drops a nonzero carry (training text only)."""


@dataclass
class Problem:
    """One addition problem."""

    id: str
    """Stable id: the data source and the operands."""
    operands: list[int]
    """The numbers to add."""
    data_source: str = DATA_SOURCE
    """The task's `data_source` (routes the verifier)."""
    slots: int = 0
    """Running-sum task: the question lists the terms in this many slots (data/chain.py); 0 = `Q: a+b`."""

    @property
    def question(self) -> str:
        """The prompt text, ending with a newline so the first solution line follows."""
        if self.slots:
            return chain_question(self.operands, self.slots)
        return "Q: " + "+".join(str(x) for x in self.operands) + "\n"

    @property
    def answer(self) -> str:
        return str(sum(self.operands))


def task_config(name: str) -> ChainTaskConfig | SyntheticTaskConfig:
    """The default settings of the task called `name` (one of TASKS)."""
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; choose one of {TASKS}")
    return ChainTaskConfig() if name == "synthetic" else SyntheticTaskConfig()


def _check(cfg: SyntheticTaskConfig | ChainTaskConfig) -> None:
    if isinstance(cfg, ChainTaskConfig):
        return  # checked by its own __post_init__
    if not 1 <= cfg.digits <= 18:
        raise ValueError(f"digits must be in 1..18, got {cfg.digits}")
    if not 2 <= cfg.terms <= 9:
        raise ValueError(f"terms must be in 2..9, got {cfg.terms}")
    if not 0.0 <= cfg.noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {cfg.noise}")


def is_test_problem(question: str) -> bool:
    """Whether a problem belongs to the held-out split (a fixed hash bucket of its text)."""
    return zlib.crc32(question.encode()) % _TEST_BUCKETS == 0


def make_problems(n: int, cfg: SyntheticTaskConfig | ChainTaskConfig, seed: int | str, split: str = "train",
                  unique: bool = True) -> list[Problem]:
    """`n` random problems of the task `cfg` configures, of the given split ('train' or 'test'), deterministic in
    `seed`; distinct ones unless `unique` is off (ValueError when the split holds fewer than `n` distinct
    problems)."""
    _check(cfg)
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{seed}/{split}")
    chain = isinstance(cfg, ChainTaskConfig)
    source = CHAIN_DATA_SOURCE if chain else DATA_SOURCE
    lo, hi = (0, 0) if chain else (10 ** (cfg.digits - 1), 10**cfg.digits - 1)
    out: list[Problem] = []
    seen: set[str] = set()
    misses = 0
    while len(out) < n:
        if chain:
            p = Problem("", draw_operands(cfg, rng), source, cfg.max_terms)
        else:
            p = Problem("", [rng.randint(lo, hi) for _ in range(cfg.terms)])
        q = p.question
        if is_test_problem(q) != (split == "test") or (unique and q in seen):
            misses += 1
            if misses > 100 * n + 10_000:
                raise ValueError(f"the {split} split of {cfg} holds fewer than {n} distinct problems")
            continue
        seen.add(q)
        p.id = f"{source}/{'+'.join(map(str, p.operands))}"
        out.append(p)
    return out


def worked_solution(problem: Problem, noise: float = 0.0, rng: random.Random | None = None) -> str:
    """The step-by-step solution text (without the question), ending with `\\boxed{answer}`.

    With `noise` > 0, each nonzero carry is dropped with that probability (`rng` draws it); the remaining lines
    are computed from the carry actually written, so the boxed answer is then wrong.
    """
    if noise > 0 and rng is None:
        raise ValueError("a noisy solution needs an rng")
    columns = [str(x)[::-1] for x in problem.operands]  # least significant digit first
    width = max(len(c) for c in columns)
    lines, answer_digits, carry = [], [], 0
    for col in range(width):
        digits = [int(c[col]) if col < len(c) else 0 for c in columns]
        total = sum(digits) + carry
        lines.append("+".join(str(d) for d in digits) + f"+{carry}={total:02d}")
        answer_digits.append(str(total % 10))
        carry = total // 10
        if carry and noise > 0 and rng.random() < noise:
            carry = 0
    answer = (str(carry) if carry else "") + "".join(reversed(answer_digits))
    answer = answer.lstrip("0") or "0"
    return "\n".join(lines) + "\n\\boxed{" + answer + "}"


def pretrain_text(problem: Problem, cfg: SyntheticTaskConfig | ChainTaskConfig, rng: random.Random
                  ) -> tuple[str, str, bool]:
    """A pretraining text for `problem` as the task's noise settings make it: the prompt (the question, after a
    document prefix for the running-sum task's critique documents), the text after it, and whether it ends with
    EOS."""
    if isinstance(cfg, ChainTaskConfig):
        prefix, text, eos = training_text(problem.operands, cfg, rng)
        return prefix + problem.question, text, eos
    return problem.question, worked_solution(problem, cfg.noise, rng), True


def write_splits(
    out_dir: str | Path, cfg: SyntheticTaskConfig | ChainTaskConfig, n_train: int, n_test: int, seed: int = 0
) -> tuple[Path, Path]:
    """Write train.jsonl and test.jsonl in the plain layout ({"id", "problem", "answer", "data_source"})."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        path = out_dir / f"{split}.jsonl"
        with path.open("w") as f:
            for p in make_problems(n, cfg, seed, split):
                row = {"id": p.id, "problem": p.question, "answer": p.answer, "data_source": p.data_source}
                f.write(json.dumps(row) + "\n")
        paths.append(path)
    return paths[0], paths[1]
