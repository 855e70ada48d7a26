"""`treepo-ray bench learner`: one learner step on the same scored trees, packed (each distinct token once) against
unpacked (one row per trajectory); and the output layer's peak memory at a real vocabulary, full logits against
chunked log-probs.

    treepo-ray bench learner [config.yaml] [--json FILE] [--configs a,b,c] [--rounds N] [--steps N]
                             [--model DIR|HUB_ID|GGUF] [--lora-rank R] [key=value ...]

The model is the job's (model.path, default its tiny base model); `--model` names another, as in the other benches
(a directory, a cached hub id or a GGUF file, pkg:PACKAGE/FILE for a package's, converted once into model.cache_dir),
and stands for model.path (config a's job grows its trees with it too). The random tokens of b and c are ids below
200, inside the tiny model's byte vocabulary and any real model's.

Configs, on the job's tiny base model with the job's learner settings (config file and key=value overrides) and
each algorithm's own loss:
    a   the default CPU job's trees: one batch grown, scored and credited by the job itself (TreePO)
    b   a paper-shaped TreePO tree: w = 16 paths, binary branching (root split in two, then every path in two
        until 16), 8 segments of --segment-len tokens after a prompt of --prompt-len (random tokens and rewards)
    c   a TreeRPO tree: N = 8 children per node, D = 3, segments of --step-len tokens (random tokens, 0/1 leaf
        rewards), trained with the per-node loss (CATPO eq. 7) and TreeRPO's KL term
b and c have no sampled log-probs: they train with learner.off_policy = recompute (a with the job's setting).
    paper  the plan alone (no model, no GPU, a second): a TreePO tree of the paper's size (w = 16 paths, binary
           branching, 14 segments of 512 tokens after a 1024-token prompt) packed under treepo_paper.yaml's
           learner.micro_batch_tokens, and under the learner's default and the longest path for comparison:
           micro-batches, forward tokens and forward / unique (`--configs paper --no-memory` runs it alone)

Each (config, mode) runs in a fresh process, `--rounds` times, alternating which mode goes first. A process loads
the learner, takes the gradient of the batch's loss at the base weights, then times `--steps` train_step calls
(recompute pass if the config needs one, reference forward, forward/backward, optimizer step). Reported per mode:
    forward_tokens   tokens through the policy in one training pass (packed: trees plus repeated ancestors of
                     split trees; unpacked: prompt + response per trajectory, padding not counted)
    unique_tokens    the trees' distinct tokens (prompt once, every segment once)
    step_s           the fastest step over all processes of the mode
    peak_mem_mb      the largest rise of a process's peak RSS over its RSS after loading the learner
    grad_rel_diff    max over parameters of max|g - g_ref| / max|g_ref| at the base weights, with g_ref the
                     unpacked gradient for a and b, a direct per-node computation for c (each node's own path
                     through the plain Hugging Face model, its tokens' mean term times w(T) over the nodes)
and per config the token ratio (unpacked / packed forward tokens) and the step speed-up.

LoRA (`--lora-rank R`, R > 0): per config also `lora`: the packed step with LoRA adapters of rank R (the job's
model.lora_alpha and model.target_modules) against the packed full fine-tuning step, `--rounds` processes each
(alternating), with glibc returning freed memory at once (EXACT_RSS) so the peak RSS follows the live tensors:
step_s, peak_mem_mb and trainable parameters of each, and lora_step_ratio / lora_peak_mem_ratio (LoRA / full; the
issue's target: both below 1).

Memory (`logits_memory`): the output layer alone, --logits-tokens rows against a --logits-vocab vocabulary
(hidden size --logits-hidden), log-probs of random targets and the entropy, then backward: the learner before
(full float32 logits, log_softmax, entropy from them) against now (logprobs.py: chunks of learner.logprob_chunk
rows, recomputed in backward). Each in its own process; peak RSS rise, seconds, and the largest difference of the
two log-probs and entropies.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from treepo_ray.benchmarks.common import parse_job_args, write_json
from treepo_ray.job.config import TrainConfig, load_config, resolve_config
from treepo_ray.job.redact import redacted_overrides

CONFIGS = ("a", "b", "c", "paper")
PLAN_ONLY = ("paper",)
MODES = ("packed", "unpacked")


def add_args(ap) -> None:
    ap.add_argument("--model", help="a model directory, cached hub id or GGUF file (pkg:PACKAGE/FILE for a package's; "
                                     "default: the job's model.path, else its tiny base model)")
    ap.add_argument("--configs", default="a,b,c,paper", help="which configs to run (comma-separated: a, b, c, paper)")
    ap.add_argument("--rounds", type=int, default=2, help="processes per mode and config (alternating order)")
    ap.add_argument("--steps", type=int, default=2, help="timed train_step calls per process")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each measuring process")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens of the trees of b and c")
    ap.add_argument("--segment-len", type=int, default=32, help="tokens per segment of b")
    ap.add_argument("--step-len", type=int, default=16, help="tokens per segment of c")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="also time a packed LoRA step of this rank against full fine-tuning (0 = no)")
    ap.add_argument("--no-memory", action="store_true", help="skip the output layer's memory measurement")
    ap.add_argument("--logits-tokens", type=int, default=4096)
    ap.add_argument("--logits-vocab", type=int, default=150_000)
    ap.add_argument("--logits-hidden", type=int, default=896)


# ---------------------------------------------------------------------------------------------- trees


def _random_tree(rng, prompt_len: int, vocab: int):
    from treepo_ray.tree import Tree

    return Tree(prompt_ids=rng.integers(2, vocab, prompt_len).tolist(), query_id="bench")


def _score(tree, rng) -> None:
    tree.trajectories = tree.leaves()
    r = rng.integers(0, 2, len(tree.trajectories)).astype(float)
    r[0], r[-1] = 1.0, 0.0  # mixed: something to learn
    tree.set_trajectory_rewards(r.tolist())


def _segment(tree, parent: int, rng, length: int, vocab: int) -> int:
    return tree.add_node(parent, rng.integers(2, vocab, length).tolist(), (-rng.random(length)).tolist())


def treepo_paper_tree(rng, prompt_len: int, seg: int, vocab: int, width: int = 16, depth: int = 8):
    """TreePO's tree shape: the root splits in two, every path splits in two until `width` paths, then each path
    goes on alone to `depth` segments."""
    tree = _random_tree(rng, prompt_len, vocab)
    frontier = [0]
    for _ in range(depth):
        split = 2 if len(frontier) * 2 <= width else 1
        frontier = [_segment(tree, n, rng, seg, vocab) for n in frontier for _ in range(split)]
    _score(tree, rng)
    return tree


def treerpo_tree(rng, prompt_len: int, seg: int, vocab: int, n: int = 8, depth: int = 3):
    """TreeRPO's N-ary tree of depth D."""
    tree = _random_tree(rng, prompt_len, vocab)
    frontier = [0]
    for _ in range(depth):
        frontier = [_segment(tree, p, rng, seg, vocab) for p in frontier for _ in range(n)]
    _score(tree, rng)
    return tree


