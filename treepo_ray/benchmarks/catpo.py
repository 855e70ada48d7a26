"""CATPO against TreeRPO on the CPU task, at equal sampled tokens, and the paper's two hypothesis checks.

    treepo-ray bench catpo [config.yaml] [--steps N] [--h1-trees M] [--json PATH] [key=value ...]

Default config: jobs/configs/catpo_cpu.yaml (tiny base model, the running-sum task, local Ray). In one
invocation, on the same Ray, data and base model:

1. CATPO trains `steps` steps. Every step logs its trees per regime, mean F, and what healing did; summed over
   the run they give the share of dead-wrong trees healed (at least one grafted branch verified correct; the
   paper's H2 reports 88.1%) and the healing's cost in tokens (generated, and prompt tokens prefilled).
2. TreeRPO (algo.name=treerpo, the same trees and loss, no scoring, healing or weights) trains until it has
   sampled as many tokens as CATPO did, healing's generation included (so the comparison is at equal
   generation cost).
3. H1 (paper Table 3): before TreeRPO trains, it grows `h1_trees` trees of fresh training prompts with the base
   weights; for each, F(T) from the rollout's log-probs, and the L2 norm of the gradient of that tree's samples'
   loss alone (Learner.per_group_grad_norms; unweighted TreeRPO advantages, pure policy-gradient loss: no KL or
   entropy term). Reported: their Spearman rank correlation (paper: 0.62) and Pearson correlation (paper: 0.54).
4. H2 offline, as the paper measures it: the dead-wrong trees of that same tree set are healed (base weights)
   twice, with the configured prompts and with healing/prompts_no_critique.yaml (the critique is generated but
   not shown: k fresh samples from the failure node), to tell what the critique itself adds.

Held-out accuracy (pass@1, trainer.eval_samples answers per problem at trainer.eval_temperature, fixed seeds) of
the base model and of each final policy. Everything is written to --json.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np

from treepo_ray.benchmarks.common import parse_job_args, write_json
from treepo_ray.algo.catpo import score_tree
from treepo_ray.job.config import CONFIG_DIR, AlgoConfig, TrainConfig
from treepo_ray.job.redact import redacted_overrides

DEFAULT = CONFIG_DIR / "catpo_cpu.yaml"
NO_CRITIQUE = Path(__file__).resolve().parents[1] / "healing" / "prompts_no_critique.yaml"
PAPER = {"healed_share": 0.881, "h1_spearman": 0.62, "h1_pearson": 0.54}


def average_ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties sharing the mean of the ranks they span (as Spearman's rho with ties needs)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    xs = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(x, y) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if len(x) < 2 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def spearman(x, y) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks."""
    return pearson(average_ranks(np.asarray(x, dtype=np.float64)), average_ranks(np.asarray(y, dtype=np.float64)))


def h2_check(rt, trees, cfg: TrainConfig, model_path: str) -> dict:
    """Heal copies of the dead-wrong trees among `trees` with each prompts file; per file, the share healed."""
    from treepo_ray.runtime.healer import make_healer, verified_phases
    from treepo_ray.tree.tree import Tree

    catpo = cfg.algo.catpo
    dead = [t for t in trees if score_tree(Tree.from_json(t.to_json()), catpo.tau_low, catpo.tau_high,
                                           catpo.var_cut)["regime"] == "dead_wrong"]
    out: dict = {"dead_wrong_trees": len(dead), "of_trees": len(trees), "paper_healed_share": PAPER["healed_share"]}
    for name, prompts in (("with_critique", catpo.healing.prompts_path), ("without_critique", str(NO_CRITIQUE))):
        variant = dataclasses.replace(catpo, healing=dataclasses.replace(catpo.healing, prompts_path=prompts))
        variant_cfg = dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, catpo=variant))
        healer = make_healer(rt.supervisor.router, rt.supervisor.verifiers, model_path, variant_cfg)

        async def heal_all():
            copies = [Tree.from_json(t.to_json()) for t in dead]
            return await asyncio.gather(*(verified_phases(c, variant_cfg.algo, healer, 7919 + i,
                                                          cfg.runtime.deadlines.grow_s)
                                          for i, c in enumerate(copies)))

        try:
            healed = asyncio.run(heal_all())
        finally:
            healer.__ray_terminate__.remote()  # end the actor (this module stays free of Ray itself)
        heals = [t.meta["catpo"].get("heal", {}) for t in healed]
        ok = sum(h.get("correct", 0) > 0 for h in heals)
        out[name] = {"healed": ok, "healed_share": ok / len(dead) if dead else math.nan,
                     "errors": sum("error" in h for h in heals),
                     "generated_tokens": sum(h.get("generated_tokens", 0) for h in heals),
                     "examples": [{"critique": h.get("critique", "")} for h in heals[:2]]}
    return out


