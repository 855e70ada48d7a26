"""A scripted stand-in for a generation engine (test input, not a mock): it answers each Ask with Segments whose
content a test chooses, deterministically, plus a tiny vocabulary and a driver loop like the real driver's."""

from __future__ import annotations

from typing import Callable

import numpy as np

from treepo_ray.tree import Ask, Grower, Segment, Tree

EOS = 0
A = 1  # decodes to "aaaa": a few of them make a repetitive segment
BOX = 2  # "\boxed{"
CLOSE = 3  # "}"
OPEN = 4  # "{"
SEVEN = 5  # "7"
VOCAB = {EOS: "<|eos|>", A: "aaaa", BOX: "\\boxed{", CLOSE: "}", OPEN: "{", SEVEN: "7"}


def decode(ids: list[int]) -> str:
    # Other ids become "<id>": distinct ids give text without long repeats.
    return "".join(VOCAB.get(t, f"<{t}>") for t in ids)


def filler(ask: Ask, j: int, length: int) -> list[int]:
    """Token ids >= 10 that depend only on the ask's seed and the child index."""
    return [int(t) for t in np.random.default_rng([ask.seed, j]).integers(10, 10**6, size=length)]


def child(ask: Ask, j: int, kind: str = "go", lp: float = -1.0) -> Segment:
    """A child of `kind`: 'go' (full length, no stop), 'eos', 'boxed' (box + EOS), 'box' (box, no EOS),
    'rep' (repetitive text), 'short' (one token, no EOS)."""
    m = ask.max_new_tokens
    if kind in ("boxed", "box") and m < 4:
        raise ValueError("the scripted boxed answers need segments of 4 tokens or more")
    if kind == "go":
        ids, reason = filler(ask, j, m), "length"
    elif kind == "eos":
        ids, reason = filler(ask, j, m - 1) + [EOS], "eos"
    elif kind == "boxed":
        ids, reason = filler(ask, j, m - 4) + [BOX, SEVEN, CLOSE, EOS], "eos"
    elif kind == "box":
        ids, reason = filler(ask, j, m - 3) + [BOX, SEVEN, CLOSE], "length"
    elif kind == "rep":
        ids, reason = [A] * m, "length"
    elif kind == "short":
        ids, reason = filler(ask, j, 1), "length"
    else:
        raise ValueError(kind)
    return Segment(ids, [lp] * len(ids), reason)


Script = Callable[[Tree, Ask, int, int], Segment]
"""(tree, ask, child index j, index k of the child among all children of this batch of asks) -> Segment."""


def drive(grower: Grower, script: Script, *, reverse: bool = False, max_batches: int = 1000) -> list[list[Ask]]:
    """Send every ready ask, answer it with `script`, feed the results back; repeat until done.

    Returns the batches of asks. Checks that no ask is returned twice. `reverse` feeds results back in reverse.
    """
    batches: list[list[Ask]] = []
    seen: set[str] = set()
    while not grower.done():
        asks = grower.asks()
        assert asks, "grower is neither done nor asking"
        assert not seen & {a.request_id for a in asks}, "an ask was returned twice"
        seen |= {a.request_id for a in asks}
        batches.append(asks)
        answers, k = [], 0
        for a in asks:
            kids = []
            for j in range(a.n):
                kids.append(script(grower.tree, a, j, k))
                k += 1
            answers.append((a.request_id, kids))
        for rid, kids in reversed(answers) if reverse else answers:
            grower.receive(rid, kids)
        assert len(batches) <= max_batches, "growth did not end"
    assert grower.asks() == []
    return batches


def by_round(plan: dict[int, dict[int, str]], default: str = "go", lp: float = -1.0) -> Script:
    """Script for TreePO, whose batches are depth rounds: plan[depth][k] is the kind of the round's k-th child."""

    def script(tree: Tree, ask: Ask, j: int, k: int) -> Segment:
        depth = tree.depth[ask.node] + 1
        return child(ask, j, plan.get(depth, {}).get(k, default), lp)

    return script
