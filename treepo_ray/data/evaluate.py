"""`treepo-ray eval`: Pass@1 / Major@k / pass@k of a model on a dataset, and a test-time scaling sweep.

Samples n answers per problem with the project's own engine and growers (sequential i.i.d. paths or TreePO
trees), scores them through the reward router, and reports per data source and overall (metrics.summarize).
`--sweep-divergence 1,2,4 --sweep-rollouts 2,4,8,16` adds TreePO's test-time scaling study (Figure 9): for each
divergence factor d (branches at every divergence point: the root's children and each path's share per round)
and each rollout budget w >= d, one tree of w trajectories per problem; accuracy is the majority vote over the w
answers (and the mean and any-correct rates beside it). Written as sweep.json and sweep.png.

    treepo-ray eval                                    # the tiny base model on the synthetic task's test split
    treepo-ray eval --model runs/x/ckpt --data data/ --n 16 --k 1,4,16 --sampler treepo --divergence 4
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from treepo_ray.data.metrics import major_at_k, mean_accuracy, pass_at_k, summarize
from treepo_ray.data.prompts import Prompt
from treepo_ray.data.sampling import SAMPLERS, SampleSettings, sample_answers


def score_answers(records: list[Prompt], texts: list[list[str]], scorer) -> list[dict]:
    """[{"data_source", "preds", "correct"}] per record, judged by the reward router."""
    items = [(r.data_source, t, r.ground_truth) for r, ts in zip(records, texts) for t in ts]
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


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="treepo-ray eval", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="HF model directory (default: the tiny base model, built if needed)")
    p.add_argument("--data", default="synthetic",
                   help="a synthetic task ('synthetic': running sums, 'synthetic_addition'), a .jsonl/.parquet "
                        "file, a folder with train.*/test.*, or 'train,test' files")
    p.add_argument("--split", choices=("test", "train"), default="test", help="split of a two-split dataset")
    p.add_argument("--limit", type=int, default=200, help="evaluate the first N problems (0 = all)")
    p.add_argument("--cache-dir", default=".cache/treepo-ray", help="cache of the base model and synthetic data")
    p.add_argument("--seed", type=int, default=0, help="seed of sampling (and of the synthetic data and base model)")
    p.add_argument("--sampler", choices=SAMPLERS, default="sequential")
    p.add_argument("--n", type=int, default=8, help="answers per problem")
    p.add_argument("--k", type=_ints, default=[1, 4, 8], help="k of pass@k and major@k (k <= n)")
    p.add_argument("--resamples", type=int, default=1000, help="random k-subsets averaged by major@k (k < n)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--segment-len", type=int, default=32)
    p.add_argument("--divergence", type=int, default=2, help="TreePO divergence factor of --sampler treepo")
    p.add_argument("--sweep-divergence", type=_ints, default=[], help="test-time scaling: divergence factors d")
    p.add_argument("--sweep-rollouts", type=_ints, default=[1, 2, 4, 8, 16], help="test-time scaling: budgets")
    p.add_argument("--engine", default="hf", help="generation engine (treepo_ray.engines.make_engine)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    p.add_argument("--timeout", type=float, default=5.0, help="per-answer time limit of the math verifier")
    p.add_argument("--out", default="", help="output folder (default runs/eval-<time>)")
    args = p.parse_args(argv)
    if args.n < 1 or args.limit < 0:
        p.error("--n must be >= 1 and --limit >= 0")
    if args.temperature < 0:
        p.error("--temperature must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from transformers import AutoTokenizer

    from treepo_ray.data.datasets import load_dataset, load_records
    from treepo_ray.engines import make_engine
    from treepo_ray.rewards.router import BatchScorer

    if args.model:
        model = Path(args.model)
    else:
        from treepo_ray.data.pretrain import base_model_config, prepare_base_model

        model = prepare_base_model(args.cache_dir, seed=args.seed, cfg=base_model_config(args.data))
    tokenizer = AutoTokenizer.from_pretrained(model)
    if Path(args.data).is_file():
        records = load_dataset(args.data, tokenizer).records
    else:
        train, test = load_records(argparse.Namespace(name=args.data, seed=args.seed), tokenizer, args.cache_dir)
        records = test if args.split == "test" else train
        if not records:
            raise ValueError(f"--data {args.data!r} has no {args.split} split")
    if args.limit:
        records = records[: args.limit]
    out = Path(args.out or f"runs/eval-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)

    kwargs = {"num_threads": args.threads, "seed": args.seed} if args.engine == "hf" else {}
    engine = make_engine(args.engine, model, **kwargs)
    settings = SampleSettings(sampler=args.sampler, n=args.n, temperature=args.temperature, top_p=args.top_p,
                              max_new_tokens=args.max_new_tokens, segment_len=args.segment_len,
                              divergence=args.divergence, seed=args.seed)
    with BatchScorer(timeout_s=args.timeout) as scorer:
        start = time.perf_counter()
        scored = score_answers(records, sample_answers(records, engine, tokenizer, settings), scorer)
        n = len(scored[0]["correct"])
        ks = [k for k in args.k if k <= n]
        metrics = summarize(scored, ks=ks, resamples=args.resamples, seed=args.seed)
        report = {"model": str(model), "data": args.data, "split": args.split, "problems": len(records),
                  "settings": settings.__dict__, "wall_s": round(time.perf_counter() - start, 2), "metrics": metrics}
        (out / "eval.json").write_text(json.dumps(report, indent=2))
        print(f"{len(records)} problems, {n} answers each ({settings.sampler}, temperature {settings.temperature}):")
        for key, value in sorted(metrics.items()):
            print(f"  {key:<32} {value:.4f}" if isinstance(value, float) else f"  {key:<32} {value}")
        if args.sweep_divergence:
            points = scaling_sweep(records, engine, tokenizer, scorer, settings, args.sweep_divergence,
                                   args.sweep_rollouts)
            (out / "sweep.json").write_text(json.dumps({"model": str(model), "data": args.data,
                                                        "problems": len(records), "points": points}, indent=2))
            plot_sweep(points, out / "sweep.png", f"{Path(model).name} on {args.data} ({len(records)} problems)")
    print(f"wrote {out / 'eval.json'}" + (f", {out / 'sweep.json'}, {out / 'sweep.png'}" if args.sweep_divergence else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