def _job_trees_child(cfg: TrainConfig, out: str) -> None:
    """Grow, score and credit the default job's first batch (Ray lives and dies with this process)."""
    import threading

    import torch

    from treepo_ray.data.prompts import PromptStream
    from treepo_ray.runtime.cluster import set_up
    from treepo_ray.runtime.train import start_runtime

    job = set_up(cfg)
    rt = start_runtime(cfg, job)
    try:
        stream = PromptStream(job.train_set, cfg.trainer.seed, cfg.data.shuffle)
        batch = rt.loop.builder.make(0, stream, 0.0, 0, threading.Event())
        torch.save(batch.fetch(), out)
    finally:
        rt.supervisor.shutdown()


# ---------------------------------------------------------------------------------------------- measuring


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def _learner_child(model_path: str, lcfg, trees, steps: int, threads: int, out: str) -> None:
    import torch

    from treepo_ray.learner import Learner

    torch.set_num_threads(threads)
    learner = Learner(model_path, lcfg)
    rss0 = _rss_mb()
    learner.backward(trees)
    grads = {k: p.grad.detach().clone() for k, p in learner.model.named_parameters() if p.grad is not None}
    learner.optimizer.zero_grad(set_to_none=True)
    times, metrics = [], {}
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics = learner.train_step(trees)
        times.append(time.perf_counter() - t0)
    torch.save(dict(grads=grads, times=times, metrics=metrics, peak_mem_mb=_peak_rss_mb() - rss0,
                    trainable=learner.trainable_parameters()), out)


