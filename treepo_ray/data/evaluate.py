"""Pass@1 / Major@k / pass@k of a model on a dataset, and a test-time scaling sweep (the body of `treepo-ray eval`,
whose command, with the training job's config keys, is treepo_ray/job/evaluate.py).

Samples n answers per problem with the project's own engine and growers (sequential i.i.d. paths or TreePO
trees), scores them through the reward router (or the custom reward function), and reports per data source and
overall (metrics.summarize). `eval.sweep_divergence=[1,2,4] eval.sweep_rollouts=[2,4,8,16]` adds TreePO's
test-time scaling study (Figure 9): for each divergence factor d (branches at every divergence point: the root's
children and each path's share per round) and each rollout budget w >= d, one tree of w trajectories per problem;
accuracy is the majority vote over the w answers (and the mean and any-correct rates beside it). Written as
sweep.json and sweep.png.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from treepo_ray.data.metrics import major_at_k, mean_accuracy, pass_at_k, summarize
from treepo_ray.data.prompts import Prompt
from treepo_ray.data.sampling import SAMPLERS, SampleSettings, sample_answers


@dataclass
class EvalConfig:
    """The `eval` section: what `treepo-ray eval` sets beyond the training job's keys (which give it the model,
    the data, the reward function, and trainer.eval_samples / eval_temperature / eval_size / eval_max_new_tokens
    as the answers per problem, the temperature, the problem limit and the length cap)."""

    split: str = "test"
    """Which split to evaluate: 'test' (data.val_files, or the test files of data.name) or 'train'."""
    sampler: str = "sequential"
    """'sequential' (n i.i.d. answers) or 'treepo' (one tree of n trajectories per problem)."""
    divergence: int = 2
    """TreePO divergence factor of sampler 'treepo'."""
    k: list[int] = field(default_factory=lambda: [1, 4, 8])
    """k of pass@k and major@k (those above the answers per problem are skipped)."""
    resamples: int = 1000
    """Random k-subsets averaged by major@k when k < n."""
    sweep_divergence: list[int] = field(default_factory=list)
    """Test-time scaling sweep: divergence factors d (empty = no sweep)."""
    sweep_rollouts: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    """Test-time scaling sweep: rollout budgets."""
    out: str = ""
    """Output folder (default runs/eval-<time>)."""

    def __post_init__(self) -> None:
        if self.split not in ("test", "train"):
            raise ValueError(f"eval.split = {self.split!r}; choose 'test' or 'train'")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"eval.sampler = {self.sampler!r}; choose one of {SAMPLERS}")
        for name in ("k", "sweep_divergence", "sweep_rollouts"):
            if any(v < 1 for v in getattr(self, name)):
                raise ValueError(f"eval.{name} = {getattr(self, name)}; values must be >= 1")
        if self.divergence < 1 or self.resamples < 1:
            raise ValueError("eval.divergence and eval.resamples must be >= 1")


def score_answers(records: list[Prompt], texts: list[list[str]], scorer) -> list[dict]:
    """[{"data_source", "preds", "correct"}] per record, judged by the reward router."""
    items = [(r.data_source, t, r.ground_truth, r.extra_info) for r, ts in zip(records, texts) for t in ts]
    details = scorer.score_details(items)
    out, pos = [], 0
    for r, ts in zip(records, texts):
        got = details[pos : pos + len(ts)]
        pos += len(ts)
        out.append({"data_source": r.data_source, "preds": [d["pred"] for d in got],
                    "correct": [d["acc"] for d in got]})
    return out


def scaling_sweep(records: list[Prompt], engine, tokenizer, scorer, base: SampleSettings, divergences: list[int],
                  rollouts: list[int]) -> list[dict]:
    """Accuracy against rollouts per divergence factor (TreePO Fig. 9), plus sequential sampling as d = 1.

    d = 1 is sequential sampling (no branching); a tree of d > 1 needs at least d rollouts, so its curve starts
    at w = d. Each point: majority-vote accuracy over the w answers ("major"), mean accuracy ("mean"), any
    correct ("any"), averaged over problems, and the generated tokens.
    """
    points = []
    for d in divergences:
        for w in rollouts:
            if w < d:
                continue
            s = SampleSettings(**{**base.__dict__, "sampler": "sequential" if d == 1 else "treepo", "n": w,
                                  "divergence": d})
            counters: dict = {}
            scored = score_answers(records, sample_answers(records, engine, tokenizer, s, counters), scorer)
            points.append({
                "divergence": d,
                "rollouts": w,
                "major": float(sum(major_at_k(p["preds"], p["correct"], w) for p in scored) / len(scored)),
                "mean": float(sum(mean_accuracy(p["correct"]) for p in scored) / len(scored)),
                "any": float(sum(pass_at_k(w, int(sum(p["correct"])), w) for p in scored) / len(scored)),
                "generated_tokens": int(counters["generated_tokens"]),
                "forward_tokens": int(counters.get("forward_tokens", 0)),
                "sampling_s": round(counters["wall_s"], 2),
            })
            print(f"sweep d={d} rollouts={w}: major {points[-1]['major']:.3f}  mean {points[-1]['mean']:.3f}  "
                  f"any {points[-1]['any']:.3f}", flush=True)
    return points


def plot_sweep(points: list[dict], path: Path, title: str = "") -> None:
    """Majority-vote accuracy against rollouts (log scale), one curve per divergence factor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6, 4))
    for d in sorted({p["divergence"] for p in points}):
        pts = sorted((p["rollouts"], p["major"]) for p in points if p["divergence"] == d)
        label = "sequential (d=1)" if d == 1 else f"tree, d={d}"
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({p["rollouts"] for p in points}))
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("rollouts per problem")
    ax.set_ylabel("majority-vote accuracy")
    ax.set_title(title or "test-time scaling by divergence factor")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate_records(records: list[Prompt], engine, tokenizer, scorer, settings: SampleSettings, ecfg: EvalConfig,
                     out: Path, model_name: str, data_name: str) -> dict:
    """Sample, score and summarise `records`; write eval.json (and the sweep's files) under `out`; returns the
    report."""
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    scored = score_answers(records, sample_answers(records, engine, tokenizer, settings), scorer)
    n = len(scored[0]["correct"])
    ks = [k for k in ecfg.k if k <= n]
    metrics = summarize(scored, ks=ks, resamples=ecfg.resamples, seed=settings.seed)
    report = {"model": model_name, "data": data_name, "split": ecfg.split, "problems": len(records),
              "settings": settings.__dict__, "wall_s": round(time.perf_counter() - start, 2), "metrics": metrics}
    (out / "eval.json").write_text(json.dumps(report, indent=2))
    print(f"{len(records)} problems, {n} answers each ({settings.sampler}, temperature {settings.temperature}):")
    for key, value in sorted(metrics.items()):
        print(f"  {key:<32} {value:.4f}" if isinstance(value, float) else f"  {key:<32} {value}")
    if ecfg.sweep_divergence:
        points = scaling_sweep(records, engine, tokenizer, scorer, settings, ecfg.sweep_divergence,
                               ecfg.sweep_rollouts)
        (out / "sweep.json").write_text(json.dumps({"model": model_name, "data": data_name,
                                                    "problems": len(records), "points": points}, indent=2))
        plot_sweep(points, out / "sweep.png", f"{Path(model_name).name} on {data_name} ({len(records)} problems)")
    print(f"wrote {out / 'eval.json'}" + (f", {out / 'sweep.json'}, {out / 'sweep.png'}" if ecfg.sweep_divergence
                                         else ""))
    return report
