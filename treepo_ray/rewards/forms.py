"""Answer forms math-verify misjudges, normalised or decided around its comparison, as a careful grader would.

Two halves. `prepare` runs in the caller's process: string rules, linear in the answer's length, that either decide a
pair at once or rewrite both answers for the symbolic comparison. `equal` runs in the bounded worker process
(rewards/_worker.py): math-verify's equivalence plus the rules that need sympy. Every rule says why in one line; the
labelled pairs in tests/rewards/answer_pairs.jsonl hold real answer formats of each kind, both ways.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

from treepo_ray.rewards.boxed import normalize_answer

# --- string rules (caller's process) ---------------------------------------------------------------------------------

# A degree mark is a unit, not part of the number: "30^\circ", "30°" and "30 degrees" all answer "30".
_DEGREES = re.compile(r"\s*(?:\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|°|\\degree\b|"
                      r"\\(?:text|mbox|mathrm)\s*\{\s*(?:°|degrees?)\s*\}|\s+degrees?\b)")
# "\text{the answer is } 5", "\text{The minimum value is } 10", "\text{the function is odd}": the lead-in is not
# part of the answer.
_LEAD_IN = re.compile(r"^(\s*\\(?:text|mbox|textbf)\s*\{)\s*(?:[A-Za-z' ]*?\s)?(?:answer\s*:|is|are|equals)\s+",
                      re.IGNORECASE)
_EMPTY_TEXT = re.compile(r"^\s*\\(?:text|mbox|textbf)\s*\{\s*\}\s*")
# A count written as a word ("\text{three}") is the number.
NUMBER_WORDS = {w: str(n) for n, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())} | {"thirty": "30", "forty": "40", "fifty": "50", "hundred": "100"}
_NUMBER_WORD = re.compile(r"^\s*\\(?:text|mbox|textbf|mathrm)\s*\{\s*([A-Za-z]+)\s*\}\s*$")
# A repeating decimal is an exact rational: 0.\overline{4} is 4/9, 0.1\overline{6} is 1/6.
_REPEATING = re.compile(r"(-?)(\d*)\.(\d*)\\overline\s*\{\s*(\d+)\s*\}")
# "All real numbers" is the whole line, (-\infty, \infty).
_ALL_REALS = re.compile(r"^\s*\\(?:text|mbox)\s*\{\s*(?:all\s+)?real\s+numbers?\s*\}\s*$"
                        r"|^\s*\\text\{\s*all\s+reals\s*\}\s*$", re.IGNORECASE)
# "5 \text{ or } 7" is two answers (a list to math-verify), not the number 5 with a remark.
_CONNECTIVE = re.compile(r"\s*(?:\\q?quad\s*)?\\(?:text|mbox|mathrm)\s*\{\s*(?:or|and)\s*\}(?:\s*\\q?quad)?\s*"
                         r"|\s+(?:or|and)\s+")
# A negated or impossible statement ("x \neq 5", "5 \text{ is impossible}") does not answer 5, though 5 is in it.
_NEGATION = re.compile(r"\\(?:neq?|not|notin|nmid)(?![a-zA-Z])|≠|\b(?:not|no|none|never|impossible|cannot|can't|"
                       r"isn't|undefined)\b", re.IGNORECASE)
_FORMAT = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
# The empty set has many spellings; math-verify knows only some, and an empty answer equals no non-empty one.
EMPTY_SET = frozenset({r"\emptyset", r"\varnothing", r"\o", r"\{\}", "∅", "emptyset", "theemptyset", "{}",
                       "nosolution", "nosolutions", "norealsolution", "norealsolutions"})
"""Spellings of the empty set, in normal form (boxed.normalize_answer), lower case."""
# An inequality bounds a value without naming it: "x > 5" or "\frac{3}{2} < t" does not answer 5 or 3/2.
_INEQUALITY = re.compile(r"<|>|≤|≥|\\[lg]e(?:q|qslant)?(?![a-zA-Z])|\\[lg]t(?![a-zA-Z])")
# A column or row vector is the ordered tuple of its entries (MATH accepts either for a vector answer).
_VECTOR = re.compile(r"\\begin\{([pb]matrix)\}(.*?)\\end\{\1\}", re.DOTALL)
# "\text{a circle}" names the same thing as "\text{circle}": an article is not part of the answer.
_ARTICLE = re.compile(r"(\\(?:text|mbox|textbf)\s*\{)\s*(?:a|an|the)\s+", re.IGNORECASE)
# "\text{No, it is not possible}" answers "No": a yes/no answer may be followed by its reason.
_YES_NO = re.compile(r"^(\s*\\(?:text|mbox|textbf)\s*\{\s*)(yes|no)\s*[,.;:!]\s*[^{}]*\}\s*$", re.IGNORECASE)
# "\text{2 solutions}" is the number 2 with a word after it, as "2 \text{ cm}" is.
_NUMBER_IN_TEXT = re.compile(r"^\s*\\(?:text|mbox)\s*\{\s*(-?\d[\d,]*(?:\.\d+)?)\s+([A-Za-z][^{}\d]*)\}\s*$")
# One top-level "=": the answer is its right side where the ground truth is a value ("f(2) = 9", "P(A) = \frac13").
# A left side of numbers only stays, so that a false equation ("2+2=5") is seen as one.
_EQUALS = re.compile(r"(?<![<>!\\])=")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
# A multiple-choice letter, alone or with its option's text: "B", "(B)", "\textbf{(B) } 8", "B) 8", "B. 8".
_CHOICE = re.compile(r"^\(([A-Ea-e])\)\s*(.*)$|^([A-Ea-e])(?:[.:)]\s*(.*)|\s+(.*)|)$", re.DOTALL)


class Prepared(NamedTuple):
    """A verdict decided by the string rules (`verdict` True/False), or None with the answers math-verify compares."""

    verdict: bool | None
    pred: str
    gold: str


def _choice(s: str) -> tuple[str, str] | None:
    """(letter, the text after it) of a multiple-choice answer, or None."""
    s = re.sub(r"~|\\[ ,;:]|\\q?quad", " ", _FORMAT.sub(r"\1", _FORMAT.sub(r"\1", s)).replace("$", ""))
    m = _CHOICE.match(" ".join(s.split()))
    if m is None:
        return None
    letter = m.group(1) or m.group(3)
    text = next((g for g in (m.group(2), m.group(4), m.group(5)) if g is not None), "")
    return letter.upper(), text.strip()


def options_of(extra_info) -> dict[str, str]:
    """A row's multiple-choice options by letter, from `extra_info["options"]`: a dict {"A": text}, or a list of texts
    in letter order, each possibly written "A) text" or "(A) text"."""
    options = extra_info.get("options") if isinstance(extra_info, dict) else None
    if isinstance(options, dict):
        return {str(k).strip("() ").upper(): str(v) for k, v in options.items()}
    if isinstance(options, (list, tuple)):
        out = {}
        for letter, text in zip("ABCDEFGH", options):
            marked = _choice(str(text))
            out[letter] = marked[1] if marked and marked[0] == letter and marked[1] else str(text)
        return out
    return {}


def _multiple_choice(pred: str, letter: str, options: dict[str, str]) -> Prepared:
    """A letter ground truth: the same letter (with the right option's text, if it gives one), or the option's text."""
    mine = _choice(pred)
    if mine is not None:
        if mine[0] != letter:
            return Prepared(False, pred, letter)
        if not mine[1] or letter not in options:
            return Prepared(True, pred, letter)
        pred = mine[1]
    elif letter not in options:
        return Prepared(False, pred, letter)  # a bare answer cannot be matched to a letter without the options
    target = options[letter]
    if normalize_answer(pred) == normalize_answer(target):
        return Prepared(True, pred, target)
    if any(normalize_answer(pred) == normalize_answer(text) for other, text in options.items() if other != letter):
        return Prepared(False, pred, target)
    return Prepared(None, pred, target)


def _vector_as_tuple(m: re.Match) -> str:
    rows = [r.strip() for r in re.split(r"\\\\", m.group(2)) if r.strip()]
    cells = rows if all("&" not in r for r in rows) else (rows[0].split("&") if len(rows) == 1 else None)
    return "(" + ", ".join(c.strip() for c in cells) + ")" if cells else m.group(0)


def _repeating_as_fraction(m: re.Match) -> str:
    sign, whole, fixed, period = m.groups()
    value = Fraction(int(whole or 0)) + Fraction(int(fixed or 0), 10 ** len(fixed))
    value += Fraction(int(period), (10 ** len(period) - 1) * 10 ** len(fixed))
    return f"{sign}\\frac{{{value.numerator}}}{{{value.denominator}}}"


def _rewrite(s: str) -> str:
    s = _EMPTY_TEXT.sub("", _LEAD_IN.sub(r"\1", s))
    word = _NUMBER_WORD.match(s)
    if word and word.group(1).lower() in NUMBER_WORDS:
        s = NUMBER_WORDS[word.group(1).lower()]
    s = r"(-\infty, \infty)" if _ALL_REALS.match(s) else _REPEATING.sub(_repeating_as_fraction, s)
    s = _NUMBER_IN_TEXT.sub(r"\1 \\text{\2}", _YES_NO.sub(r"\1\2}", s))
    s = _DEGREES.sub("", s)
    s = _ARTICLE.sub(r"\1", s)
    s = _VECTOR.sub(_vector_as_tuple, s)
    return _CONNECTIVE.sub(", ", s).strip().rstrip(".").rstrip()  # a sentence's full stop inside the box


def _bracket(s: str, bare_list: bool = False) -> str | None:
    """'set' for a set written out in braces (or, with `bare_list`, a list of values such as "2, 4": MATH's way to
    give all the solutions), 'tuple' for a parenthesised or bracketed pair, interval or tuple."""
    n = normalize_answer(s)
    if n.startswith(r"\{") and n.endswith(r"\}") and not re.search(r":|\||\\mid", n):
        return "set"
    if n[:1] in "([" and n[-1:] in ")]":
        return "tuple"
    plain_values = "," in n and not _THOUSANDS.match(n) and not _EQUALS.search(n) and not _INEQUALITY.search(n)
    return "set" if bare_list and plain_values else None


def _balanced(s: str) -> bool:
    return s.count("{") == s.count("}") and s.count("(") == s.count(")") and s.count("[") == s.count("]")


def prepare(pred: str, gold: str, options: dict[str, str] | None = None) -> Prepared:
    """The string rules on one (answer, ground truth) pair, both already out of their boxes."""
    gold_choice = _choice(gold)
    if gold_choice is not None and not gold_choice[1] and re.fullmatch(r"[(\s]*[A-E][)\s]*", normalize_answer(gold)):
        return _multiple_choice(pred, gold_choice[0], options or {})
    pred, gold = _rewrite(pred), _rewrite(gold)
    sides = _EQUALS.split(pred)
    if len(sides) == 2 and not _EQUALS.search(gold) and re.search(r"[A-Za-z]", sides[0]) and _balanced(sides[0]):
        pred = sides[1].strip()
    if normalize_answer(pred) == normalize_answer(gold):
        return Prepared(True, pred, gold)
    empty = (normalize_answer(pred).lower() in EMPTY_SET, normalize_answer(gold).lower() in EMPTY_SET)
    if any(empty):
        return Prepared(all(empty), pred, gold)
    if _NEGATION.search(_FORMAT.sub(r" \1 ", pred)) and not _NEGATION.search(_FORMAT.sub(r" \1 ", gold)):
        return Prepared(False, pred, gold)
    if _INEQUALITY.search(pred) and not _INEQUALITY.search(gold) and _bracket(gold) is None and r"\infty" not in gold:
        return Prepared(False, pred, gold)
    # A set is unordered and discrete, a tuple ordered, an interval continuous: {1,2} is neither (1,2) nor [1,2].
    if {_bracket(pred), _bracket(gold, bare_list=True)} == {"set", "tuple"}:
        return Prepared(False, pred, gold)
    return Prepared(None, pred, gold)


# --- sympy rules (bounded worker process) ----------------------------------------------------------------------------


def _parsed(answer: str):
    """math-verify's parse of an answer (the content of a box), [] when it cannot be read."""
    from math_verify import parse

    # Timeouts off: math-verify's use signal.alarm, which C-level sympy loops ignore; the worker is killed instead.
    return parse("\\boxed{" + answer + "}", parsing_timeout=None)


def _false_equation(expr) -> bool:
    """An equation between two constants that do not agree ("2+2=5"): a false statement answers nothing."""
    import sympy

    if not isinstance(expr, sympy.Equality) or not (expr.lhs.is_number and expr.rhs.is_number):
        return False
    return sympy.simplify(expr.lhs - expr.rhs) != 0


def _complex_equal(a, b) -> bool:
    """Read `i` as the imaginary unit when it is the only letter in either answer: "i^2" is -1, "(1+i)^2" is 2i."""
    import sympy

    if not isinstance(a, sympy.Expr) or not isinstance(b, sympy.Expr):
        return False
    names = {s.name for s in a.free_symbols | b.free_symbols}
    if names != {"i"}:
        return False
    unit = {s: sympy.I for s in a.free_symbols | b.free_symbols}
    return sympy.simplify(sympy.expand(a.subs(unit) - b.subs(unit))) == 0


def _inequalities(expr) -> bool:
    """Whether an answer is inequalities: one, a chain ("1 \\le x < 3"), or a list of alternatives ("x<1, x>2")."""
    import sympy
    from sympy.core.relational import Relational

    if isinstance(expr, sympy.FiniteSet):
        return len(expr) > 0 and all(_inequalities(e) for e in expr)
    if isinstance(expr, (sympy.And, sympy.Or)):
        return all(_inequalities(e) for e in expr.args)
    return isinstance(expr, Relational) and not isinstance(expr, (sympy.Eq, sympy.Ne))


def _as_set(expr):
    """Inequalities in one variable as the set they describe ("x \\le 2" is (-oo, 2]; a list is their union); a set
    as itself; else None."""
    import sympy

    if _inequalities(expr) and len(expr.free_symbols) == 1:
        if isinstance(expr, sympy.FiniteSet):
            return sympy.Union(*(e.as_set() for e in expr))
        return expr.as_set()
    return expr if isinstance(expr, sympy.Set) else None


def _set_equal(a, b) -> bool:
    """Inequalities against an interval, or against other inequalities, compared as the sets they describe."""
    if not (_inequalities(a) or _inequalities(b)):
        return False
    sa, sb = _as_set(a), _as_set(b)
    return sa is not None and sb is not None and bool(sa == sb)


def equal(pred: str, gold: str) -> bool:
    """Whether an answer equals the ground truth: math-verify, then the sympy rules above where it says no."""
    from math_verify import verify

    gold_parsed, pred_parsed = _parsed(gold), _parsed(pred)
    if not gold_parsed or not pred_parsed:
        return False
    if _false_equation(pred_parsed[0]):
        return False
    if verify(gold_parsed, pred_parsed, timeout_seconds=None):
        return True
    a, b = pred_parsed[0], gold_parsed[0]
    return _complex_equal(a, b) or _set_equal(a, b)
