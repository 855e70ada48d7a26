"""`treepo-ray bench stream`: tree vs sequential rollout throughput as training sees it, a stream through one engine.

    treepo-ray bench stream [--engine hf,vllm] [--prompts 64] [--max-batch-size 128] [--json FILE] ...

`treepo-ray bench` grows one batch from start to end, so a tree's narrow first segments run at a fraction of the
engine's rows. Training keeps many trees in flight instead: every tree grows at its own pace (no depth barrier
across prompts) and new prompts come in as others finish. Here a stream of prompts goes through one engine whose
batch is capped at `--max-batch-size` sequences, fed by `engines/driver.py`'s `StreamLoop` (the growers and
tracker the schedulers use): a new prompt is admitted whenever the engine has room for more sequences than it
runs or holds waiting (or, with `--in-flight N`, whenever fewer than N prompts are growing).

Both modes (sequential: `width` i.i.d. paths of the whole budget; tree: TreePO, binary initial divergence) grow the
same prompts with the same model, width and response budget (depth x segment_len), each on its own engine, stepped
in turn in one process so that other load on the machine slows both alike: paced by the warm-up's forward tokens per
prompt, so that both streams also end together (the engine bench's workload: a random Qwen2 built here, temperature
1, EOS and repetition checks off so every path uses its budget).

Reported per mode: trajectories, traj_per_s, generated_tokens, forward_tokens (every position run through the
model), forward_over_unique, steps (engine iterations that sampled), mean_batch (sequences that sampled a token,
per step), at_cap (share of steps whose batch was full) and the engine's time breakdown. Ratios: token_bound =
sequential forward_tokens / tree forward_tokens, speedup = tree traj/s / sequential traj/s, speedup_over_bound, and
the same speedup by process CPU time (cpu_speedup, cpu_speedup_over_bound). An engine that asks for aligned
segments (vLLM: `segment_align`, its KV block size) gets them in both modes.

`--entropy-cost` measures what reporting each token's entropy (SamplingParams.entropy) costs instead: the tree
stream twice, the same prompts, seeds and trees, with the entropy off and on, each on its own engine and stepped in
turn as above. Reported per side as well: engine_s (the engine's own time: its `time_*` phases), decode_tok_per_s
(generated tokens per second of it) and entropy_tokens (tokens given an entropy); ratios: decode_tok_per_s (on /
off), tok_per_s (on / off, by wall time), cpu_tok_per_s (on / off, by process CPU time) and same_tokens (both sides
sampled the same tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from treepo_ray.benchmarks.engine import (MODES, PROMPTS, _jsonable, add_workload_args, build_model, engine_specs,
                                          make_growers)
from treepo_ray.engines import make_engine
from treepo_ray.engines.base import SamplingParams
from treepo_ray.engines.driver import StreamLoop
from treepo_ray.engines.hub import resolve_model_path


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="treepo-ray bench stream",
                                description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--prompts", type=int, default=64, help="prompts in the stream")
    p.add_argument("--max-batch-size", type=int, default=128, help="the engine's cap on sequences run at once")
    p.add_argument("--in-flight", type=int, default=0,
                   help="prompts growing at once (0 = admit whenever the engine has room)")
    p.add_argument("--warmup-prompts", type=int, default=8, help="prompts of the untimed warm-up stream")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch default)")
    p.add_argument("--entropy-cost", action="store_true",
                   help="run the tree stream with SamplingParams.entropy off and on instead of tree vs sequential")
    return p.parse_args(argv)


def stream_prompts(tokenizer, n: int) -> list[list[int]]:
    """`n` distinct prompts (numbered, so no two share a cached prompt), cycling the engine bench's questions."""
    return [tokenizer.encode(f"#{i} {PROMPTS[i % len(PROMPTS)]}") for i in range(n)]


def lanes(args) -> dict[str, tuple[str, SamplingParams]]:
    """The streams run side by side: label -> (grower mode, sampling parameters)."""
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if args.entropy_cost:  # the same tree stream, each token's entropy reported or not
        return {"entropy_off": ("tree", params), "entropy_on": ("tree", replace(params, entropy=True))}
    return {m: (m, params) for m in MODES}


