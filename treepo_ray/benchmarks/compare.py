"""Algorithms side by side over time: the same task, base model and budget for each; held-out accuracy curves.

    treepo-ray compare [config.yaml] [--algos grpo,dapo,treepo[key=value,...]] [--seeds 2] [--first-seed 0]
                       [--budget-s S | --budget-tokens N] [--eval-points N] [--out DIR] [--json FILE] [key=value ...]

Default config: jobs/configs/cpu.yaml (the tiny base model on the default synthetic task, local Ray). One set-up
(model, data, Ray: runtime/cluster.py `set_up`), then for every seed, every algorithm in turn (so a change in the
host's speed part way through falls on all of them), a fresh run (the job's own actors and loop) trained until its budget
is spent: the same wall-clock training time for every run (`--budget-s`, the default), or the same number of
sampled tokens (`--budget-tokens`). An algorithm may also run as a variant, `name[key=value,key=value]` in
`--algos` (`treepo,treepo[rollout.treepo.branch_point=entropy]`): its overrides go on top of the config and the
command's own overrides, for that variant's training runs only (the model, data and held-out evaluation are the
command's, shared by all), and it is named by its spec as written; GRPO's figures below are plain `grpo`'s. Held-out
accuracy (the job's evaluation: trainer.eval_size problems, trainer.eval_samples answers each at
trainer.eval_temperature, fixed seeds) is taken of the weights published first after each of `--eval-points` evenly
spaced marks of the budget, and of the final weights: they are kept during training and scored after it by one
evaluator with every engine the cluster has room for, so a run's clock holds training only. A curve point is placed
where its weights were published: the training wall time and the tokens sampled up to then. Schedules over training
(TreePO's log-prob temperature) run over the budget: a batch's point on them is the share of the budget spent when it
starts.

The JSON holds `algorithms.<spec>.runs` (one per seed: `seed`, `curve` as [wall_s, sampled_tokens,
heldout_accuracy] rows, `final_accuracy`, `wall_s`, `started_s` (after the comparison's start), where the time went,
`branches`, and `time_to_grpo_final_s` and `tokens_to_grpo_final`: the first curve point at or above GRPO's mean
final accuracy, null when never), `.final_accuracy` (mean over seeds), `.time_to_grpo_final_s` and
`.tokens_to_grpo_final` (mean over seeds; null when a seed never gets there), `.tree_counters` (growth mechanism ->
total over its runs), `.branches` (whether branches were worth their tokens, tree/branches.py, from the per-step
metrics: `informative_share`, informative branch points over all of them, each step's share weighted by its branch
points; `informative_share_by_depth` at depths 0..3 (the last holds the deeper ones), weighted the same way;
`branch_points`, the run's total; `tokens_per_informative_branch`, `branch_entropy` and `token_entropy`, means over
steps; an algorithm's: its runs' figures weighted by their branch points, the rest means over seeds; null where no
step had one), and for CATPO `.heal_rate` (share of the dead-wrong trees it healed that gained a correct branch),
its healing cost in tokens, and `.vs_treerpo` (both at equal sampled tokens, linear between evaluated points) when
TreeRPO ran too. It prints a table and draws accuracy against wall time and against sampled tokens (mean and min-max
band over seeds) as PNGs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

from treepo_ray.algo import ALGORITHMS
from treepo_ray.config import UserError
from treepo_ray.job.config import DEFAULT_CONFIG, TrainConfig, load_config, resolve_config
from treepo_ray.job.redact import redacted_overrides
from treepo_ray.tree.branches import DEPTHS

DEFAULT_ALGOS = ("grpo", "dapo", "treepo")
BASELINE = "grpo"
SET_BY_COMPARE = ("algo.name", "trainer.seed", "learner.seed")
"""Keys compare sets for every run itself: a variant may not set them."""


def split_outside_brackets(text: str) -> list[str] | None:
    """`text` split on the commas outside [...]; None when its brackets do not pair up."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0:
            break
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return None if depth else [*parts, text[start:]]


