"""English word problems in GSM8K's form, generated offline: the built-in task `data.name: word_problems`.

Each problem is a short story with quantities and units (items, dollars, kilometers, pages, minutes) that takes two
to four operations (+, -, *, exact /) to solve (the default: two or three, numbers up to 5; see WordProblemConfig).
Its worked solution is one sentence per operation and the answer in `\\boxed{}`:

    Maya buys 3 notebooks at $4 each and 2 pens at $1 each. How many dollars does she spend?

    The notebooks cost 3 * 4 = 12 dollars.
    The pens cost 2 * 1 = 2 dollars.
    In total she spends 12 + 2 = 14 dollars.
    The answer is \\boxed{14}.

The rows are in verl's layout with `data_source: math`, so the boxed-answer math verifier scores them
(rewards/math.py), and a path stops as soon as its box closes (tree/growth.py StopRules). Each row's prompt starts
with two solved problems of other stories as earlier chat turns (`few_shot`): SmolLM2-135M-Instruct answered 0 of
32 problems greedily with the format explained in a system prompt, 4 of 32 with it shown as turns. A problem
belongs to the held-out split iff a hash of its text falls in one bucket of 20, and the training split never holds
it (as for the synthetic tasks). Numbers stay small (the task is for a 135M-parameter model on a CPU):
`WordProblemConfig` sets how many operations and how large.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

DATA_SOURCE = "math"
"""Scored by the boxed-answer math verifier (rewards/math.py)."""
TASK = "word_problems"
"""The task's data.name."""
_TEST_BUCKETS = 20

_NAMES = [("Maya", "she", "her"), ("Liam", "he", "his"), ("Sofia", "she", "her"), ("Noah", "he", "his"),
          ("Ava", "she", "her"), ("Ethan", "he", "his"), ("Chloe", "she", "her"), ("Lucas", "he", "his"),
          ("Emma", "she", "her"), ("Omar", "he", "his"), ("Priya", "she", "her"), ("Ben", "he", "his"),
          ("Hana", "she", "her"), ("Diego", "he", "his"), ("Zoe", "she", "her"), ("Sam", "he", "his")]
_ITEMS = ["apples", "stickers", "marbles", "cards", "shells", "stamps", "books", "pencils", "cookies", "beads"]
_GOODS = [("notebooks", "notebook"), ("pens", "pen"), ("apples", "apple"), ("cups", "cup"), ("toys", "toy"),
          ("shirts", "shirt"), ("books", "book"), ("plants", "plant")]
_VEHICLES = ["car", "bus", "train", "truck", "boat"]


@dataclass
class WordProblemConfig:
    """How hard the problems are."""

    min_ops: int = 2
    """Fewest operations a solution takes."""
    max_ops: int = 3
    """Most operations a solution takes."""
    max_number: int = 5
    """Largest quantity in a problem's text (prices, counts, speeds; totals grow from them)."""
    shots: int = 2
    """Solved examples (training problems of other stories) put before each problem as earlier chat turns."""

    def __post_init__(self) -> None:
        if not 2 <= self.min_ops <= self.max_ops <= 4:
            raise ValueError(f"need 2 <= min_ops <= max_ops <= 4, got {self.min_ops}..{self.max_ops}")
        if not 0 <= self.shots <= len(_STORIES) - 1:
            raise ValueError(f"shots must be in 0..{len(_STORIES) - 1}, got {self.shots}")
        if not 4 <= self.max_number <= 1000:
            raise ValueError(f"max_number must be in 4..1000, got {self.max_number}")


@dataclass
class WordProblem:
    """One problem: the question, its worked solution's steps and the answer."""

    question: str
    steps: list[str]
    """One sentence per operation, each with its `a op b = c`."""
    answer: int

    @property
    def solution(self) -> str:
        """The worked solution as GSM8K writes it: the steps, then `#### answer`."""
        return "\n".join(self.steps) + f"\nThe answer is \\boxed{{{self.answer}}}."


