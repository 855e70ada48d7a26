"""GSM8K's verifier, as verl scores `openai/gsm8k`: the last `#### <number>` of the solution against the ground truth.

Strict like verl's default: only the final 300 characters are searched, the answer must follow `#### ` (one space)
and be digits with optional sign, commas and decimal point; commas and `$` are dropped, and the result must equal the
ground truth string exactly ("72" is not "72.0"). A solution without `####` scores wrong.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300
"""Only the solution's last this-many characters are searched (verl: the answer is at the end)."""
_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_answer(solution: str) -> str | None:
    """The number after the last `#### ` in the solution's tail, without commas or `$`; None if there is none."""
    found = _ANSWER.findall(solution[-TAIL_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def score(solution: str, ground_truth) -> dict:
    """{"score", "acc", "pred"} (score 1/0) of one solution against a ground truth string or number."""
    pred = extract_answer(solution)
    ok = pred is not None and pred == str(ground_truth).strip()
    return {"score": float(ok), "acc": float(ok), "pred": pred or ""}