def parse_algos(text: str) -> dict[str, tuple[str, list[str]]]:
    """`--algos`: spec -> (algorithm, its overrides), in order. A spec is an algorithm's name, or a variant of it
    `name[key=value,key=value]` (a value may hold bracketed commas); UserError on a malformed or repeated spec."""
    specs = split_outside_brackets(text)
    if specs is None:
        raise UserError(f"{text!r}: unbalanced brackets")
    algos: dict[str, tuple[str, list[str]]] = {}
    for spec in (s.strip() for s in specs):
        if not spec:
            continue
        name, bracket, rest = spec.partition("[")
        overrides = []
        if bracket:
            overrides = (split_outside_brackets(rest[:-1]) if rest.endswith("]") else None) or []
            overrides = [o.strip() for o in overrides]
            if not overrides or not all(overrides):
                raise UserError(f"{spec!r}: write a variant as name[key=value,key=value]")
        if name not in ALGORITHMS:
            raise UserError(f"{name!r}: choose from {', '.join(ALGORITHMS)}")
        for o in overrides:
            key, eq, _ = o.partition("=")
            if not eq or not key:
                raise UserError(f"{spec!r}: {o!r} is not a key=value override")
            if key in SET_BY_COMPARE:
                raise UserError(f"{spec!r}: compare sets {key} itself")
        if (name, overrides) in algos.values():  # the same runs twice (spaces aside)
            raise UserError(f"{spec!r} is given twice")
        algos[spec] = (name, overrides)
    if not algos:
        raise UserError(f"(empty): choose from {', '.join(ALGORITHMS)}")
    return algos


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]] | int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="treepo-ray compare", description=__doc__.splitlines()[0])
    ap.add_argument("config", nargs="?", default=str(DEFAULT_CONFIG), help="YAML config (default: cpu.yaml)")
    ap.add_argument("--algos", default=",".join(DEFAULT_ALGOS),
                    help=f"comma-separated, of {', '.join(ALGORITHMS)}; a variant: name[key=value,key=value]")
    ap.add_argument("--seeds", type=int, default=2,
                    help="runs per algorithm (trainer.seed = learner.seed = first seed, first seed + 1, ...)")
    ap.add_argument("--first-seed", type=int, default=0,
                    help="seed of each algorithm's first run (a run's seed fixes its prompts and sampling seeds: runs "
                         "of one seed differ by timing only, other seeds are new evidence)")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--budget-s", type=float, default=None, help="training wall time per run (default 200 s)")
    budget.add_argument("--budget-tokens", type=float, default=None, help="sampled tokens per run instead")
    ap.add_argument("--eval-points", type=int, default=10,
                    help="evaluate at this many evenly spaced points of the budget, and at the end")
    ap.add_argument("--out", default="", help="folder of the PNGs (default: beside --json, else runs/compare-<time>)")
    ap.add_argument("--json", default=None, help="write the result here as JSON")
    args, overrides = ap.parse_known_args(argv)
    flags = [a for a in overrides if a.startswith("-")]
    if flags:  # no abbreviations: `--seed 3` is not `--seeds 3`
        print(f"treepo-ray compare: unknown option {flags[0]!r} (`treepo-ray compare --help`)", file=sys.stderr)
        return 2
    if "=" in args.config:
        overrides, args.config = [args.config, *overrides], str(DEFAULT_CONFIG)
    try:
        args.algos = parse_algos(args.algos)  # spec -> (algorithm, overrides)
    except UserError as err:
        print(f"treepo-ray compare: --algos {err}", file=sys.stderr)
        return 2
    if args.seeds < 1 or args.first_seed < 0 or args.eval_points < 0:
        print("treepo-ray compare: --seeds must be >= 1, --first-seed and --eval-points >= 0", file=sys.stderr)
        return 2
    args.seed_list = list(range(args.first_seed, args.first_seed + args.seeds))
    if args.budget_s is None and args.budget_tokens is None:
        args.budget_s = 200.0
    return args, overrides


def run_config(path: str, overrides: list[str], algo: str, seed: int) -> TrainConfig:
    """One run's config: the file and overrides, then the algorithm (its own loss preset) and the seed."""
    return load_config(resolve_config(path),
                       [*overrides, f"algo.name={algo}", f"trainer.seed={seed}", f"learner.seed={seed}"])


def run_configs(args: argparse.Namespace, overrides: list[str]) -> tuple[dict, TrainConfig]:
    """Every run's config, (spec, seed) -> config, seed by seed and every spec in turn (so a change in the host's
    speed part way through falls on all of them), and the shared one (the command's, without a variant's overrides:
    model, data, evaluation). All loaded up front: a bad key or value stops the command before anything runs."""
    shared = run_config(args.config, overrides, next(iter(args.algos.values()))[0], args.seed_list[0])
    cfgs = {}
    for seed in args.seed_list:
        for spec, (name, extra) in args.algos.items():
            try:
                cfgs[(spec, seed)] = run_config(args.config, [*overrides, *extra], name, seed)
            except ValueError as err:
                raise UserError(f"--algos {spec!r}: {err}") from None
    return cfgs, shared


