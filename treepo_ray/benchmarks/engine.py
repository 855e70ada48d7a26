"""`treepo-ray bench`: tree vs sequential sampling throughput on one engine, in one process.

Both modes grow the same prompts with the same engine, model, width (trajectories per prompt), sampling parameters
and response budget (max_depth x segment_len tokens). Sequential is plain i.i.d. sampling: the root asks for
`width` children of the whole budget in one segment. Tree is TreePO (binary initial divergence, branch factor 2).
The model is random, so to make every path use its full budget (and the two modes generate comparable amounts),
the bench samples at temperature 1.0 with EOS ignored (engine `stop_at_eos` off, growers given no EOS id) and
without the repetition check; no random text holds a complete \\boxed{}.

Defaults: 8 prompts x 16 paths x 256 tokens, depth 8 x segments of 32 (token bound ~1.36); `--sweep` runs the
depth x segment configurations of the same budget (2x128, 4x64, 8x32, 16x16) and saves the TreePO paper's
Figure 4/5-shaped plots (TrajPS and TokenPS per configuration). The built model is a random Qwen2 of hidden size
512, 4 layers, 8 query heads sharing one KV head (12M parameters): large enough that a decode step's time grows
with its rows, not its fixed cost.
Timing: one untimed warm-up, then `--repeats` runs of each mode in alternating order; the fastest run of each mode
is kept, and every run's wall and CPU time is in the JSON. One torch thread by default: with other processes on
the cores, OpenMP threads that wait for each other are much slower and far noisier.

Reference mode (`hf_generate`, off with --no-reference): Hugging Face `generate` with i.i.d. sampling on the same
model, prompts, sampling parameters and budget, every prompt repeated `width` times and left-padded, in batches of
at most --max-batch-size (what TRL's GRPO trainer does). It runs alongside the first config's repeats (after each of
its tokens, one engine step of each mode, timed apart), and every config's ratios compare with it
(`tree_over_hf_generate`, `sequential_over_hf_generate`, and by CPU time).

Reported per mode: trajectories, generated_tokens (every node's segment), forward_tokens (every position run
through the model), unique_tree_tokens (prompt once + every node's segment once), wall_s, traj_per_s, tok_per_s
(generated tokens / s), forward_tok_per_s (the paper's TokenPS: model-processed tokens / s), traj_tok_per_s
(trajectory response tokens / s) and a time breakdown (the engine's phases; `driver` is the rest: growers and requests).
Ratios: token_bound = sequential forward_tokens / tree forward_tokens (the speedup a perfect engine would get),
speedup = tree traj/s / sequential traj/s, speedup_over_bound, and the same speedup by CPU time. `decode_step_ms`
times one decode forward at a few batch sizes and lengths: a step's fixed cost (which a tree's narrow first
segments pay in full) and its attention cost (which grows with the length, and which the tree shares no better
than sequential sampling) are where the distance to the bound comes from.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from treepo_ray.engines import make_engine
from treepo_ray.engines.base import SamplingParams
from treepo_ray.engines.driver import GrowLoop
from treepo_ray.engines.hf import HFEngine
from treepo_ray.engines.hub import resolve_model_path
from treepo_ray.tree import SequentialConfig, SequentialGrower, Tree, TreePOConfig, TreePOGrower

PROMPTS = [
    "Question: What is 17 * 23? Think step by step.\nAnswer:",
    "Question: A train travels 120 km in 1.5 hours. What is its average speed in km/h?\nAnswer:",
    "Question: Solve for x: 3x + 7 = 25.\nAnswer:",
    "Question: How many primes are there below 30?\nAnswer:",
    "Question: The sum of two numbers is 40 and their difference is 12. What is the larger one?\nAnswer:",
    "Question: What is the remainder when 2^10 is divided by 7?\nAnswer:",
    "Question: A rectangle has perimeter 36 and one side of length 7. What is its area?\nAnswer:",
    "Question: Compute 1 + 2 + ... + 50.\nAnswer:",
]
SWEEP = [(2, 128), (4, 64), (8, 32), (16, 16)]
MODES = ("sequential", "tree")
REFERENCE = "hf_generate"
"""The reference mode: Hugging Face generate, i.i.d. (see HFGenerate)."""


def engine_specs(text: str) -> list[tuple[str, str, dict]]:
    """`--engine`'s list as (label, engine name, keyword arguments): 'hf:attention_blocks=1:max_cache_tokens=4096'
    is the hf engine given those two arguments (values read as YAML scalars), labelled by the whole spec."""
    out = []
    for spec in [e.strip() for e in text.split(",") if e.strip()]:
        name, *pairs = spec.split(":")
        kwargs = {}
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not eq or not key:
                raise ValueError(f"--engine {spec!r}: {pair!r} is not key=value")
            kwargs[key] = yaml.safe_load(value)
        out.append((spec, name, kwargs))
    return out


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The options the engine and stream benches share: engines, tree shape, sampling and the built model."""
    p.add_argument("--model", help="a model directory, cached hub id or GGUF file (pkg:PACKAGE/FILE for a package's; "
                                    "default: build a random tiny Qwen2 in a temp dir)")
    p.add_argument("--engine", default="hf",
                   help="comma-separated engines (treepo_ray.engines.ENGINES), each optionally with keyword arguments "
                        "for it: 'hf,hf:attention_blocks=1' runs the hf engine as it is, then with one attention block")
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=16, help="trajectories per prompt (w)")
    p.add_argument("--depth", type=int, default=8, help="max depth (segments per path) of the tree")
    p.add_argument("--segment-len", type=int, default=32, help="tokens per segment")
    p.add_argument("--init-divergence", type=int, default=2, help="children of the root (2 = binary)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--hidden", type=int, default=512, help="hidden size of the built tiny model")
    p.add_argument("--layers", type=int, default=4, help="layers of the built tiny model")
    p.add_argument("--heads", type=int, default=8, help="attention heads of the built tiny model")
    p.add_argument("--kv-heads", type=int, default=1, help="key/value heads of the built tiny model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="treepo-ray bench", description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--prompts", type=int, default=8, help="number of prompts (cycled from a built-in list)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per mode and config (the fastest is kept)")
    p.add_argument("--sweep", action="store_true", help=f"run depth x segment configs {SWEEP} (same budget)")
    p.add_argument("--budget", type=int, default=256, help="response tokens per path in --sweep (depth x segment)")
    p.add_argument("--plot-dir", help="where --sweep saves its PNG plots (default: beside --json, else .)")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (1 is steadiest when other processes share the cores; 0 = torch default)")
    p.add_argument("--no-reference", action="store_true",
                   help=f"skip the reference mode ({REFERENCE}: Hugging Face generate, i.i.d.)")
    return p.parse_args(argv)