def h1_check(trees, cfg: TrainConfig, model_path: str) -> dict:
    """F(T) of each tree against the norm of its own samples' loss gradient at the base weights."""
    from treepo_ray.algo.informativeness import classify_tree, tree_informativeness
    from treepo_ray.algo.losses import LossConfig
    from treepo_ray.learner import Learner
    from treepo_ray.learner.batch import train_trees

    algo = AlgoConfig(name="treerpo", treerpo=cfg.algo.treerpo)
    scores = [tree_informativeness(t) for t in trees]
    groups = [train_trees([t], algo.credit([t])) for t in trees]  # weight 1: the unweighted TreeRPO loss
    loss = LossConfig(clip_low=cfg.learner.loss.clip_low, clip_high=cfg.learner.loss.clip_high,
                      aggregation=cfg.learner.loss.aggregation, kl_coef=0.0, entropy_coef=0.0)
    lcfg = dataclasses.replace(cfg.learner, loss=loss, use_ref_model=False, strategy="none")
    learner = Learner(model_path, lcfg)
    norms = learner.per_group_grad_norms(groups)
    learner.close()
    F = [f for f, _ in scores]
    regimes = [classify_tree(f, p, cfg.algo.catpo.tau_low, cfg.algo.catpo.tau_high, cfg.algo.catpo.var_cut)
               for f, p in scores]
    return {"trees": len(trees), "spearman": spearman(F, norms), "pearson": pearson(F, norms),
            "paper_spearman": PAPER["h1_spearman"], "paper_pearson": PAPER["h1_pearson"],
            "F_mean": float(np.mean(F)), "grad_norm_mean": float(np.mean(norms)),
            "trees_F_zero": int(sum(f == 0 for f in F)), "trees_grad_norm_zero": int(sum(n == 0 for n in norms)),
            # Leaves disagree but F = 0: the log-prob sums separate right from wrong exactly (|rho| = 1).
            "mixed_trees_F_zero": int(sum(f == 0 and 0 < p < 1 for f, p in scores)),
            "regimes": {r: regimes.count(r) for r in sorted(set(regimes))},
            "pairs": [[round(f, 6), round(n, 6)] for f, n in zip(F, norms)]}


def train_run(rt, prompts, cfg: TrainConfig, max_steps: int, token_budget: float | None = None) -> dict:
    """Train a fresh run for `max_steps` steps, or until it has sampled `token_budget` tokens."""
    from treepo_ray.data.prompts import PromptStream

    rows: list[dict] = []
    tokens = 0.0
    t0 = time.perf_counter()
    steps = rt.loop.steps(0, max_steps, PromptStream(prompts, cfg.trainer.seed, cfg.data.shuffle))
    with contextlib.closing(steps):
        for _, metrics in steps:
            rows.append(metrics)
            tokens += metrics["rollout/sampled_tokens"]
            print(f"  {cfg.algo.name} step {len(rows)}: reward {metrics['critic/score/mean']:.3f}, sampled tokens "
                  f"{tokens:.0f}" + (f", dead-wrong {metrics['catpo/dead_wrong']:.0f}, healed "
                                     f"{metrics['catpo/healed']:.0f}" if "catpo/healed" in metrics else ""), flush=True)
            if token_budget is not None and tokens >= token_budget:
                break
    train_s = time.perf_counter() - t0
    total = lambda key: float(sum(r.get(key, 0.0) for r in rows))  # noqa: E731
    out = {"steps": rt.loop.version, "sampled_tokens": tokens, "train_s": train_s,
           "rollout_s_per_step": total("timing_s/gen") / max(len(rows), 1),
           "rollout_reward": [round(r["critic/score/mean"], 4) for r in rows]}
    if any("catpo/heal_attempts" in r for r in rows):
        attempts, healed = total("catpo/heal_attempts"), total("catpo/healed")
        out["regimes_sampled"] = {r: total(f"catpo/{r}") for r in
                                  ("dead_correct", "dead_wrong", "stale", "informative")}
        out["F_mean_sampled"] = total("catpo/F_mean_sampled") / max(len(rows), 1)
        out["F_mean_after_healing"] = total("catpo/F_mean") / max(len(rows), 1)
        out["weight_zero_share"] = total("catpo/weight_zero_share") / max(len(rows), 1)
        gen, prompt = total("catpo/heal_generated_tokens"), total("catpo/heal_prompt_tokens")
        out["healing"] = {
            "dead_wrong_trees": total("catpo/dead_wrong"), "attempts": attempts,
            "errors": total("catpo/heal_errors"), "healed": healed,
            "healed_share": healed / attempts if attempts else math.nan, "paper_healed_share": PAPER["healed_share"],
            "F_improved": total("catpo/heal_F_improved"), "grafted": total("catpo/grafted"),
            "generated_tokens": gen, "prompt_tokens": prompt,
            "generated_share_of_sampled": gen / tokens if tokens else math.nan,
            "generated_tokens_per_heal": gen / attempts if attempts else math.nan,
        }
    return out


