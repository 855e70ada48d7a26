"""The default synthetic task: running sums of 3 to 5 three-digit numbers, worked step by step, column by column.

A problem and its worked solution:

    Add up: 457+386+192+...+...     the terms, in 5 slots ('...' = empty), after one of a few instructions
    =0457                           the running sum, 4 digits
    386+192+...+...                 the terms still to add, in 4 slots; the first one is added now
    7+6+0=13                        one line per digit column, least significant first:
    5+8+1=14                        digit of the sum + digit of the term + carry-in = two-digit column sum,
    4+3+1=08                        whose tens digit is the next column's carry-in
    0+0+0=00
    =0843                           the new running sum
    192+...+...+...                 the list again, shifted by one slot
    3+2+0=05
    4+9+0=13
    8+1+1=10
    0+0+1=01
    =1035
    \\boxed{1035}                   no term left: the answer

A step is 58 tokens (one token per character under the tiny model's byte tokenizer); a solution is 133 to 250 tokens
for 3 to 5 terms, so paths of problems with fewer terms finish earlier. Prompts are 23 to 38 tokens (the
instruction varies), so a path that runs on meets a prompt + response context limit at different depths. The steps depend on each other:
a slip in an early step changes every later running sum, so the path is lost. The layout is fixed-width on
purpose: everything a line needs sits at a fixed distance above it (the list is carried along rather than looked up
in the question), which a two-layer model learns within a few hundred pretraining steps.

Training text (the base model's pretraining) is deliberately imperfect, so a base model has room to learn from
reward: a nonzero carry is dropped now and then (the rest of the solution stays self-consistent, the answer is
wrong), and a few solutions ramble (go on with invented terms and never answer), repeat a line until cut off, or
give up (end without an answer). Part of the text teaches the critique format of CATPO's healing prompts
(healing/prompts.yaml), in documents that start with `Check: ` (so a policy answering a plain question never
drifts into it): a partial solution, a one-line critique naming the first wrong step, and the corrected
continuation, without slips, from the question restated:

    Check: Add up: 457+386+192+...+...
    =0457
    386+192+...+...
    7+6+0=13
    5+8+0=13
    4+3+1=0                         <- the partial solution, cut anywhere (here after a dropped carry)
    ? step 1 drops a carry          <- the critique: the first step with a slip, or the unfinished one
    Add up: 457+386+192+...+...     <- the question again, then the corrected solution
    =0457
    386+192+...+...
    7+6+0=13
    5+8+1=14
    ...
    \\boxed{1035}

Restating the question keeps every line of the corrected solution at the same distance from what it copies as in a
plain solution (a tiny model learns fixed distances fast and content lookups slowly), whatever the partial
solution before it.

Held-out problems never occur in training (the hash split of data/synthetic.py). The verifier is
treepo_ray.rewards.synthetic (the last boxed integer, exactly).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

CHECK = "Check: "
"""Starts a critique document (before the question): the critique format appears only after it, so a policy
sampling a plain question never switches into it."""
CRITIQUE_CUE = "\n? "
"""Starts the critique line after a (partial) solution."""
REFINE_CUE = "\n"
"""Ends the critique line; the corrected solution follows, from the question restated (so every line it copies
sits at the same distance as in a plain solution, whatever the length of the partial solution before)."""
EMPTY = "..."
"""An empty slot of the term lists."""
COLUMNS = 4
"""Digit columns of every step (a sum of up to 9 three-digit terms has at most 4 digits)."""
INSTRUCTIONS = ("Q", "Sum", "Add", "Total", "Add up", "Add these", "Find the sum", "Work out the sum")
"""How a question starts (picked by a hash of the terms); the list of terms always ends the prompt."""


@dataclass
class ChainTaskConfig:
    """How many terms the running-sum problems have, and how imperfect the pretraining text is."""

    min_terms: int = 3
    """Fewest terms (steps = terms - 1)."""
    max_terms: int = 5
    """Most terms; also the number of slots of the question's list."""
    carry_noise: float = 0.1
    """Training text: probability that a nonzero carry is dropped (written as 0, the rest computed from it); at
    0.1 about 63% of the plain solutions are right (38% at 0.2, the default before: measured on a 2-vCPU Xeon,
    0.1 learns the layout by the same step, its base model follows critiques far more often (CATPO healed 0.81 of
    dead-wrong trees against 0.47-0.53) and pretraining needs fewer checks past 500 steps)."""
    ramble: float = 0.02
    """Training text: share of solutions that go on after their last step with invented terms and never answer."""
    repeat: float = 0.02
    """Training text: share of solutions that repeat one line until the text is cut off."""
    give_up: float = 0.02
    """Training text: share of solutions that end (EOS) after a step, without an answer."""
    critique: float = 0.2
    """Training text: share of texts in the critique format (partial solution, critique, corrected continuation)."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_terms <= self.max_terms <= 9:
            raise ValueError(f"need 2 <= min_terms <= max_terms <= 9, got {self.min_terms}, {self.max_terms}")
        for name in ("carry_noise", "ramble", "repeat", "give_up", "critique"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.ramble + self.repeat + self.give_up > 1.0:
            raise ValueError("ramble + repeat + give_up must be <= 1")


def draw_operands(cfg: ChainTaskConfig, rng: random.Random) -> list[int]:
    return [rng.randint(100, 999) for _ in range(rng.randint(cfg.min_terms, cfg.max_terms))]


def slots(terms: list[int], n: int) -> str:
    """`n` slots: the terms, then empty ones."""
    return "+".join([str(t) for t in terms[:n]] + [EMPTY] * (n - min(len(terms), n)))


def question(operands: list[int], max_terms: int) -> str:
    instruction = INSTRUCTIONS[zlib.crc32(repr(operands).encode()) % len(INSTRUCTIONS)]
    return f"{instruction}: " + slots(operands, max_terms) + "\n"


@dataclass
class Step:
    """One worked addition: running sum + the first term of `rest`, column by column."""

    left: int
    rest: list[int]
    """The terms still to add when the step starts (the first is added now)."""
    lines: list[str]
    result: int
    slips: list[int]
    """Columns whose carry-in was dropped."""

    def text(self, width: int) -> str:
        return slots(self.rest, width) + "\n" + "".join(line + "\n" for line in self.lines) + f"={self.result:04d}\n"


def add_step(left: int, rest: list[int], drop) -> Step:
    """Column-wise `left + rest[0]`; `drop()` says whether a nonzero carry is dropped (the rest follows from it)."""
    a, b = f"{left:04d}"[::-1], f"{rest[0]:04d}"[::-1]
    lines, digits, slips, carry = [], [], [], 0
    for col in range(COLUMNS):
        if carry and drop():
            carry = 0
            slips.append(col)
        total = int(a[col]) + int(b[col]) + carry
        lines.append(f"{a[col]}+{b[col]}+{carry}={total:02d}")
        digits.append(str(total % 10))
        carry = total // 10
    return Step(left, list(rest), lines, int("".join(reversed(digits))), slips)


def work(operands: list[int], drop=lambda: False, start: int = 0, left: int | None = None) -> list[Step]:
    """The steps of the solution from step `start` (0-based), the running sum entering it being `left`."""
    total = operands[0] if left is None else left
    steps = []
    for k in range(start + 1, len(operands)):
        step = add_step(total, operands[k:], drop)
        steps.append(step)
        total = step.result
    return steps


def render(left: int, steps: list[Step], width: int, answer: bool = True) -> str:
    """`=left`, the steps, and (with `answer`) the boxed result."""
    out = f"={left:04d}\n" + "".join(s.text(width) for s in steps)
    return out + ("\\boxed{" + str(steps[-1].result) + "}" if answer else "")


def solution_text(operands: list[int], max_terms: int = 5) -> str:
    """The correct worked solution (without the question), ending with the boxed answer."""
    return render(operands[0], work(operands), max_terms - 1)


def _dropper(p: float, rng: random.Random):
    return lambda: p > 0 and rng.random() < p


def training_text(operands: list[int], cfg: ChainTaskConfig, rng: random.Random) -> tuple[str, str, bool]:
    """One pretraining text: what goes before the question (CHECK for a critique document, else nothing), the text
    after the question, and whether it ends with EOS (a text cut off mid-way does not)."""
    if rng.random() < cfg.critique:
        return CHECK, critique_example(operands, cfg, rng), True
    return ("", *_solution_text(operands, cfg, rng))


def _solution_text(operands: list[int], cfg: ChainTaskConfig, rng: random.Random) -> tuple[str, bool]:
    width = cfg.max_terms - 1
    steps = work(operands, _dropper(cfg.carry_noise, rng))
    u = rng.random()
    if u < cfg.ramble:  # invented terms after the last one, never an answer
        more = [rng.randint(100, 999) for _ in range(4)]
        extra = work([steps[-1].result] + more, _dropper(cfg.carry_noise, rng))
        return render(operands[0], steps + extra, width, answer=False), False
    if u < cfg.ramble + cfg.repeat:  # one line over and over
        k = rng.randrange(len(steps))
        head = render(operands[0], steps[:k], width, answer=False) if k else f"={operands[0]:04d}\n"
        return head + slots(steps[k].rest, width) + "\n" + (rng.choice(steps[k].lines) + "\n") * 30, False
    if u < cfg.ramble + cfg.repeat + cfg.give_up:  # stop after a step, unanswered
        k = rng.randrange(len(steps))
        return render(operands[0], steps[:k], width, answer=False) if k else f"={operands[0]:04d}\n", True
    return render(operands[0], steps, width), True


def critique_example(operands: list[int], cfg: ChainTaskConfig, rng: random.Random) -> str:
    """After `CHECK` and the question: a partial solution (cut anywhere, often after a slip, empty now and then as
    when a whole tree failed), the critique naming the first wrong (or the unfinished) step, then the question
    again and its solution without slips."""
    width = cfg.max_terms - 1
    steps = work(operands, _dropper(max(cfg.carry_noise, 0.3), rng))
    full = render(operands[0], steps, width, answer=False)
    cut = 0 if rng.random() < 0.3 else rng.randint(0, len(full))
    # The step named: the first whose visible part shows a slip (the carry-in is the 5th character of a column
    # line), else the step the cut falls in.
    start = 6  # after the first `=dddd` line
    named, verdict = len(steps) - 1, "is unfinished"
    for k, s in enumerate(steps):
        line0 = start + len(slots(s.rest, width)) + 1
        if any(line0 + 9 * col + 4 < cut for col in s.slips):
            named, verdict = k, "drops a carry"
            break
        start += len(s.text(width))
        if cut < start:
            named = k
            break
    critique = f"step {named + 1} {verdict}"
    return full[:cut] + CRITIQUE_CUE + critique + REFINE_CUE + question(operands, cfg.max_terms) + \
        solution_text(operands, cfg.max_terms)