def _shopping(rng: random.Random, ops: int, top: int) -> WordProblem:
    name, pron, _ = rng.choice(_NAMES)
    (g1, one1), (g2, one2) = rng.sample(_GOODS, 2)
    a, p, b, q = (rng.randint(2, top) for _ in range(4))
    cost1, cost2 = a * p, b * q
    if ops == 2:  # one kind of good, and change from a bill
        bill = _bill(cost1, rng)
        return WordProblem(f"{name} buys {a} {g1} at ${p} each and pays with a ${bill} bill. How many dollars of "
                           f"change does {pron} get?",
                           [f"The {g1} cost {a} * {p} = {cost1} dollars.",
                            f"The change is {bill} - {cost1} = {bill - cost1} dollars."], bill - cost1)
    question = f"{name} buys {a} {g1} at ${p} each and {b} {g2} at ${q} each."
    steps = [f"The {g1} cost {a} * {p} = {cost1} dollars.", f"The {g2} cost {b} * {q} = {cost2} dollars.",
             f"In total {pron} spends {cost1} + {cost2} = {cost1 + cost2} dollars."]
    if ops == 3:
        return WordProblem(question + f" How many dollars does {pron} spend?", steps, cost1 + cost2)
    bill = _bill(cost1 + cost2, rng)
    steps.append(f"The change is {bill} - {cost1 + cost2} = {bill - cost1 - cost2} dollars.")
    return WordProblem(question + f" {pron.capitalize()} pays with a ${bill} bill. How many dollars of change does "
                       f"{pron} get?", steps, bill - cost1 - cost2)