def _reference_child(model_path: str, lcfg, trees, threads: int, out: str, rows: int = 64) -> None:
    """The per-node loss computed directly: every node taking part, on its own path through the plain HF model;
    the mean over its tokens of -A * ratio (+ KL, - entropy), times w(T), over the number of such nodes."""
    import torch
    from transformers import AutoModelForCausalLM

    from treepo_ray.algo.losses import kl_penalty

    torch.set_num_threads(threads)
    loss_cfg, temperature = lcfg.loss, lcfg.temperature
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ref = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval() if loss_cfg.kl_coef else None
    items = []
    for t in trees:
        for n in range(1, len(t.parent)):
            if t.node_mask[n] and t.weight != 0:
                path = t.path(n)
                prefix = list(t.prompt_ids) + [x for m in path[:-1] for x in t.tokens[m]]
                items.append((prefix + list(t.tokens[n]), len(prefix), len(t.tokens[n]), t.weight,
                              t.node_advantages[n]))
    denom = max(len(items), 1)
    pad = model.config.pad_token_id or 0
    for i in range(0, len(items), rows):
        chunk = items[i:i + rows]
        L = max(len(seq) for seq, *_ in chunk)
        ids = torch.full((len(chunk), L), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), L), dtype=torch.long)
        for j, (seq, *_) in enumerate(chunk):
            ids[j, :len(seq)], mask[j, :len(seq)] = torch.tensor(seq), 1

        def logp_of(m):
            return (m(input_ids=ids, attention_mask=mask).logits.float() / temperature).log_softmax(-1)

        log_p = logp_of(model)
        ref_p = None
        if ref is not None:
            with torch.no_grad():
                ref_p = logp_of(ref)
        loss = 0.0
        for j, (seq, start, length, weight, adv) in enumerate(chunk):
            rows_j = torch.arange(start - 1, start - 1 + length)
            tgt = torch.tensor(seq[start:start + length])
            lp = log_p[j, rows_j].gather(-1, tgt[:, None])[:, 0]
            term = -adv * torch.exp(lp - lp.detach())
            if ref_p is not None:
                term = term + loss_cfg.kl_coef * kl_penalty(lp, ref_p[j, rows_j].gather(-1, tgt[:, None])[:, 0],
                                                            loss_cfg.kl_estimator)
            if loss_cfg.entropy_coef:
                lpj = log_p[j, rows_j]
                term = term - loss_cfg.entropy_coef * -(lpj.exp() * lpj).sum(-1)
            loss = loss + weight * term.mean() / denom
        loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    torch.save(dict(grads=grads), out)


