"""A math-verify worker process: reads JSON lines {"i", "pred", "gold"} and answers {"i", "ok"}.

Run as `python -m treepo_ray.rewards._math_worker MEMORY_MB`. It bounds its own address space, so a
pathological answer ends in MemoryError (answered as not equal) instead of swapping; a hang is ended by the
parent, which kills this process at the item's deadline. Model output is parsed, never executed.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import sys


def symbolic_equal(pred: str, gold: str) -> bool:
    """math-verify's equivalence of two answer strings (each read as the content of a `\\boxed{}`)."""
    from math_verify import parse, verify

    # Timeouts off: math-verify's own use signal.alarm, which C-level sympy loops ignore; the parent kills us instead.
    gold_parsed = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def main() -> None:
    memory_mb = int(sys.argv[1])
    if memory_mb > 0:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # The protocol owns the original stdout; anything a library prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    logging.getLogger("math_verify").setLevel(logging.CRITICAL)
    logging.getLogger("latex2sympy2_extended").setLevel(logging.CRITICAL)
    symbolic_equal("1", "1")  # import sympy and the parsers before announcing readiness
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        item = json.loads(line)
        try:
            ok = symbolic_equal(item["pred"], item["gold"])
        except (Exception, MemoryError, RecursionError):
            ok = False
        out.write(json.dumps({"i": item["i"], "ok": ok}) + "\n")


if __name__ == "__main__":
    main()