def _bill(cost: int, rng: random.Random) -> int:
    """A bill (or a few of them) that covers `cost` with some change left."""
    for bill in (10, 20, 50, 100, 200, 500, 1000):
        if bill > cost:
            return bill if rng.random() < 0.7 or bill == 1000 else bill * 2
    return (cost // 1000 + 1) * 1000


def _collection(rng: random.Random, ops: int, top: int) -> WordProblem:
    (name, pron, _), (friend, *_), (other, *_) = rng.sample(_NAMES, 3)
    obj = "her" if pron == "she" else "him"
    item = rng.choice(_ITEMS)
    a, b, k = rng.randint(top, 4 * top), rng.randint(2, 2 * top), rng.randint(2, 6)
    have = rng.randint(1, a + b - 1)
    if ops > 2:  # the rest is shared out into k boxes: it must divide
        have = k * rng.randint(1, (a + b - 1) // k)
    c = a + b - have
    question = f"{name} has {a} {item}. {friend} gives {obj} {b} more {item}, and {name} gives {c} {item} to {other}."
    steps = [f"After {friend}'s gift, {name} has {a} + {b} = {a + b} {item}.",
             f"After giving some to {other}, {pron} has {a + b} - {c} = {have} {item}."]
    if ops == 2:
        return WordProblem(question + f" How many {item} does {name} have now?", steps, have)
    question += f" Then {pron} puts the rest into {k} boxes, the same number in each."
    steps.append(f"Each of the {k} boxes gets {have} / {k} = {have // k} {item}.")
    if ops == 3:
        return WordProblem(question + f" How many {item} are in each box?", steps, have // k)
    price = rng.randint(2, top)
    steps.append(f"One box sells for {have // k} * {price} = {have // k * price} dollars.")
    return WordProblem(question + f" {pron.capitalize()} sells each of the {item} in a box for ${price}. How many "
                       f"dollars does one box bring?", steps, have // k * price)


def _travel(rng: random.Random, ops: int, top: int) -> WordProblem:
    vehicle = rng.choice(_VEHICLES)
    s1, h1, s2, h2 = rng.randint(2, 2 * top) * 5, rng.randint(2, 5), rng.randint(2, 2 * top) * 5, rng.randint(1, 4)
    d1, d2 = s1 * h1, s2 * h2
    if ops == 2:
        extra = rng.randint(2, 4 * top)
        return WordProblem(f"A {vehicle} travels at {s1} kilometers per hour for {h1} hours, then {extra} more "
                           f"kilometers. How many kilometers does it travel in total?",
                           [f"In the first part it travels {s1} * {h1} = {d1} kilometers.",
                            f"In total it travels {d1} + {extra} = {d1 + extra} kilometers."], d1 + extra)
    question = (f"A {vehicle} travels at {s1} kilometers per hour for {h1} hours, then at {s2} kilometers per hour "
                f"for {h2} hours.")
    steps = [f"In the first part it travels {s1} * {h1} = {d1} kilometers.",
             f"In the second part it travels {s2} * {h2} = {d2} kilometers.",
             f"In total it travels {d1} + {d2} = {d1 + d2} kilometers."]
    if ops == 3:
        return WordProblem(question + " How many kilometers does it travel in total?", steps, d1 + d2)
    trip = d1 + d2 + rng.randint(1, 10) * 10
    steps.append(f"It still has {trip} - {d1 + d2} = {trip - d1 - d2} kilometers to go.")
    return WordProblem(question + f" The whole trip is {trip} kilometers. How many kilometers are left?", steps,
                       trip - d1 - d2)


def _baking(rng: random.Random, ops: int, top: int) -> WordProblem:
    name, pron, _ = rng.choice(_NAMES)
    trays, per = rng.randint(2, 6), rng.randint(3, top)
    total = trays * per
    eaten = rng.randint(1, total - 2)
    left = total - eaten
    question = f"{name} bakes {trays} trays of cookies with {per} cookies on each tray. {pron.capitalize()} eats " \
               f"{eaten} of them."
    steps = [f"{name} bakes {trays} * {per} = {total} cookies.",
             f"After eating some, {total} - {eaten} = {left} cookies are left."]
    if ops == 2:
        return WordProblem(question + " How many cookies are left?", steps, left)
    bag = rng.randint(2, 6)
    left = bag * max(1, (total - 1) // bag - rng.randint(0, 2))
    eaten = total - left
    question = f"{name} bakes {trays} trays of cookies with {per} cookies on each tray. {pron.capitalize()} eats " \
               f"{eaten} of them and puts the rest into bags of {bag}."
    steps = [f"{name} bakes {trays} * {per} = {total} cookies.",
             f"After eating some, {total} - {eaten} = {left} cookies are left.",
             f"That fills {left} / {bag} = {left // bag} bags."]
    if ops == 3:
        return WordProblem(question + " How many bags does " + pron + " fill?", steps, left // bag)
    price = rng.randint(2, top)
    steps.append(f"Selling them brings {left // bag} * {price} = {left // bag * price} dollars.")
    return WordProblem(question + f" {pron.capitalize()} sells each bag for ${price}. How many dollars does {pron} "
                       f"get?", steps, left // bag * price)


def _savings(rng: random.Random, ops: int, top: int) -> WordProblem:
    name, pron, _ = rng.choice(_NAMES)
    a, weeks = rng.randint(2, 2 * top), rng.randint(2, 8)
    saved = a * weeks
    spend = rng.randint(1, saved - 1)
    question = f"{name} saves ${a} every week for {weeks} weeks. Then {pron} spends ${spend} on a game."
    steps = [f"{name} saves {a} * {weeks} = {saved} dollars.",
             f"After the game, {pron} has {saved} - {spend} = {saved - spend} dollars."]
    if ops == 2:
        return WordProblem(question + f" How many dollars does {pron} have left?", steps, saved - spend)
    gift = rng.randint(2, 4 * top)
    steps.append(f"With the gift, {pron} has {saved - spend} + {gift} = {saved - spend + gift} dollars.")
    question += f" {pron.capitalize()} gets ${gift} from {pron == 'she' and 'her' or 'his'} aunt."
    if ops == 3:
        return WordProblem(question + f" How many dollars does {pron} have now?", steps, saved - spend + gift)
    now = saved - spend + gift
    friends = rng.randint(2, 4)
    keep = now - now % friends
    if keep == now:
        steps.append(f"Shared among {friends} friends, each gets {now} / {friends} = {now // friends} dollars.")
        return WordProblem(question + f" {pron.capitalize()} shares all of it equally among {friends} friends. How "
                           f"many dollars does each friend get?", steps, now // friends)
    steps.append(f"{pron.capitalize()} gives away {now} - {now % friends} = {keep} dollars.")
    return WordProblem(question + f" {pron.capitalize()} keeps ${now % friends} and gives the rest away. How many "
                       f"dollars does {pron} give away?", steps, keep)


def _reading(rng: random.Random, ops: int, top: int) -> WordProblem:
    name, pron, _ = rng.choice(_NAMES)
    pages, days = rng.randint(3, 3 * top), rng.randint(2, 7)
    read = pages * days
    book = read + rng.randint(5, 10 * top)
    question = f"{name} reads {pages} pages every day for {days} days. The book has {book} pages."
    steps = [f"{name} reads {pages} * {days} = {read} pages.",
             f"There are {book} - {read} = {book - read} pages left."]
    if ops == 2:
        return WordProblem(question + " How many pages are left?", steps, book - read)
    extra = rng.randint(1, book - read)
    steps[-1:] = [f"On the last day {pron} reads {extra} more, {read} + {extra} = {read + extra} pages in all.",
                  f"There are {book} - {read + extra} = {book - read - extra} pages left."]
    question += f" On the next day {pron} reads {extra} pages."
    if ops == 3:
        return WordProblem(question + " How many pages are left?", steps, book - read - extra)
    minutes = rng.randint(2, 5)
    left = book - read - extra
    steps.append(f"Reading them takes {left} * {minutes} = {left * minutes} minutes.")
    return WordProblem(question + f" {pron.capitalize()} reads one page in {minutes} minutes. How many minutes will "
                       f"the pages left take?", steps, left * minutes)


def _garden(rng: random.Random, ops: int, top: int) -> WordProblem:
    rows, per = rng.randint(2, top), rng.randint(2, top)
    total = rows * per
    dead = rng.randint(1, total - 1)
    question = f"A garden has {rows} rows with {per} plants in each row. {dead} plants die."
    steps = [f"The garden has {rows} * {per} = {total} plants.",
             f"After {dead} die, {total} - {dead} = {total - dead} plants are left."]
    if ops == 2:
        return WordProblem(question + " How many plants are left?", steps, total - dead)
    new = rng.randint(2, 3 * top)
    steps.append(f"With the new ones there are {total - dead} + {new} = {total - dead + new} plants.")
    question += f" The gardener plants {new} new ones."
    if ops == 3:
        return WordProblem(question + " How many plants are in the garden now?", steps, total - dead + new)
    water = rng.randint(2, 5)
    now = total - dead + new
    steps.append(f"Watering them takes {now} * {water} = {now * water} liters.")
    return WordProblem(question + f" Each plant needs {water} liters of water. How many liters do all the plants "
                       f"need?", steps, now * water)


_STORIES = (_shopping, _collection, _travel, _baking, _savings, _reading, _garden)


def make_problem(rng: random.Random, cfg: WordProblemConfig) -> WordProblem:
    """One random problem (a random story, with a random number of operations in cfg's range)."""
    story = rng.choice(_STORIES)
    return story(rng, rng.randint(cfg.min_ops, cfg.max_ops), cfg.max_number)


def is_test_problem(question: str) -> bool:
    """Whether a problem belongs to the held-out split (a fixed hash bucket of its text)."""
    return zlib.crc32(question.encode()) % _TEST_BUCKETS == 0


def make_problems(n: int, cfg: WordProblemConfig, seed: int | str, split: str = "train") -> list[WordProblem]:
    """`n` distinct problems of `split` ('train' or 'test'), deterministic in `seed`."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    rng = random.Random(f"{TASK}/{seed}/{split}")
    out, seen, misses = [], set(), 0
    while len(out) < n:
        p = make_problem(rng, cfg)
        if is_test_problem(p.question) != (split == "test") or p.question in seen:
            misses += 1
            if misses > 100 * n + 10_000:
                raise ValueError(f"the {split} split of {cfg} holds fewer than {n} distinct problems")
            continue
        seen.add(p.question)
        out.append(p)
    return out


def few_shot(cfg: WordProblemConfig, seed: int | str) -> list[dict]:
    """cfg.shots solved training problems as chat turns (user: question, assistant: worked solution), each of
    another story and the first with the most operations, the same before every problem of both splits."""
    rng = random.Random(f"{TASK}/{seed}/shots")
    messages: list[dict] = []
    for story in rng.sample(_STORIES, cfg.shots):
        while True:
            p = story(rng, max(cfg.min_ops, cfg.max_ops - len(messages) // 2), cfg.max_number)
            if not is_test_problem(p.question):
                break
        messages += [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.solution}]
    return messages


def write_splits(out_dir: str | Path, cfg: WordProblemConfig, n_train: int, n_test: int, seed: int = 0
                 ) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl in verl's layout: `prompt` (the few-shot turns, then the problem), `data_source`,
    `reward_model.ground_truth`, `extra_info` (index, the worked solution)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shots, paths = few_shot(cfg, seed), []
    for split, n in (("train", n_train), ("test", n_test)):
        path = out_dir / f"{split}.jsonl"
        with path.open("w") as f:
            for i, p in enumerate(make_problems(n, cfg, seed, split)):
                row = {"prompt": shots + [{"role": "user", "content": p.question}], "data_source": DATA_SOURCE,
                       "reward_model": {"ground_truth": str(p.answer)},
                       "extra_info": {"index": i, "split": split, "solution": p.solution}}
                f.write(json.dumps(row) + "\n")
        paths.append(path)
    return paths[0], paths[1]