def run(cfg: TrainConfig, steps: int, h1_trees: int) -> dict:
    from treepo_ray import config as config_io
    from treepo_ray.data.prompts import PromptStream
    from treepo_ray.runtime.cluster import set_up
    from treepo_ray.runtime.train import start_runtime

    job = set_up(cfg)
    model_path, records, test_set = job.model_path, job.train_set, job.test_set
    tr = cfg.trainer
    result: dict = {"model": model_path, "eval_problems": len(test_set),
                    "eval": f"pass@1: mean of {tr.eval_samples} answers per problem at temperature "
                            f"{tr.eval_temperature}, fixed seeds", "prompts_per_step": tr.prompts_per_step}

    catpo_cfg = config_io.apply_overrides(cfg, ["algo.name=catpo"])
    rt = start_runtime(catpo_cfg, job)
    try:
        result["base_accuracy"] = rt.evaluator.evaluate().get("eval/accuracy")
        print(f"base model: held-out accuracy {result['base_accuracy']:.3f}; CATPO for {steps} steps", flush=True)
        result["catpo"] = train_run(rt, records, catpo_cfg, steps)
        rt.loop.sync_engines()
        result["catpo"]["final_accuracy"] = rt.evaluator.evaluate().get("eval/accuracy")
    finally:
        rt.supervisor.shutdown()

    treerpo_cfg = config_io.apply_overrides(cfg, ["algo.name=treerpo"])
    rt = start_runtime(treerpo_cfg, job)
    try:
        # H1 trees: fresh training prompts (another seed's order), grown with the base weights.
        h1_prompts = PromptStream(records, cfg.trainer.seed + 1).take(h1_trees)
        print(f"H1: {h1_trees} TreeRPO trees with the base weights", flush=True)
        h1_trees_grown = rt.supervisor.grow(h1_prompts, 0.0)
        result["h1"] = h1_check(h1_trees_grown, treerpo_cfg, model_path)
        result["h2_offline"] = h2_check(rt, h1_trees_grown, catpo_cfg, model_path)
        budget = result["catpo"]["sampled_tokens"]
        print(f"TreeRPO until {budget:.0f} sampled tokens", flush=True)
        result["treerpo"] = train_run(rt, records, treerpo_cfg, 3 * steps, token_budget=budget)
        rt.loop.sync_engines()
        result["treerpo"]["final_accuracy"] = rt.evaluator.evaluate().get("eval/accuracy")
    finally:
        rt.supervisor.shutdown()
    # Standard error over problems (answers to one problem are correlated, so not over answers): the scale of
    # accuracy differences that are noise.
    for key in ("catpo", "treerpo"):
        acc = result[key]["final_accuracy"]
        result[key]["final_accuracy_se"] = math.sqrt(acc * (1 - acc) / max(len(test_set), 1))
    return result


def summary(r: dict) -> str:
    c, t, h, heal, h2 = r["catpo"], r["treerpo"], r["h1"], r["catpo"]["healing"], r["h2_offline"]
    return "\n".join([
        f"held-out accuracy ({r['eval_problems']} problems, {r['eval']}): base {r['base_accuracy']:.3f}, "
        f"TreeRPO {t['final_accuracy']:.3f} ± {t['final_accuracy_se']:.3f} ({t['steps']} steps, "
        f"{t['sampled_tokens']:.0f} sampled tokens), CATPO {c['final_accuracy']:.3f} ± {c['final_accuracy_se']:.3f} "
        f"({c['steps']} steps, {c['sampled_tokens']:.0f} sampled tokens)",
        f"healing: {heal['healed']:.0f} of {heal['attempts']:.0f} dead-wrong trees got a correct branch "
        f"({heal['healed_share']:.1%}; paper 88.1%), {heal['errors']:.0f} refused; cost "
        f"{heal['generated_tokens']:.0f} generated tokens ({heal['generated_share_of_sampled']:.1%} of CATPO's "
        f"sampled tokens) + {heal['prompt_tokens']:.0f} prompt tokens",
        f"H2 offline ({h2['dead_wrong_trees']} dead-wrong of {h2['of_trees']} base-model trees): healed "
        f"{h2['with_critique']['healed_share']:.1%} with the critique, {h2['without_critique']['healed_share']:.1%} "
        f"with k fresh samples from the failure node instead",
        f"H1: Spearman(F, per-tree gradient norm) = {h['spearman']:.3f} over {h['trees']} trees (paper 0.62), "
        f"Pearson {h['pearson']:.3f} (paper 0.54)",
    ])


def main(argv: list[str] | None = None) -> int:
    def flags(ap) -> None:
        ap.add_argument("--steps", type=int, default=0, help="CATPO training steps (default: trainer.steps)")
        ap.add_argument("--h1-trees", type=int, default=64, help="trees of the H1 correlation check")

    parsed = parse_job_args(argv, "catpo", __doc__, flags, default_config=DEFAULT)
    if isinstance(parsed, int):
        return parsed
    args, cfg = parsed
    if args.h1_trees < 3:
        print("treepo-ray bench catpo: --h1-trees must be >= 3", file=sys.stderr)
        return 2
    started = time.time()
    result = run(cfg, args.steps or cfg.trainer.steps, args.h1_trees)
    result.update(config=args.config, overrides=redacted_overrides(args.overrides, cfg.log.redact_keys),
                  wall_s=time.time() - started)
    print(summary(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