def train_run(job, cfg: TrainConfig, budget_s: float | None, budget_tokens: float | None, eval_points: int) -> dict:
    """Train one fresh run (its own actors and loop) until its budget is spent. The weights published first after
    each of `eval_points` evenly spaced marks of the budget, and the final ones, are kept (object-store copies) with
    the training wall time and sampled tokens at their publication; `evaluate_runs` scores them afterwards, so the
    run's clock holds training only, with rollout and learning overlapped as in a job (an evaluation inside the loop
    would stall the rollout while the learner went on training for free)."""
    from treepo_ray.data.prompts import PromptStream
    from treepo_ray.runtime.train import start_runtime

    tr = cfg.trainer
    budget = budget_s if budget_tokens is None else budget_tokens
    marks = [budget * (i + 1) / (eval_points + 1) for i in range(eval_points)]
    rt = start_runtime(cfg, job)
    rows: list[dict] = []
    kept: list[tuple] = []  # (wall s, sampled tokens, weights) per evaluation point
    clock = {"start": 0.0, "tokens": 0.0, "wall": 0.0}

    def spent(wall: float) -> float:  # in the budget's unit
        return wall if budget_tokens is None else clock["tokens"]

    def keep(wall: float, tokens: float) -> None:
        kept.append((wall, tokens, rt.loop.kept_weights()))  # the weights of the step just trained

    def on_step(batch, m: dict) -> bool:
        clock["tokens"] += m.get("rollout/sampled_tokens", 0.0)
        clock["wall"] = wall = time.perf_counter() - clock["start"]
        rows.append(m)
        used = spent(wall)
        if marks and used >= marks[0]:
            while marks and used >= marks[0]:
                marks.pop(0)
            keep(wall, clock["tokens"])
        print(f"  {cfg.algo.name} seed {tr.seed} step {batch.step + 1}: {wall:.0f}s, {clock['tokens']:.0f} tokens, "
              f"reward {m.get('critic/score/mean', math.nan):.3f}", flush=True)
        return used < budget

    try:
        clock["start"] = time.perf_counter()
        # The log-prob temperature schedule runs over the budget, not over trainer.steps (which a budgeted run ignores).
        steps = rt.loop.steps(0, 10**6, PromptStream(job.train_set, tr.seed, cfg.data.shuffle),
                              progress=lambda step: spent(time.perf_counter() - clock["start"]) / budget)
        with contextlib.closing(steps):
            for batch, m in steps:
                if not on_step(batch, m):
                    break
        done = rt.loop.version
        if not kept or kept[-1][0] != clock["wall"]:
            keep(clock["wall"], clock["tokens"])  # the final weights
    finally:
        rt.supervisor.shutdown()
    total = lambda key: float(sum(r.get(key, 0.0) for r in rows))  # noqa: E731
    out = {"seed": tr.seed, "wall_s": clock["wall"], "sampled_tokens": clock["tokens"], "steps": done,
           "tree_counters": {k.split("/", 1)[1]: total(k) for k in rows[0] if k.startswith("growth/")} if rows else {},
           "branches": branch_figures(rows),
           # Batches may grow at once (runtime/loop.py), so their growth times (rollout_s) can sum past the wall time;
           # engine_busy_s is what the engines spent running them.
           "time": {"rollout_s": total("timing_s/gen"), "engine_busy_s": total("perf/engine_busy_s"),
                    "learner_s": total("timing_s/update_actor"), "learner_waiting_s": total("timing_s/wait"),
                    "weight_sync_s": total("timing_s/update_weights")},
           "trajectories": total("rollout/trajectories"),
           "shared_prefix_share": total("tree/shared_prefix_share") / max(len(rows), 1),
           "rollout_reward": [round(r.get("critic/score/mean", math.nan), 4) for r in rows],
           "schedule_progress": [round(r.get("rollout/progress", math.nan), 4) for r in rows],
           "kept_weights": kept}
    if any("catpo/heal_attempts" in r for r in rows):  # an algorithm that heals
        out["healing"] = {"attempts": total("catpo/heal_attempts"), "healed": total("catpo/healed"),
                          "errors": total("catpo/heal_errors"), "dead_wrong": total("catpo/dead_wrong"),
                          "generated_tokens": total("catpo/heal_generated_tokens"),
                          "prompt_tokens": total("catpo/heal_prompt_tokens")}
    return out


