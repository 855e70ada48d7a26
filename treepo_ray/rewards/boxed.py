"""Answer extraction: the last complete `\\boxed{...}` of a solution, and a plain normal form of answer strings.

Pure string functions, linear in the input's length, safe on any text (they never evaluate it).
"""

from __future__ import annotations

import re

# A box opener, or any single brace. One regex pass visits only these, so megabytes of prose cost little.
_TOKENS = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
_WHOLE_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def last_boxed(text: str, max_chars: int | None = None) -> str | None:
    """Content of the last complete `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if there is none.

    "Last" is the box whose closing brace comes last. A box holding nothing but another box is unwrapped
    (`\\boxed{\\boxed{5}}` gives `5`). A box that never closes (a truncated generation) is skipped, so an earlier
    complete one still counts. Only the final `max_chars` characters are scanned when given.
    """
    if max_chars is not None and len(text) > max_chars:
        text = text[-max_chars:]
    stack: list[tuple[int, int, bool]] = []  # (opener start, content start, is a box)
    boxes: dict[int, tuple[int, int]] = {}  # closing-brace index -> (opener start, content start) of each box
    for m in _TOKENS.finditer(text):
        if m.group() == "}":
            if not stack:
                continue  # an unmatched closing brace (or one whose opener was cut off): ignore it
            opener, start, is_box = stack.pop()
            if is_box:
                boxes[m.start()] = (opener, start)
        else:
            stack.append((m.start(), m.end(), m.group() != "{"))
    if not boxes:
        return None
    end = max(boxes)
    start = boxes[end][1]
    while True:  # unwrap \boxed{\boxed{x}}: the content is exactly one complete box
        lo, hi = _strip_span(text, start, end)
        inner = boxes.get(hi - 1)
        if inner is None or inner[0] != lo:
            return text[lo:hi]
        start, end = inner[1], hi - 1


def _strip_span(text: str, lo: int, hi: int) -> tuple[int, int]:
    """Bounds of text[lo:hi] without leading and trailing whitespace."""
    while lo < hi and text[lo].isspace():
        lo += 1
    while hi > lo and text[hi - 1].isspace():
        hi -= 1
    return lo, hi


_SPACES = re.compile(r"\s+")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_DROP = (r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", r"\ ", "$")


def normalize_answer(answer: str) -> str:
    """A plain normal form for string comparison: no spacing commands, `\\dfrac`->`\\frac`, `\\text{x}`->`x`,
    no degree sign, no trailing period, no whitespace. Two answers with the same normal form are equal."""
    s = answer.strip()
    for tok in _DROP:
        s = s.replace(tok, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = _TEXT.sub(r"\1", s)
    s = _SPACES.sub("", s)
    return s.rstrip(".")