def build_model(args: argparse.Namespace, where: Path) -> Path:
    from treepo_ray.engines.tiny import TinyModelConfig, build_tiny_model

    cfg = TinyModelConfig(
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        max_positions=2048,
        seed=args.seed,
    )
    return build_tiny_model(where, cfg)


def make_growers(mode: str, prompts: list[list[int]], args, depth: int, seg: int, decode, align: int = 0) -> list:
    """`align`: the engine's segment_align (vLLM's KV block size; see PathLimits.segment_align)."""
    # eos_token_id=-1: the growers never see an EOS, so every path runs its full budget (see module docstring).
    common = dict(eos_token_id=-1, decode=decode)
    align = align if seg % max(align, 1) == 0 else 0  # segments that are no multiple of a block cannot be aligned
    out = []
    for i, ids in enumerate(prompts):
        tree = Tree(list(ids), query_id=f"p{i}")
        if mode == "tree":
            cfg = TreePOConfig(width=args.width, max_depth=depth, segment_len=seg,
                               init_divergence=args.init_divergence, repetition_substr_len=0, segment_align=align)
            out.append(TreePOGrower(tree, cfg, seed=args.seed + i, **common))
        else:
            cfg = SequentialConfig(group_size=args.width, max_depth=1, segment_len=depth * seg,
                                   repetition_substr_len=0, segment_align=align)
            out.append(SequentialGrower(tree, cfg, seed=args.seed + i, **common))
    return out


