"""Do two runs of the job train the same thing? Step by step: the trees (token for token), their rewards, and every
`actor/*` figure of the learner, from two run directories written with log.trees_per_step at least
trainer.prompts_per_step (every tree logged). For checking that a change of the code leaves training as it was:

    treepo-ray train runtime.max_staleness=0 trainer.steps=8 log.trees_per_step=16 trainer.run_dir=runs/before
    (change the code)
    treepo-ray train runtime.max_staleness=0 trainer.steps=8 log.trees_per_step=16 trainer.run_dir=runs/after
    python scripts/same_run.py runs/before runs/after

The engines' logits depend on what else a batch holds in their last bits, so two runs of the same code agree on
tokens and rewards, and on log-probs and losses only to float rounding (the largest difference is printed).
"""

import json
import sys
from pathlib import Path


def steps(run_dir: str) -> dict[int, dict]:
    """Per step: its trees' tokens, rewards and log-probs, and the learner's figures."""
    out: dict[int, dict] = {}
    for line in (Path(run_dir) / "trees.jsonl").read_text().splitlines():
        t = json.loads(line)
        step = out.setdefault(t["step"], {"tokens": [], "rewards": [], "logprobs": [], "actor": {}})
        step["tokens"].append(t["tokens"])
        step["rewards"].append(t["reward"])
        step["logprobs"].append([x for node in t["logprobs"] for x in node])
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["step"] in out:
            out[row["step"]]["actor"].update({k: v for k, v in row.items() if k.startswith("actor/")})
    return out


def main(a_dir: str, b_dir: str) -> int:
    a, b = steps(a_dir), steps(b_dir)
    same = sorted(a) == sorted(b)
    for step in sorted(set(a) & set(b)):
        x, y = a[step], b[step]
        trees, rewards = x["tokens"] == y["tokens"], x["rewards"] == y["rewards"]
        logprob_gap = max((abs(p - q) for u, v in zip(x["logprobs"], y["logprobs"]) for p, q in zip(u, v)),
                          default=0.0) if trees else float("nan")
        keys = sorted(set(x["actor"]) & set(y["actor"]) - {"actor/time_s"})
        gap = {k: abs(x["actor"][k] - y["actor"][k]) for k in keys}
        worst = max(gap, key=gap.get) if gap else ""
        print(f"step {step}: trees {'same' if trees else 'DIFFER'}, rewards {'same' if rewards else 'DIFFER'}, "
              f"log-probs within {logprob_gap:.1e}, loss {x['actor'].get('actor/loss')} vs "
              f"{y['actor'].get('actor/loss')}, largest actor/* difference {worst} {gap.get(worst, 0.0):.1e}")
        same &= trees and rewards
    print("same trees and rewards at every step" if same else "the runs differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
