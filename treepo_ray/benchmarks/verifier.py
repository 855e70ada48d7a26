"""How often does the math verifier judge as a careful grader would, and at what cost? Accuracy per answer form on a
labelled set of (ground truth, model-style answer, verdict) pairs, beside math-verify alone, plus the time per
verification and the time to kill pathological inputs.

    treepo-ray bench verifier [--pairs FILE] [--timeout-s S] [--json PATH]

The pairs file holds one JSON object per line: category, gold, answer (a whole final answer, boxed), verdict (what a
grader says), optionally options (a multiple-choice row's options by letter) and note. The default is the project's
own set, tests/rewards/answer_pairs.jsonl (run from the checkout). "math-verify alone" is math-verify's own use:
`verify(parse(gold), parse(answer))` with its default extraction of the answer text, in this process.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from collections import defaultdict
from pathlib import Path

from treepo_ray.benchmarks.common import write_json
from treepo_ray.config import UserError
from treepo_ray.rewards.forms import options_of
from treepo_ray.rewards.math import MathVerifier, MathVerifyConfig

DEFAULT_PAIRS = Path("tests/rewards/answer_pairs.jsonl")
PATHOLOGICAL = [  # (solution, ground truth): each must be scored wrong within the deadline, the pool going on
    (r"\boxed{10^{10^{10}}}", "5"),  # sympy tries to expand the tower: only the kill ends it
    (r"\boxed{" + "{" * 50 + "1" + "}" * 50 + "}", "1"),  # the LaTeX parser backtracks for minutes
    ("x" * 3_000_000, "843"),  # megabytes, no box
    (r"\boxed{" * 3000 + "}" * 10, "1"),  # thousands of unclosed boxes
]


def load_pairs(path: Path) -> list[dict]:
    if not path.is_file():
        raise UserError(f"no pairs file at {path} (run from the checkout, or pass --pairs FILE)")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            row = json.loads(line)
            missing = {"category", "gold", "answer", "verdict"} - set(row)
            if missing:
                raise UserError(f"{path}:{n}: missing {', '.join(sorted(missing))}")
            rows.append(row)
    return rows


def math_verify_alone(answer: str, gold: str) -> bool:
    from math_verify import parse, verify

    try:
        return bool(verify(parse("\\boxed{" + gold + "}", parsing_timeout=None), parse(answer, parsing_timeout=None),
                           timeout_seconds=None))
    except Exception:
        return False


def per_category(rows: list[dict], judged: list[bool]) -> dict:
    hits: dict[str, list[bool]] = defaultdict(list)
    for row, verdict in zip(rows, judged):
        hits[row["category"]].append(verdict == row["verdict"])
    return {cat: {"accuracy": sum(h) / len(h), "pairs": len(h)} for cat, h in sorted(hits.items())}


def run(rows: list[dict], timeout_s: float) -> dict:
    answers, golds = [r["answer"] for r in rows], [r["gold"] for r in rows]
    options = [options_of(r) or None for r in rows]
    with MathVerifier(MathVerifyConfig(timeout_s=timeout_s, num_workers=2)) as verifier:
        verifier.score_batch([r"\boxed{1}"], ["2"])  # workers up before the clock starts
        start = time.perf_counter()
        ours = [r["acc"] == 1.0 for r in verifier.score_batch(answers, golds, options)]
        batch_s = time.perf_counter() - start
        one_by_one = []
        for a, g, o in zip(answers, golds, options):
            start = time.perf_counter()
            verifier.score_batch([a], [g], [o])
            one_by_one.append(time.perf_counter() - start)
        start = time.perf_counter()
        killed = verifier.score_batch([s for s, _ in PATHOLOGICAL], [g for _, g in PATHOLOGICAL])
        pathological = {"inputs": len(PATHOLOGICAL), "seconds": time.perf_counter() - start,
                        "all_wrong": not any(r["acc"] for r in killed), "workers_killed": verifier.restarts,
                        "timeout_s": timeout_s}
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    start = time.perf_counter()
    alone = [math_verify_alone(a, g) for a, g in zip(answers, golds)]
    alone_s = time.perf_counter() - start
    accuracy = lambda judged: sum(j == r["verdict"] for j, r in zip(judged, rows)) / len(rows)  # noqa: E731
    return {
        "pairs": len(rows),
        "accuracy": accuracy(ours), "math_verify_alone_accuracy": accuracy(alone),
        "categories": per_category(rows, ours), "math_verify_alone_categories": per_category(rows, alone),
        "seconds_per_pair_batched": batch_s / len(rows),
        "seconds_per_pair_one_call_median": statistics.median(one_by_one),
        "seconds_per_pair_math_verify_alone_in_process": alone_s / len(rows),
        "pathological": pathological,
        "misjudged": [{**r, "judged": j} for r, j in zip(rows, ours) if j != r["verdict"]],
    }


def report(result: dict) -> str:
    lines = [f"{result['pairs']} pairs: verifier {result['accuracy']:.3f}, math-verify alone "
             f"{result['math_verify_alone_accuracy']:.3f}", f"  {'category':<18} {'pairs':>5} {'verifier':>9} "
             f"{'math-verify':>12}"]
    for cat, row in result["categories"].items():
        alone = result["math_verify_alone_categories"][cat]["accuracy"]
        lines.append(f"  {cat:<18} {row['pairs']:>5} {row['accuracy']:>9.3f} {alone:>12.3f}")
    p = result["pathological"]
    lines += [f"  time per pair: {1000 * result['seconds_per_pair_batched']:.1f} ms batched over 2 workers, "
              f"{1000 * result['seconds_per_pair_one_call_median']:.1f} ms one call at a time (median)",
              f"  {p['inputs']} pathological inputs: all wrong {p['all_wrong']}, {p['seconds']:.1f} s "
              f"({p['workers_killed']} workers killed at the {p['timeout_s']:g} s deadline)"]
    lines += [f"  misjudged [{m['category']}] gold {m['gold']!r} answer {m['answer']!r}: grader {m['verdict']}"
              for m in result["misjudged"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="treepo-ray bench verifier", description=__doc__.splitlines()[0],
                                 allow_abbrev=False)
    ap.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS, help=f"labelled pairs (default {DEFAULT_PAIRS})")
    ap.add_argument("--timeout-s", type=float, default=MathVerifyConfig.timeout_s,
                    help="the verifier's per-comparison deadline (default: the config's)")
    ap.add_argument("--json", default=None, help="write the result here as JSON")
    args = ap.parse_args(argv)
    result = run(load_pairs(args.pairs), args.timeout_s)
    print(report(result))
    write_json(args.json, result)
    return 0