@contextlib.contextmanager
def evaluator(cfg: TrainConfig, job):
    """The run's evaluator (runtime/evaluator.py: the job's held-out set and settings of `cfg`) on engines and
    verifiers of their own, as many engines as the cluster has room for."""
    from treepo_ray.runtime.evaluator import Evaluator
    from treepo_ray.runtime.supervisor import Supervisor

    supervisor = Supervisor.for_evaluation(cfg, job.model_path)
    try:
        yield Evaluator(cfg, supervisor, job.tokenizer, job.test_set)
    finally:
        supervisor.shutdown()


def evaluate_runs(job, cfg: TrainConfig, runs: list[dict], base_accuracy: float) -> int:
    """Score every run's kept weights on the held-out set (one evaluator for all) into its `curve`
    ([wall_s, sampled_tokens, accuracy] rows from [0, 0, base]) and `final_accuracy`; `time.eval_s` is the
    evaluation time, outside the run's clock. Returns the evaluator's number of engines."""
    with evaluator(cfg, job) as ev:
        pool = ev.supervisor.pool
        print(f"evaluating {sum(len(r['kept_weights']) for r in runs)} kept weights on {pool.size} engines", flush=True)
        version = 0
        for run in runs:
            run["curve"], started = [[0.0, 0.0, base_accuracy]], time.perf_counter()
            for wall, tokens, weights in run.pop("kept_weights"):
                version += 1  # a fresh version each time: the engines drop every cache entry on a load
                pool.load_weights(weights, version)
                run["curve"].append([round(wall, 2), tokens, ev.evaluate()["eval/accuracy"]])
            run["final_accuracy"] = run["curve"][-1][2]
            run["time"]["eval_s"] = time.perf_counter() - started
            print(f"  evaluated seed {run['seed']}: {[round(a, 3) for _, _, a in run['curve']]}", flush=True)
        return pool.size


def first_reaching(curve: list, target: float, column: int) -> float | None:
    """wall_s (column 0) or tokens (column 1) of the first curve point at or above `target`."""
    for row in curve:
        if row[2] >= target - 1e-12:
            return row[column]
    return None


def mean_or_none(values: list) -> float | None:
    return None if not values or any(v is None for v in values) else float(np.mean(values))


def known(v) -> bool:
    return v is not None and not math.isnan(v)


def mean_known(values: list) -> float | None:
    """The mean of the values that are neither None nor NaN; None (null in the JSON) when there are none."""
    values = [v for v in values if known(v)]
    return float(np.mean(values)) if values else None


def weighted_share(shares: list, weights: list) -> float | None:
    """The mean of the known `shares` weighted by `weights` (branch points); None when no weight is left."""
    pairs = [(s, w) for s, w in zip(shares, weights) if known(s) and w > 0]
    total = sum(w for _, w in pairs)
    return float(sum(s * w for s, w in pairs) / total) if total else None


PLAIN_MEANS = ("tokens_per_informative_branch", "branch_entropy", "token_entropy")
"""Branch figures averaged plainly (over steps, then over seeds); the shares are weighted by branch points."""


def branch_figures(rows: list[dict]) -> dict:
    """A run's `branches` from its per-step metrics (tree/branches.py `branch_metrics`). The per-depth shares are
    weighted by the step's branch points too (the metrics do not count branch points by depth)."""
    points = [r.get("tree/branch_points", 0.0) for r in rows]
    share = lambda key: weighted_share([r.get(key) for r in rows], points)  # noqa: E731
    return {"informative_share": share("tree/informative_branches"), "branch_points": float(sum(points)),
            "informative_share_by_depth": [share(f"tree/informative_branches_depth{d}") for d in range(DEPTHS)],
            **{k: mean_known([r.get(f"tree/{k}") for r in rows]) for k in PLAIN_MEANS}}


def combined_branches(runs: list[dict]) -> dict:
    """An algorithm's `branches`: its runs' shares weighted by their branch points, the rest means over seeds."""
    b = [r["branches"] for r in runs]
    points = [x["branch_points"] for x in b]
    return {"informative_share": weighted_share([x["informative_share"] for x in b], points),
            "branch_points": float(np.mean(points)),
            "informative_share_by_depth": [weighted_share([x["informative_share_by_depth"][d] for x in b], points)
                                           for d in range(DEPTHS)],
            **{k: mean_known([x[k] for x in b]) for k in PLAIN_MEANS}}