def _run(target, *args) -> dict:
    """Run `target(*args, out)` in a fresh process; return what it saved."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "out.pt")
        proc = multiprocessing.get_context("spawn").Process(target=target, args=(*args, out))
        proc.start()
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"{target.__name__} failed (exit code {proc.exitcode})")
        return torch.load(out, weights_only=False)


def grad_rel_diff(got: dict, want: dict) -> float:
    """max over parameters of max|got - want| / max|want| (parameters with a zero reference gradient skipped)."""
    worst = 0.0
    for name, w in want.items():
        scale = float(w.abs().max())
        if scale > 0:
            worst = max(worst, float((got[name] - w).abs().max()) / scale)
    return worst


def measure(name: str, trees, lcfg, model_path: str, args, reference: bool) -> dict:
    """Packed and unpacked on the same trees; see the module docstring."""
    from treepo_ray.learner.batch import tree_tokens

    runs = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else MODES[::-1]
        for mode in order:
            cfg = dataclasses.replace(lcfg, packing="tree" if mode == "packed" else "none")
            runs[mode].append(_run(_learner_child, model_path, cfg, trees, args.steps, args.threads))
            print(f"  {name} {mode}: step {min(runs[mode][-1]['times']):.2f}s", flush=True)
    if reference:
        g_ref = _run(_reference_child, model_path, lcfg, trees, args.threads)["grads"]
    else:
        g_ref = runs["unpacked"][0]["grads"]
    unique = sum(tree_tokens(t) for t in trees)
    out = {"trees": len(trees), "trajectories": sum(len(t.trajectories) for t in trees),
           "nodes": sum(len(t.parent) - 1 for t in trees), "loss": lcfg.loss.aggregation,
           "off_policy": lcfg.off_policy, "micro_batch_tokens": lcfg.micro_batch_tokens,
           "micro_batch_size": lcfg.micro_batch_size, "reference": "per-node" if reference else "unpacked"}
    for mode in MODES:
        m = runs[mode][0]["metrics"]
        out[mode] = {"forward_tokens": m["forward_tokens"], "unique_tokens": unique,
                     "step_s": min(t for run in runs[mode] for t in run["times"]),
                     "step_s_all": [t for run in runs[mode] for t in run["times"]],
                     "peak_mem_mb": max(run["peak_mem_mb"] for run in runs[mode]),
                     "trainable_params": runs[mode][0]["trainable"],
                     "grad_rel_diff": grad_rel_diff(runs[mode][0]["grads"], g_ref)}
    p, u = out["packed"], out["unpacked"]
    out["token_ratio"] = u["forward_tokens"] / p["forward_tokens"]
    out["speedup"] = u["step_s"] / p["step_s"]
    out["speedup_over_ratio"] = out["speedup"] / out["token_ratio"]
    out["packed_forward_per_unique"] = p["forward_tokens"] / unique
    return out


EXACT_RSS = {"MALLOC_MMAP_THRESHOLD_": "65536"}
"""glibc settings of the LoRA comparison's processes: every allocation over 64 KiB gets its own mapping, returned to the
system when freed, so the peak RSS follows the live tensors (with glibc's adaptive threshold freed activations stay
in the heap, and two runs differ by more than LoRA saves on a small model)."""


def _run_exact_rss(target, *args) -> dict:
    import os

    saved = {k: os.environ.get(k) for k in EXACT_RSS}
    os.environ.update(EXACT_RSS)  # read by glibc when the spawned process starts
    try:
        return _run(target, *args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def measure_lora(name: str, trees, lcfg, model_path: str, args) -> dict:
    """The packed step with LoRA adapters (rank lcfg.lora_rank) against packed full fine-tuning, each in processes
    of its own (alternating which goes first, glibc set for exact RSS: EXACT_RSS)."""
    modes = {"full": dataclasses.replace(lcfg, packing="tree", lora_rank=0),
             "lora": dataclasses.replace(lcfg, packing="tree")}
    runs: dict[str, list] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
            runs[mode].append(_run_exact_rss(_learner_child, model_path, modes[mode], trees, args.steps,
                                             args.threads))
            print(f"  {name} {mode}: step {min(runs[mode][-1]['times']):.2f}s", flush=True)
    out: dict = {"lora_rank": lcfg.lora_rank, "lora_alpha": lcfg.lora_alpha,
                 "target_modules": list(lcfg.target_modules)}
    for mode in modes:
        out[mode] = {"trainable_params": runs[mode][0]["trainable"],
                     "step_s": min(t for run in runs[mode] for t in run["times"]),
                     "step_s_all": [t for run in runs[mode] for t in run["times"]],
                     "peak_mem_mb": max(run["peak_mem_mb"] for run in runs[mode]),
                     "loss": runs[mode][0]["metrics"]["loss"]}
    out["lora_step_ratio"] = out["lora"]["step_s"] / out["full"]["step_s"]
    out["lora_peak_mem_ratio"] = out["lora"]["peak_mem_mb"] / max(out["full"]["peak_mem_mb"], 1e-9)
    return out


def paper_plan(rng) -> dict:
    """Config `paper`: how a paper-sized TreePO tree packs under treepo_paper.yaml's budget (the plan only)."""
    from treepo_ray.job.config import CONFIG_DIR, longest_path
    from treepo_ray.learner import LearnerConfig, train_trees
    from treepo_ray.learner.packing import TreeIndex, plan

    cfg = load_config(CONFIG_DIR / "treepo_paper.yaml")
    tree = treepo_paper_tree(rng, prompt_len=1024, seg=512, vocab=200, width=16, depth=14)
    indices = [TreeIndex(t) for t in train_trees([tree], cfg.algo.credit([tree]))]
    unique = sum(ix.tokens for ix in indices)

    def packed(budget: int) -> dict:
        batches = plan(indices, "tree", budget, cfg.learner.micro_batch_size)
        forward = sum(p.tokens for pieces in batches for p in pieces)
        return {"micro_batch_tokens": budget, "micro_batches": len(batches), "forward_tokens": forward,
                "forward_per_unique": forward / unique}

    budget = cfg.learner.micro_batch_tokens
    others = sorted({LearnerConfig.micro_batch_tokens, longest_path(cfg)} - {budget})
    return {"width": 16, "segments": 14, "segment_len": 512, "prompt_len": 1024, "unique_tokens": unique,
            "unpacked_tokens": sum(ix.path_tokens for ix in indices), **packed(budget),
            "other_budgets": [packed(b) for b in others]}