def decode_step_seconds(engine: HFEngine, rows: int, length: int, repeats: int = 5) -> float:
    """Median seconds of one decode forward of `rows` sequences at position `length` (on a scratch KV buffer):
    what the per-step fixed cost and the attention share are made of."""
    net = engine.decoder
    if rows < 1 or not 1 <= length <= net.max_positions:
        raise ValueError(f"rows must be >= 1 and length in [1, {net.max_positions}]")
    kv = net.new_buffer(rows, length)
    ids = torch.zeros(rows, 1, dtype=torch.long, device=engine.device)
    pos = torch.full((rows, 1), length - 1, device=engine.device)
    mask = torch.zeros(rows, 1, 1, length, dtype=kv.dtype, device=engine.device)
    times = []
    with torch.inference_mode():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            net.forward(kv, 0, ids, pos, mask, None)
            if engine.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return sorted(times[1:])[repeats // 2]


def _mode_report(r: dict, cpu: float) -> dict:
    phases = {k[len("time_") : -len("_s")]: v for k, v in r.items() if k.startswith("time_")}
    phases["driver"] = max(r["wall_s"] - sum(phases.values()), 0.0)
    return {
        "trajectories": r["trajectories"],
        "generated_tokens": r["generated_tokens"],
        "forward_tokens": r["forward_tokens"],
        "unique_tree_tokens": r["unique_tree_tokens"],
        "wall_s": r["wall_s"],
        "cpu_s": cpu,
        "traj_per_s": r["trajectories"] / r["wall_s"],
        "tok_per_s": r["generated_tokens"] / r["wall_s"],
        # The TreePO paper's TokenPS: every token the model processed (prefill and decode) per second.
        "forward_tok_per_s": r["forward_tokens"] / r["wall_s"],
        # Response tokens of all trajectories (shared segments counted once per trajectory) per second.
        "traj_tok_per_s": r["trajectory_tokens"] / r["wall_s"],
        "forward_over_unique": r["forward_tokens"] / r["unique_tree_tokens"],
        "decode_steps": r["decode_steps"],
        "cache_hits": r.get("cache_hits", 0),
        "evictions": r.get("evictions", 0),
        "time_s": phases,
    }


class HFGenerate:
    """The reference mode: Hugging Face `generate` with i.i.d. sampling, as TRL's GRPO trainer samples. Every prompt
    repeated `width` times, left-padded, in batches of at most max_batch_size sequences (one call per batch,
    transformers' default dynamic KV cache); same model, sampling parameters and response budget as the other modes,
    EOS ignored like theirs."""

    def __init__(self, model_path: Path, device: str, tokenizer):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
        self.device = device
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def run(self, prompts: list[list[int]], args, budget: int, between=None) -> dict:
        """Sample; `between()` runs after every generated token (other modes' steps, timed apart from this one)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        class Interleave(StoppingCriteria):
            wall = cpu = 0.0

            def __call__(self, input_ids, scores, **kwargs):
                if between is not None:
                    w, c = time.perf_counter(), time.process_time()
                    between()
                    self.wall += time.perf_counter() - w
                    self.cpu += time.process_time() - c
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        torch.manual_seed(args.seed)
        rows = [list(p) for p in prompts for _ in range(args.width)]
        # top_k=0 is off in transformers too (its unset default would be 50).
        sampled = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        wall = cpu = 0.0
        tokens = 0
        for i in range(0, len(rows), args.max_batch_size):
            chunk = rows[i : i + args.max_batch_size]
            width = max(len(r) for r in chunk)
            ids = torch.tensor([[self.pad] * (width - len(r)) + r for r in chunk], device=self.device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk], device=self.device)
            crit = Interleave()
            w, c = time.perf_counter(), time.process_time()
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=budget, eos_token_id=None,
                    pad_token_id=self.pad, stopping_criteria=StoppingCriteriaList([crit]),
                    **(sampled if args.temperature > 0 else {"do_sample": False}),
                )
            wall += time.perf_counter() - w - crit.wall
            cpu += time.process_time() - c - crit.cpu
            tokens += (out.shape[1] - width) * len(chunk)
        return {"trajectories": len(rows), "generated_tokens": tokens, "wall_s": wall, "cpu_s": cpu,
                "traj_per_s": len(rows) / wall, "tok_per_s": tokens / wall}


def run_pair(engines: dict, order: tuple[str, ...], prompts, args, depth: int, seg: int, decode, bar,
             reference: HFGenerate | None = None) -> dict:
    """Grow both modes at once, alternating one engine step of each (in `order`), each mode on its own engine; with
    `reference`, Hugging Face generate runs alongside (one step of each mode after each token it generates).

    A mode's wall_s is the time spent in its own steps: the other processes on the machine slow both modes alike,
    where timing them one after the other would compare a busy minute with a quiet one.
    """
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    loops = {m: GrowLoop(make_growers(m, prompts, args, depth, seg, decode, getattr(engines[m], "segment_align", 0)),
                         engines[m], params,
                         stop_at_eos=False, progress=bar) for m in order}
    cpu = dict.fromkeys(order, 0.0)
    active = list(order)

    def step_each() -> None:
        for m in list(active):
            start = time.process_time()
            more = loops[m].step()
            cpu[m] += time.process_time() - start
            if not more:
                active.remove(m)

    out = {}
    if reference is not None:
        out[REFERENCE] = reference.run(prompts, args, depth * seg, between=step_each)
    while active:
        step_each()
    for m in order:
        summary = loops[m].summary()
        summary["trajectory_tokens"] = sum(len(g.tree.response_ids(n)) for g in loops[m].growers
                                           for n in g.tree.trajectories)
        out[m] = _mode_report(summary, cpu[m])
    return out


def run_config(engines: dict, prompts, args, depth: int, seg: int, decode, bar,
               reference: HFGenerate | dict | None = None) -> dict:
    """`repeats` paired runs (which mode steps first alternates). The fastest run of each mode is kept: other
    processes only ever add time, so the minimum is the least disturbed measurement (as timeit does).
    `reference`: HFGenerate to run alongside, or the result of an earlier config's (same budget) to compare with."""
    modes = MODES + ((REFERENCE,) if isinstance(reference, HFGenerate) else ())
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        pair = run_pair(engines, MODES if rep % 2 == 0 else MODES[::-1], prompts, args, depth, seg, decode, bar,
                        reference if isinstance(reference, HFGenerate) else None)
        for mode in modes:
            runs[mode].append(pair[mode])
    out: dict = {"depth": depth, "segment_len": seg}
    for mode in modes:
        out[mode] = dict(min(runs[mode], key=lambda r: r["wall_s"]))
        out[mode]["wall_s_runs"] = [round(r["wall_s"], 4) for r in runs[mode]]
        out[mode]["cpu_s_runs"] = [round(r["cpu_s"], 4) for r in runs[mode]]
    if isinstance(reference, dict):
        out[REFERENCE] = reference
    s, t = out["sequential"], out["tree"]
    bound = s["forward_tokens"] / t["forward_tokens"]
    speedup = t["traj_per_s"] / s["traj_per_s"]
    out["ratios"] = {
        "token_bound": bound,
        "speedup": speedup,
        "speedup_over_bound": speedup / bound,
        "tok_per_s": t["tok_per_s"] / s["tok_per_s"],
        "speedups_per_repeat": [round(a / b, 4) for a, b in zip(s["wall_s_runs"], t["wall_s_runs"])],
        "median_speedup": statistics.median(s["wall_s_runs"]) / statistics.median(t["wall_s_runs"]),
        # Process CPU time instead of wall time: steadier still when other processes compete for the cores.
        "cpu_speedup": min(s["cpu_s_runs"]) / min(t["cpu_s_runs"]),
    }
    if REFERENCE in out:  # ours against the stock path, trajectories per second (and per CPU second)
        g = out[REFERENCE]
        for mode in MODES:
            out["ratios"][f"{mode}_over_{REFERENCE}"] = out[mode]["traj_per_s"] / g["traj_per_s"]
            out["ratios"][f"{mode}_over_{REFERENCE}_cpu"] = min(g["cpu_s_runs"]) / min(out[mode]["cpu_s_runs"])
        if isinstance(reference, HFGenerate):
            out["ratios"][f"tree_over_{REFERENCE}_per_repeat"] = [
                round(a / b, 4) for a, b in zip(g["wall_s_runs"], t["wall_s_runs"])]
    return out


def table(results: list[dict], engine: str) -> str:
    head = (f"{'engine':<6} {'depth':>5} {'seg':>4} {'mode':<11} {'traj':>5} {'gen_tok':>8} {'fwd_tok':>8} "
            f"{'fwd/uniq':>8} {'wall_s':>7} {'traj/s':>7} {'tok/s':>8}")
    lines = [head]
    for r in results:
        for mode in MODES:
            m = r[mode]
            lines.append(
                f"{engine:<6} {r['depth']:>5} {r['segment_len']:>4} {mode:<11} {m['trajectories']:>5} "
                f"{m['generated_tokens']:>8} {m['forward_tokens']:>8} {m['forward_over_unique']:>8.3f} "
                f"{m['wall_s']:>7.2f} {m['traj_per_s']:>7.2f} {m['tok_per_s']:>8.0f}"
            )
        if REFERENCE in r:
            g = r[REFERENCE]
            lines.append(f"{'':<6} {'':>5} {'':>4} {REFERENCE:<11} {g['trajectories']:>5} {g['generated_tokens']:>8} "
                         f"{'':>8} {'':>8} {g['wall_s']:>7.2f} {g['traj_per_s']:>7.2f} {g['tok_per_s']:>8.0f}")
        q = r["ratios"]
        lines.append(
            f"{'':<6} {'':>5} {'':>4} tree/seq    token_bound {q['token_bound']:.2f}  speedup {q['speedup']:.2f}  "
            f"speedup/bound {q['speedup_over_bound']:.2f}  per repeat {q['speedups_per_repeat']}  "
            f"cpu-time speedup {q['cpu_speedup']:.2f}"
        )
        if REFERENCE in r:
            lines.append(
                f"{'':<6} {'':>5} {'':>4} vs {REFERENCE}  tree {q[f'tree_over_{REFERENCE}']:.2f}x  sequential "
                f"{q[f'sequential_over_{REFERENCE}']:.2f}x  (cpu time: tree {q[f'tree_over_{REFERENCE}_cpu']:.2f}x)"
            )
    return "\n".join(lines)


def plot(results: list[dict], engine: str, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    labels = [f"d{r['depth']}×l{r['segment_len']}" for r in results]
    paths = []
    for key, title in (("traj_per_s", "trajectories / s"), ("forward_tok_per_s", "model-processed tokens / s")):
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for mode, marker in zip(MODES, "os"):
            ax.plot(labels, [r[mode][key] for r in results], marker=marker, label=mode)
        for x, r in enumerate(results):
            ax.annotate(f"×{r['ratios']['speedup']:.2f}\n(bound {r['ratios']['token_bound']:.2f})",
                        (x, r["tree"][key]), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        ax.margins(y=0.25)  # room for the annotations
        ax.set_xlabel("depth × segment length (equal budget)")
        ax.set_ylabel(title)
        ax.set_title(f"{engine}: {title}")
        ax.legend()
        fig.tight_layout()
        path = out_dir / f"bench_{engine}_{key}.png"
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(str(path))
    return paths


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.width < 1 or args.prompts < 1 or args.repeats < 1 or args.depth < 1 or args.segment_len < 1:
        print("bench: --width, --prompts, --repeats, --depth and --segment-len must be >= 1", file=sys.stderr)
        return 2
    try:
        specs = engine_specs(args.engine)
    except ValueError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    if args.sweep:
        configs = [(d, args.budget // d) for d, _ in SWEEP if args.budget // d >= 1]
    else:
        configs = [(args.depth, args.segment_len)]
    from tqdm import tqdm
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model_path = (Path(resolve_model_path(args.model, "--model")) if args.model
                      else build_model(args, Path(tmp) / "model"))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(args.prompts)]
        report: dict = {"command": ["treepo-ray", "bench", *(sys.argv[1:] if argv is None else argv)],
                        "settings": {k: v for k, v in vars(args).items()}, "engines": {}}
        for name, engine_name, engine_kw in specs:
            kw = {"num_threads": args.threads} if args.threads > 0 and args.device == "cpu" else {}
            # One engine per mode (same model, same settings), so the two modes can be stepped alternately.
            engines = {m: make_engine(engine_name, str(model_path), device=args.device,
                                      max_batch_size=args.max_batch_size, **kw, **engine_kw) for m in MODES}
            n_runs = 1 + len(configs) * args.repeats
            bar = tqdm(total=n_runs * 2 * len(prompts), desc=f"bench {name}", unit="tree",
                       disable=args.no_progress, file=sys.stderr)
            reference = None if args.no_reference else HFGenerate(model_path, args.device, tokenizer)
            # Warm up once (allocations, kernels) on the first config, untimed.
            run_pair(engines, MODES, prompts, args, configs[0][0], configs[0][1], tokenizer.decode, bar)
            results = []
            for d, s in configs:  # the reference once, with the first config (every config has the same budget)
                results.append(run_config(engines, prompts, args, d, s, tokenizer.decode, bar, reference))
                reference = results[0].get(REFERENCE)
            bar.close()
            engine = engines["tree"]
            entry: dict = {"results": results}
            if isinstance(engine, HFEngine):
                # Where a decode step's time goes: a fixed part (weights streamed once per step, Python) that a
                # tree's narrow first segments pay in full, and attention that grows with the sequence length.
                longest = max(len(p) for p in prompts) + max(d * s for d, s in configs)
                entry["decode_step_ms"] = {
                    f"rows{r}_len{n}": 1e3 * decode_step_seconds(engine, r, n)
                    for r in (1, args.width * len(prompts) // 8, args.width * len(prompts)) for n in (32, longest)
                }
            print(table(results, name))
            if "decode_step_ms" in entry:
                print("decode step ms:", {k: round(v, 1) for k, v in entry["decode_step_ms"].items()})
            if args.sweep:
                plot_dir = Path(args.plot_dir or (Path(args.json).parent if args.json else "."))
                entry["plots"] = plot(results, name, plot_dir)
                best = max(results, key=lambda r: r["ratios"]["speedup"])
                entry["best"] = {"depth": best["depth"], "segment_len": best["segment_len"], **best["ratios"]}
                print("plots:", ", ".join(entry["plots"]))
            else:
                entry.update({m: results[0][m] for m in MODES + (REFERENCE,) if m in results[0]},
                             ratios=results[0]["ratios"])
            report["engines"][name] = entry
            del engine, engines
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=_jsonable))
        print("wrote", args.json)
    return 0


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