def accuracy_at(curve: list, x: float, column: int) -> float:
    """The accuracy of the last curve point at or before `x` (wall s or tokens)."""
    return [row[2] for row in curve if row[column] <= x + 1e-9][-1]


def interpolated_accuracy(curve: list, x: float, column: int) -> float:
    """The accuracy at `x` (wall s or tokens), linear between the evaluated points around it (the last one past the
    end): comparing two runs at an x between their evaluations, `accuracy_at` would give one of them its older
    point, the base model's when the curve holds only the base and the final (`--eval-points 0`)."""
    return float(np.interp(x, [row[column] for row in curve], [row[2] for row in curve]))


def summarise(algos: dict) -> dict:
    """Means over seeds, the time and tokens to GRPO's final accuracy, tree counters and branches, CATPO's
    healing. `algos`: spec -> {"runs": [...]}; the baseline is plain `grpo`."""
    for a in algos.values():
        finals = [r["final_accuracy"] for r in a["runs"]]
        a["final_accuracy"] = float(np.mean(finals))
        a["final_accuracy_spread"] = [float(min(finals)), float(max(finals))]
        a["wall_s"] = float(np.mean([r["wall_s"] for r in a["runs"]]))
        a["sampled_tokens"] = float(np.mean([r["sampled_tokens"] for r in a["runs"]]))
        counters: dict[str, float] = {}
        for r in a["runs"]:
            for k, v in r["tree_counters"].items():
                counters[k] = counters.get(k, 0.0) + v
        a["tree_counters"] = counters
        a["branches"] = combined_branches(a["runs"])
    if BASELINE in algos:
        target = algos[BASELINE]["final_accuracy"]
        for a in algos.values():
            for r in a["runs"]:  # each run's own, to compare seed by seed
                r["time_to_grpo_final_s"] = first_reaching(r["curve"], target, 0)
                r["tokens_to_grpo_final"] = first_reaching(r["curve"], target, 1)
            a["time_to_grpo_final_s"] = mean_or_none([r["time_to_grpo_final_s"] for r in a["runs"]])
            a["tokens_to_grpo_final"] = mean_or_none([r["tokens_to_grpo_final"] for r in a["runs"]])
    for c in algos.values():  # CATPO and its variants
        if not all("healing" in r for r in c["runs"]):
            continue
        heal = {k: sum(r["healing"][k] for r in c["runs"]) for k in c["runs"][0]["healing"]}
        c["heal_rate"] = heal["healed"] / heal["attempts"] if heal["attempts"] else None
        c["healing"] = {**heal, "share_of_sampled_tokens": heal["generated_tokens"] / max(
            sum(r["sampled_tokens"] for r in c["runs"]), 1.0)}
    if "catpo" in algos and "treerpo" in algos:  # both at the sampled tokens the shorter of the two reached
        c, t = algos["catpo"], algos["treerpo"]
        x = min(c["sampled_tokens"], t["sampled_tokens"])
        at_x = {name: float(np.mean([interpolated_accuracy(r["curve"], x, 1) for r in a["runs"]]))
                for name, a in (("catpo", c), ("treerpo", t))}
        c["vs_treerpo"] = {"sampled_tokens": x, "catpo_accuracy": at_x["catpo"], "treerpo_accuracy": at_x["treerpo"]}
    return algos


def verdict(algos: dict) -> dict | None:
    """TreePO against GRPO, the issue's targets: time to GRPO's final accuracy <= 0.75 x GRPO's wall time, and a
    final accuracy not below GRPO's at equal wall time."""
    if BASELINE not in algos or "treepo" not in algos:
        return None
    g, t = algos[BASELINE], algos["treepo"]
    ratio = t["time_to_grpo_final_s"] / g["wall_s"] if t["time_to_grpo_final_s"] is not None else None
    return {"time_ratio": ratio, "time_ratio_target": 0.75, "time_ratio_met": ratio is not None and ratio <= 0.75,
            "final_accuracy_treepo": t["final_accuracy"], "final_accuracy_grpo": g["final_accuracy"],
            "final_not_below_grpo": t["final_accuracy"] >= g["final_accuracy"]}