# ---------------------------------------------------------------------------------------------- logits memory


def full_vocab_logprobs(hidden, weight, targets, temperature: float = 1.0):
    """The learner's log-probs before chunking: full float32 logits, log_softmax, the target's log-prob, and the
    entropy from the same log-probs (detached: the default entropy_coef 0)."""
    import torch.nn.functional as F

    logits = F.linear(hidden, weight).float()
    if temperature != 1.0:
        logits = logits / temperature
    log_p = logits.log_softmax(dim=-1)
    logprobs = log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    src = log_p.detach()
    return logprobs, -(src.exp() * src).sum(dim=-1)


def _logits_child(kind: str, tokens: int, vocab: int, hidden: int, chunk: int, threads: int, out: str) -> None:
    import torch

    from treepo_ray.learner.logprobs import chunked_logprobs

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    rss0 = _rss_mb()
    t0 = time.perf_counter()
    if kind == "full":
        logp, ent = full_vocab_logprobs(h, w, targets)
    else:
        logp, ent = chunked_logprobs(h, w, targets, chunk=chunk)
    (-logp.sum()).backward()
    seconds = time.perf_counter() - t0
    torch.save(dict(logp=logp.detach(), entropy=ent.detach(), seconds=seconds, peak_mem_mb=_peak_rss_mb() - rss0,
                    grad_w=w.grad[:64].clone()), out)