def mode_report(r: dict, cpu_s: float) -> dict:
    phases = {k[len("time_"):-len("_s")]: v for k, v in r.items() if k.startswith("time_")}
    engine_s = sum(phases.values())
    phases["driver"] = max(r["wall_s"] - engine_s, 0.0)
    steps = max(r.get("steps", 0), 1)
    return {
        "trajectories": r["trajectories"],
        "traj_per_s": r["trajectories"] / r["wall_s"],
        "generated_tokens": r["generated_tokens"],
        "forward_tokens": r["forward_tokens"],
        "unique_tree_tokens": r["unique_tree_tokens"],
        "forward_over_unique": r["forward_tokens"] / r["unique_tree_tokens"],
        "tok_per_s": r["generated_tokens"] / r["wall_s"],
        "engine_s": engine_s,
        "decode_tok_per_s": r["generated_tokens"] / engine_s if engine_s else 0.0,
        "wall_s": r["wall_s"],
        "cpu_s": cpu_s,
        "steps": r.get("steps", 0),
        "mean_batch": r.get("step_sequences", 0) / steps,
        "at_cap": r.get("steps_at_cap", 0) / steps,
        "time_s": phases,
    }


def run_streams(engines: dict, prompts: list[list[int]], args, decode, bar=None, pace: dict | None = None) -> dict:
    """Both lanes' streams (`lanes`), stepped in turn; a lane's wall_s is the time of its own steps.

    `pace`: each lane's expected forward tokens per prompt (from the warm-up). With it, the lane whose share of its
    expected work is done is smaller steps next, so that both streams end together and every background load the
    machine goes through falls on both (plain alternation would leave the longer stream to run alone at the end).
    """
    depth, seg = args.depth, args.segment_len
    loops = {m: StreamLoop(make_growers(mode, prompts, args, depth, seg, decode,
                                        getattr(engines[m], "segment_align", 0)),
                           engines[m], params, stop_at_eos=False, progress=bar, in_flight=args.in_flight)
             for m, (mode, params) in lanes(args).items()}
    start_fwd = {m: engines[m].stats()["forward_tokens"] for m in loops}

    def done_share(m: str) -> float:
        return (engines[m].stats()["forward_tokens"] - start_fwd[m]) / (pace[m] * len(prompts))

    cpu = dict.fromkeys(loops, 0.0)
    active = list(loops)
    while active:
        for m in [min(active, key=done_share)] if pace else list(active):
            start = time.process_time()
            more = loops[m].step()
            cpu[m] += time.process_time() - start
            if not more:
                active.remove(m)
    out = {m: mode_report(loops[m].summary(), cpu[m]) for m in loops}
    if args.entropy_cost:
        off, on = out["entropy_off"], out["entropy_on"]
        tokens = [[g.tree.tokens for g in loops[m].growers] for m in loops]
        for m in loops:  # tokens whose entropy the engine reported (all of them with it on)
            out[m]["entropy_tokens"] = sum(len(e) for g in loops[m].growers for e in g.tree.entropy)
        cpu_rate = {m: out[m]["generated_tokens"] / out[m]["cpu_s"] for m in loops}
        out["ratios"] = {"decode_tok_per_s": on["decode_tok_per_s"] / off["decode_tok_per_s"],
                         "tok_per_s": on["tok_per_s"] / off["tok_per_s"],
                         "cpu_tok_per_s": cpu_rate["entropy_on"] / cpu_rate["entropy_off"],
                         "same_tokens": tokens[0] == tokens[1]}
        return out
    s, t = out["sequential"], out["tree"]
    bound = s["forward_tokens"] / t["forward_tokens"]
    speedup = t["traj_per_s"] / s["traj_per_s"]
    cpu_speedup = s["cpu_s"] / t["cpu_s"]  # process CPU time: steadier when other processes share the cores
    out["ratios"] = {"token_bound": bound, "speedup": speedup, "speedup_over_bound": speedup / bound,
                     "cpu_speedup": cpu_speedup, "cpu_speedup_over_bound": cpu_speedup / bound}
    return out