def table(algos: dict) -> str:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    w = max(12, *map(len, algos))  # a variant's spec is longer than a name
    lines = [f"{'algorithm':<{w}} {'final acc':>9} {'(min-max)':>13} {'wall s':>7} {'tokens':>9} {'steps':>6} "
             f"{'s to GRPO':>9} {'tok to GRPO':>11} {'informative':>11}"]
    for name, a in algos.items():
        lo, hi = a["final_accuracy_spread"]
        steps = np.mean([r["steps"] for r in a["runs"]])
        lines.append(f"{name:<{w}} {a['final_accuracy']:>9.3f} {f'({lo:.3f}-{hi:.3f})':>13} {a['wall_s']:>7.0f} "
                     f"{a['sampled_tokens']:>9.0f} {steps:>6.1f} {fmt(a.get('time_to_grpo_final_s'), '9.0f'):>9} "
                     f"{fmt(a.get('tokens_to_grpo_final'), '11.0f'):>11} "
                     f"{fmt(a['branches']['informative_share'], '11.3f'):>11}")
    return "\n".join(lines)


def plot(algos: dict, out_dir: Path) -> list[str]:
    """accuracy_vs_wall.png and accuracy_vs_tokens.png: per algorithm (labelled by its spec) the mean over seeds
    (curves stepped onto a common grid) and the min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for column, name, label in ((0, "accuracy_vs_wall.png", "training wall time (s)"),
                                (1, "accuracy_vs_tokens.png", "sampled tokens")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for algo, a in algos.items():
            end = min(r["curve"][-1][column] for r in a["runs"])
            grid = np.linspace(0, end, 100)
            ys = np.array([[accuracy_at(r["curve"], x, column) for x in grid] for r in a["runs"]])
            (line,) = ax.plot(grid, ys.mean(axis=0), label=algo, drawstyle="steps-post")
            ax.fill_between(grid, ys.min(axis=0), ys.max(axis=0), color=line.get_color(), alpha=0.2, step="post")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(str(path))
    return paths


def main(argv: list[str] | None = None) -> int:
    parsed = parse_args(argv)
    if isinstance(parsed, int):
        return parsed
    args, overrides = parsed
    try:
        cfgs, first = run_configs(args, overrides)
    except ValueError as err:
        print(f"treepo-ray compare: {err}", file=sys.stderr)
        return 2
    from treepo_ray.runtime.cluster import set_up

    started = time.time()
    job = set_up(first)
    tr = first.trainer
    with evaluator(first, job) as ev:  # the base model's accuracy, once for every run
        base = ev.evaluate()["eval/accuracy"]
    print(f"base model: held-out accuracy {base:.3f} on {len(job.test_set)} problems", flush=True)
    algos: dict = {a: {"runs": []} for a in args.algos}
    for (spec, seed), cfg in cfgs.items():
        run_started = time.time() - started
        algos[spec]["runs"].append(train_run(job, cfg, args.budget_s, args.budget_tokens, args.eval_points))
        algos[spec]["runs"][-1]["started_s"] = round(run_started, 1)
    eval_engines = evaluate_runs(job, first, [r for a in algos.values() for r in a["runs"]], base)
    summarise(algos)
    result = {"config": args.config, "overrides": redacted_overrides(overrides, first.log.redact_keys),
              "model": job.model_path,
              "budget": {"wall_s": args.budget_s} if args.budget_tokens is None else {"tokens": args.budget_tokens},
              "eval": f"pass@1: mean of {tr.eval_samples} answers per problem at temperature {tr.eval_temperature}, "
                      f"{len(job.test_set)} held-out problems, at {args.eval_points} evenly spaced points of the budget "
                      "and at the end (weights kept during training, scored after it, outside its clock)",
              "eval_engines": eval_engines,
              "base_accuracy": base, "algorithms": algos, "treepo_vs_grpo": verdict(algos)}
    out_dir = Path(args.out or (Path(args.json).parent if args.json else f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result["plots"] = plot(algos, out_dir)
    result["wall_s"] = time.time() - started
    print(table(algos))
    if result["treepo_vs_grpo"]:
        v = result["treepo_vs_grpo"]
        reached = "never" if v["time_ratio"] is None else f"in {v['time_ratio']:.2f}x GRPO's wall time"
        print(f"TreePO reached GRPO's final accuracy {reached} (target: within 0.75x); final "
              f"{v['final_accuracy_treepo']:.3f} vs GRPO {v['final_accuracy_grpo']:.3f}")
    for spec, c in algos.items():
        if "healing" not in c:
            continue
        print(f"{spec} healing: {c['healing']['healed']:.0f} of {c['healing']['attempts']:.0f} dead-wrong trees gained"
              f" a correct branch (heal_rate {c['heal_rate']}); {c['healing']['generated_tokens']:.0f} generated + "
              f"{c['healing']['prompt_tokens']:.0f} prompt tokens")
    print(f"plots: {', '.join(result['plots'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