def logits_memory(args, chunk: int) -> dict:
    shape = (args.logits_tokens, args.logits_vocab, args.logits_hidden)
    before = _run(_logits_child, "full", *shape, chunk, args.threads)
    after = _run(_logits_child, "chunked", *shape, chunk, args.threads)
    return {
        "tokens": args.logits_tokens, "vocab": args.logits_vocab, "hidden": args.logits_hidden, "chunk": chunk,
        "one_float32_logits_copy_mb": args.logits_tokens * args.logits_vocab * 4 / 2**20,
        "before": {"peak_mem_mb": before["peak_mem_mb"], "seconds": before["seconds"]},
        "after": {"peak_mem_mb": after["peak_mem_mb"], "seconds": after["seconds"]},
        "peak_ratio": after["peak_mem_mb"] / before["peak_mem_mb"],
        "logprob_max_abs_diff": float((after["logp"] - before["logp"]).abs().max()),
        "entropy_max_abs_diff": float((after["entropy"] - before["entropy"]).abs().max()),
        "grad_w_max_rel_diff": float((after["grad_w"] - before["grad_w"]).abs().max()
                                     / before["grad_w"].abs().max()),
    }


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parsed = parse_job_args(argv, "learner", __doc__, add_args)
    if isinstance(parsed, int):
        return parsed
    args, cfg = parsed
    if args.model:  # resolved (a GGUF file converted) once; the job and every measuring process load the directory
        from treepo_ray.engines.hub import resolve_model_path

        args.overrides = [*args.overrides,
                          f"model.path={resolve_model_path(args.model, '--model', model_cache=cfg.model.cache_dir)}"]
        cfg = load_config(resolve_config(args.config), args.overrides)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or args.rounds < 1 or args.steps < 1 or args.lora_rank < 0:
        print(f"treepo-ray bench learner: --configs from {CONFIGS}, --rounds and --steps >= 1, --lora-rank >= 0",
              file=sys.stderr)
        return 2
    from treepo_ray.learner import train_trees
    from treepo_ray.job.inputs import resolve_model

    model_path = None if set(configs) <= set(PLAN_ONLY) else resolve_model(cfg)
    vocab = 200  # token ids of b and c: inside the tiny model's byte vocabulary (and any other model's)
    rng = np.random.default_rng(args.seed)
    result: dict = {"model": model_path, "model_arg": args.model, "config": args.config,
                    "overrides": redacted_overrides(args.overrides, cfg.log.redact_keys), "threads": args.threads,
                    "rounds": args.rounds, "steps": args.steps, "configs": {}}
    for name in configs:
        print(f"config {name}", flush=True)
        if name == "paper":
            result["configs"][name] = r = paper_plan(rng)
            print(f"  paper: {r['micro_batches']} micro-batches of {r['micro_batch_tokens']} tokens, forward / unique "
                  f"{r['forward_per_unique']:.3f} (unpacked {r['unpacked_tokens'] / r['unique_tokens']:.3f})",
                  flush=True)
            continue
        if name == "a":
            trees_cfg = cfg
            trees = _run(_job_trees_child, cfg)
        else:
            algo = "treepo" if name == "b" else "treerpo"
            trees_cfg = load_config(resolve_config(args.config), [*args.overrides, f"algo.name={algo}"])
            tree = (treepo_paper_tree(rng, args.prompt_len, args.segment_len, vocab) if name == "b"
                    else treerpo_tree(rng, args.prompt_len, args.step_len, vocab))
            trees = train_trees([tree], trees_cfg.algo.credit([tree]))
            for t in trees:  # no engine sampled these tokens: no behaviour log-probs, old ones recomputed
                t.logprobs = None
        lcfg = trees_cfg.learner if name == "a" else dataclasses.replace(trees_cfg.learner, off_policy="recompute")
        result["configs"][name] = r = measure(name, trees, lcfg, model_path, args, reference=name == "c")
        print(f"  {name}: token ratio {r['token_ratio']:.2f}, speed-up {r['speedup']:.2f}x, packed forward/unique "
              f"{r['packed_forward_per_unique']:.3f}, peak MB packed {r['packed']['peak_mem_mb']:.0f} / unpacked "
              f"{r['unpacked']['peak_mem_mb']:.0f}, grad rel diff {r['packed']['grad_rel_diff']:.1e}", flush=True)
        if args.lora_rank > 0:
            lora_cfg = dataclasses.replace(lcfg, lora_rank=args.lora_rank, lora_alpha=trees_cfg.model.lora_alpha,
                                           target_modules=list(trees_cfg.model.target_modules))
            r["lora"] = lo = measure_lora(name, trees, lora_cfg, model_path, args)
            print(f"  {name}: LoRA r={args.lora_rank} step {lo['lora']['step_s']:.3f}s vs full "
                  f"{lo['full']['step_s']:.3f}s ({lo['lora_step_ratio']:.2f}x), peak MB {lo['lora']['peak_mem_mb']:.0f} "
                  f"vs full {lo['full']['peak_mem_mb']:.0f} ({lo['lora_peak_mem_ratio']:.2f}x), trainable params "
                  f"{lo['lora']['trainable_params']} vs {lo['full']['trainable_params']}", flush=True)
    if not args.no_memory:
        print("logits memory", flush=True)
        result["logits_memory"] = m = logits_memory(args, cfg.learner.logprob_chunk)
        print(f"  peak MB before {m['before']['peak_mem_mb']:.0f}, after {m['after']['peak_mem_mb']:.0f} "
              f"(ratio {m['peak_ratio']:.3f}); log-prob max diff {m['logprob_max_abs_diff']:.1e}", flush=True)
    result["targets"] = _targets(result)
    write_json(args.json, result)
    return 0


def _targets(result: dict) -> dict:
    """The issue's bars, each as measured."""
    out = {}
    for name, r in result["configs"].items():
        if name == "paper":
            out["paper/forward_per_unique<=1.10"] = r["forward_per_unique"] <= 1.10
            continue
        out[f"{name}/packed_forward_per_unique<=1.02"] = r["packed_forward_per_unique"] <= 1.02
        out[f"{name}/grad_rel_diff<=1e-4"] = max(r[m]["grad_rel_diff"] for m in MODES) <= 1e-4
        if name in ("b", "c"):
            out[f"{name}/speedup>=0.8*token_ratio"] = r["speedup_over_ratio"] >= 0.8
            out[f"{name}/peak_mem<=unpacked"] = r["packed"]["peak_mem_mb"] <= r["unpacked"]["peak_mem_mb"]
        if "lora" in r:
            out[f"{name}/lora_step<full"] = r["lora"]["lora_step_ratio"] < 1.0
            out[f"{name}/lora_peak_mem<full"] = r["lora"]["lora_peak_mem_ratio"] < 1.0
    if "logits_memory" in result:
        m = result["logits_memory"]
        out["logits/peak<=1/3"] = m["peak_ratio"] <= 1 / 3
        out["logits/logprob_diff<=1e-5"] = m["logprob_max_abs_diff"] <= 1e-5
    return out


if __name__ == "__main__":
    sys.exit(main())