def table(result: dict, engine: str) -> str:
    lines = [f"{'engine':<6} {'mode':<11} {'traj':>5} {'gen_tok':>8} {'fwd_tok':>8} {'fwd/uniq':>8} {'steps':>6} "
             f"{'batch':>6} {'at_cap':>6} {'wall_s':>7} {'traj/s':>7} {'eng_s':>7} {'dec_tok/s':>9}"]
    for mode, m in result.items():
        if mode == "ratios":
            continue
        lines.append(f"{engine:<6} {mode:<11} {m['trajectories']:>5} {m['generated_tokens']:>8} "
                     f"{m['forward_tokens']:>8} {m['forward_over_unique']:>8.3f} {m['steps']:>6} "
                     f"{m['mean_batch']:>6.1f} {m['at_cap']:>6.2f} {m['wall_s']:>7.2f} {m['traj_per_s']:>7.2f} "
                     f"{m['engine_s']:>7.2f} {m['decode_tok_per_s']:>9.1f}")
    q = result["ratios"]
    if "same_tokens" in q:
        lines.append(f"{'':<6} entropy on/off  decode tok/s {q['decode_tok_per_s']:.3f}  wall tok/s "
                     f"{q['tok_per_s']:.3f}  cpu-time tok/s {q['cpu_tok_per_s']:.3f}  same tokens {q['same_tokens']}")
        return "\n".join(lines)
    lines.append(f"{'':<6} tree/seq   token_bound {q['token_bound']:.3f}  speedup {q['speedup']:.3f}  "
                 f"speedup/bound {q['speedup_over_bound']:.3f}  cpu-time speedup {q['cpu_speedup']:.3f} "
                 f"(/bound {q['cpu_speedup_over_bound']:.3f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    for name in ("prompts", "max_batch_size", "width", "depth", "segment_len"):
        if getattr(args, name) < 1:
            print(f"bench stream: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.in_flight < 0 or args.warmup_prompts < 0:
        print("bench stream: --in-flight and --warmup-prompts must be >= 0", file=sys.stderr)
        return 2
    if args.width > args.max_batch_size:
        print(f"bench stream: --width {args.width} exceeds --max-batch-size {args.max_batch_size}", file=sys.stderr)
        return 2
    try:
        specs = engine_specs(args.engine)
    except ValueError as e:
        print(f"bench stream: {e}", file=sys.stderr)
        return 2
    from tqdm import tqdm
    from transformers import AutoTokenizer

    report: dict = {"command": ["treepo-ray", "bench", "stream", *(sys.argv[1:] if argv is None else argv)],
                    "settings": dict(vars(args)), "engines": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model_path = (Path(resolve_model_path(args.model, "--model")) if args.model
                      else build_model(args, Path(tmp) / "model"))
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        prompts = stream_prompts(tokenizer, args.prompts)
        for name, engine_name, engine_kw in specs:
            kw = {"num_threads": args.threads} if args.threads > 0 and args.device == "cpu" else {}
            engines = {m: make_engine(engine_name, str(model_path), device=args.device,
                                      max_batch_size=args.max_batch_size, **kw, **engine_kw) for m in lanes(args)}
            bar = tqdm(total=2 * (args.warmup_prompts + args.prompts), desc=f"bench stream {name}", unit="tree",
                       disable=args.no_progress, file=sys.stderr)
            pace = None
            if args.warmup_prompts:  # allocations and kernels, untimed (its own prompts: nothing stays cached)
                warm_prompts = stream_prompts(tokenizer, args.prompts + args.warmup_prompts)[args.prompts:]
                warm = run_streams(engines, warm_prompts, args, tokenizer.decode, bar)
                pace = {m: warm[m]["forward_tokens"] / args.warmup_prompts for m in engines}
            result = run_streams(engines, prompts, args, tokenizer.decode, bar, pace)
            bar.close()
            print(table(result, name))
            report["engines"][name] = result
            for engine in engines.values():
                if hasattr(engine, "shutdown"):
                    engine.shutdown()
            del engines
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=_jsonable))
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
