"""The GPU check (`bash jobs/gpu_check.sh [MODEL_DIR]`): every GPU path the CPU tests cannot show, one leg each, in
at most 10 minutes on one GPU. Each leg runs in a process of its own (one vLLM engine per process: the first would
hold most of the GPU), within what is left of the time budget.

    vllm_generate   the vLLM engine on the GPU (its V2 model runner): tree requests with n children, no padded id
                    sampled, sampled tokens' log-probs against the Hugging Face model's
    weights         a learner step's weights into a running vLLM engine by every path: the object store (one GPU),
                    NCCL broadcast from learner rank 0 (two GPUs); the engine's log-probs then follow the new weights
    learner_step    a learner step with two FSDP2 ranks over NCCL (two GPUs), else one rank
    learner_memory  the learner's peak GPU memory for one step at a paper-like shape: Qwen2.5-7B's vocabulary and
                    width (2 layers), 4 sequences of 8k tokens, bf16, gradient checkpointing
    treepo_e2e      `treepo-ray train`: a 2-step TreePO run with vLLM engines and a GPU learner, end to end
    vllm_tp2        a vLLM engine with tensor_parallel_size 2 started by the generator pool (two GPUs)

With no MODEL_DIR, the engine legs use a random Qwen2.5-0.5B-shaped model (real vocabulary, padded as the real one)
built offline. Writes OUT_DIR/summary.json. Exit status: 0 every leg passed (legs that need two GPUs may be skipped
on one); 1 a leg failed, or was skipped for a reason other than missing hardware (the time budget included); 2 bad
arguments; 3 no GPU on this machine (nothing ran).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = 3
BUDGET_S = 570.0  # of the 10 minutes: the rest is start-up and the summary
# name -> (GPUs it needs, seconds it may take at most); run in this order.
LEGS = {
    "vllm_generate": (1, 120),
    "weights": (1, 150),
    "learner_step": (1, 90),
    "learner_memory": (1, 120),
    "treepo_e2e": (1, 180),
    "vllm_tp2": (2, 120),
}
PROMPTS = [[40 + i, 41, 42 + 2 * i, 43, 44, 45 + i, 46, 47] * 4 for i in range(4)]


# ---------------------------------------------------------------------------------------------- the summary


def exit_status(legs: dict[str, dict]) -> int:
    """0 when every leg passed or was skipped for missing hardware, else 1."""
    ok = all(leg["status"] == "passed" or (leg["status"] == "skipped" and leg.get("hardware")) for leg in legs.values())
    return 0 if ok else 1


def gpus_here() -> tuple[int, list[str]]:
    """GPUs torch can use, and their names (from nvidia-smi: this process makes no CUDA context, which would hold
    GPU memory through every leg)."""
    try:
        import torch

        n = torch.cuda.device_count()
    except Exception:  # noqa: BLE001 - no usable CUDA is no GPU
        return 0, []
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        names = []
    return n, names[:n]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jobs/gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default="", help="an HF model directory (default: random models)")
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"), help="where summary.json goes")
    parser.add_argument("--legs", default=",".join(LEGS), help="comma-separated legs to run (default: all)")
    parser.add_argument("--leg", help=argparse.SUPPRESS)  # internal: run one leg in this process
    parser.add_argument("--rehearse-on-cpu", action="store_true",
                        help="for the project's tests: run the legs on the CPU with tiny shapes (figures mean nothing)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.leg:
        return run_leg(args.leg, json.loads((out / "context.json").read_text()))
    legs = [name for name in args.legs.split(",") if name]
    unknown = [name for name in legs if name not in LEGS]
    if unknown or (args.model and not (Path(args.model) / "config.json").is_file()):
        print(f"gpu_check: unknown legs {unknown}" if unknown else
              f"gpu_check: {args.model} is not a Hugging Face model directory (no config.json)", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    gpus, names = gpus_here()
    summary = {"gpus": gpus, "gpu_names": names, "python": sys.executable, "legs": {}}
    if gpus == 0 and not args.rehearse_on_cpu:
        print("gpu_check: no GPU on this machine (torch sees no CUDA device): nothing ran", file=sys.stderr)
        summary["exit_status"] = NO_GPU
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return NO_GPU
    device = "cpu" if args.rehearse_on_cpu else "cuda"
    started = time.monotonic()
    context = {"device": device, "gpus": gpus, "out": str(out), "model": args.model,
               "rehearse": args.rehearse_on_cpu}
    print(f"== gpu_check: {gpus} GPU(s) {names}, python {sys.executable}, legs {legs}", flush=True)
    try:
        context["models"] = build_models(out / "models", args.model, args.rehearse_on_cpu)
    except Exception as err:  # noqa: BLE001 - no model, no leg
        for name in legs:
            summary["legs"][name] = {"status": "failed", "reason": f"building the models failed: {err}"}
    (out / "context.json").write_text(json.dumps(context))
    for name in legs:
        if name in summary["legs"]:
            continue
        need, limit = LEGS[name]
        left = BUDGET_S - (time.monotonic() - started)
        if gpus < need and not args.rehearse_on_cpu:
            summary["legs"][name] = {"status": "skipped", "hardware": True, "reason": f"needs {need} GPUs"}
        elif left < 20:
            summary["legs"][name] = {"status": "skipped", "reason": f"the {BUDGET_S:.0f} s budget ran out"}
        else:
            summary["legs"][name] = run_leg_process(name, out, min(limit, left))
        leg = summary["legs"][name]
        print(f"== {name}: {leg['status']}" + (f" ({leg['reason']})" if leg.get("reason") else "")
              + (f" {json.dumps(leg.get('figures', {}))}" if leg.get("figures") else ""), flush=True)
    summary["seconds"] = time.monotonic() - started
    summary["exit_status"] = exit_status(summary["legs"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"== gpu_check: exit {summary['exit_status']} after {summary['seconds']:.0f} s; {out / 'summary.json'}")
    return summary["exit_status"]


def run_leg_process(name: str, out: Path, limit_s: float) -> dict:
    """Run one leg in its own process (and process group, so a timeout kills whatever it started)."""
    result = out / "legs" / f"{name}.json"
    result.parent.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    with open(out / "legs" / f"{name}.log", "w") as log:
        proc = subprocess.Popen([sys.executable, __file__, "--leg", name, "--out", str(out)], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"status": "failed", "reason": f"timed out after {limit_s:.0f} s", "seconds": limit_s}
    seconds = time.monotonic() - start
    if result.is_file():
        return {**json.loads(result.read_text()), "seconds": seconds}
    return {"status": "failed", "reason": f"exit {code} without a result (see legs/{name}.log)", "seconds": seconds}


def run_leg(name: str, context: dict) -> int:
    """In a leg's own process: run it, write legs/NAME.json."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray: 127.0.0.1 only (runtime/cluster.py)
    path = Path(context["out"]) / "legs" / f"{name}.json"
    try:
        figures = globals()[f"leg_{name}"](context)
        result = {"status": "passed", "figures": figures}
    except Exception as err:  # noqa: BLE001 - a failed leg is reported, the others still run
        traceback.print_exc()
        result = {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
    path.write_text(json.dumps(result, indent=2))
    return 0 if result["status"] == "passed" else 1


# ---------------------------------------------------------------------------------------------- models


TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tokenizer_vocab=1090, vocab_size=1152)


def build_models(where: Path, model_dir: str, rehearse: bool) -> dict[str, str]:
    """The engine model (MODEL_DIR, or a random Qwen2.5-0.5B-shaped one) and the memory leg's paper-like shape."""
    from treepo_ray.engines.random_models import build_random_model

    models = {}
    engine = where / ("tiny" if rehearse else "qwen2.5-0.5b")
    if model_dir:
        models["engine"] = model_dir
    else:
        if not (engine / "config.json").is_file():
            build_random_model(engine, "qwen2.5-0.5b", max_positions=4096, **(TINY if rehearse else {}))
        models["engine"] = str(engine)
    memory = where / ("tiny-wide" if rehearse else "qwen2.5-7b-2layers")
    if not (memory / "config.json").is_file():
        shape = dict(TINY) if rehearse else dict(num_hidden_layers=2)
        build_random_model(memory, "qwen2.5-7b", max_positions=8192 + 64, **shape)
    models["memory"] = str(memory)
    return models


def _hf(path: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def _logprob_gap(model, prompt: list[int], tokens: list[int], logprobs: list[float], vocab: int) -> float:
    """Mean |engine log-prob - the HF model's| over a segment's tokens, at temperature 1 over the tokenizer's `vocab`
    logits: both engines report the log-probs of what they sample from, padded rows masked out."""
    import torch

    with torch.no_grad():
        ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
        logp = model(ids).logits[0, :, :vocab].float().log_softmax(-1)
    steps = torch.arange(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    ref = logp[steps, torch.tensor(tokens)].cpu()
    return float((ref - torch.tensor(logprobs)).abs().mean())


def _vllm_kwargs(context: dict, share: float) -> dict:
    """vLLM engine arguments: bf16 on the GPU, no CUDA graph capture (start-up time), `share` of the GPU's memory."""
    if context["device"] != "cuda":
        return {"max_model_len": 1024}
    return {"dtype": "bfloat16", "enforce_eager": True, "gpu_memory_utilization": share, "max_model_len": 2048}


def _require_vllm(device: str) -> None:
    try:
        from vllm.platforms import current_platform
    except ImportError as err:
        raise RuntimeError(f"vllm is not installed in {sys.executable}: pip install -e '.[vllm]'") from err
    if current_platform.device_type != device:
        raise RuntimeError(f"the vLLM installed in {sys.executable} runs on {current_platform.device_type!r}, "
                           f"not {device!r} (the CUDA build is the project's [vllm] extra)")


# ---------------------------------------------------------------------------------------------- legs


def leg_vllm_generate(context: dict) -> dict:
    from treepo_ray.engines import make_engine
    from treepo_ray.engines.base import SamplingParams, SegmentRequest, generate

    device = context["device"]
    _require_vllm(device)
    path = context["models"]["engine"]
    engine = make_engine("vllm", path, device=device, seed=0, **_vllm_kwargs(context, 0.6))
    start = time.perf_counter()
    results = generate(engine, [SegmentRequest(f"p{i}", p, 64, n=8, params=SamplingParams(1.0, seed=i))
                                for i, p in enumerate(PROMPTS)])
    seconds = time.perf_counter() - start
    vocab = engine.info.tokenizer_vocab
    tokens = [t for r in results for c in r.children for t in c.token_ids]
    engine.shutdown()
    if max(tokens) >= vocab:
        raise AssertionError(f"a padded id was sampled (max {max(tokens)} >= tokenizer vocabulary {vocab})")
    model = _hf(path, device)
    gaps = [_logprob_gap(model, p, c.token_ids, c.logprobs, vocab) for p, r in zip(PROMPTS, results)
            for c in r.children[:2]]
    gap = max(gaps)
    if gap > 0.05:
        raise AssertionError(f"vLLM's log-probs differ from the HF model's by {gap:.4f} on average (> 0.05)")
    return {"model": path, "tokenizer_vocab": vocab, "model_vocab": engine.info.model_vocab, "tokens": len(tokens),
            "tokens_per_s": len(tokens) / seconds, "logprob_gap_max_mean": gap}


def _start_ray(context: dict) -> None:
    import ray

    ray.init(num_cpus=max(os.cpu_count() or 2, 4), num_gpus=context["gpus"], include_dashboard=False,
             log_to_driver=False)


def leg_weights(context: dict) -> dict:
    import ray
    from transformers import AutoTokenizer

    from treepo_ray.engines.base import SamplingParams, SegmentRequest
    from treepo_ray.job.config import RuntimeConfig
    from treepo_ray.learner import LearnerConfig, TrainSample
    from treepo_ray.runtime.learner import LearnerGroup
    from treepo_ray.runtime.pool import EngineSpec, GeneratorPool
    from treepo_ray.runtime.weights import WeightSync

    device, gpus = context["device"], context["gpus"]
    engine_name = "vllm" if device == "cuda" or _has_vllm() else "hf"
    if device == "cuda":
        _require_vllm(device)
    path = context["models"]["engine"]
    _start_ray(context)
    whole = gpus >= 2  # learner and engine each on a GPU of their own; else they share one
    share = 1.0 if whole else (0.5 if device == "cuda" else 0.0)
    kwargs = _vllm_kwargs(context, 0.8 if whole else 0.3) if engine_name == "vllm" else {}
    rt = RuntimeConfig(engine_cpus=1, engine_gpus=share, learner_cpus=1, learner_gpus=share)
    pool = GeneratorPool(EngineSpec(engine_name, path, kwargs, 1, 1, share, {}), rt)
    dtype = ray.get(next(iter(pool.members().values())).describe.remote())["weights_dtype"]
    backend = "nccl" if device == "cuda" else "gloo"
    group = LearnerGroup(path, LearnerConfig(lr=5e-3, micro_batch_size=4, dtype="bfloat16" if device == "cuda"
                                             else "float32"), rt, WeightSync("object_store", dtype, backend,
                                                                             64 << 20, 120.0))
    samples = [TrainSample(p, p[:8], advantages=1.0 if i % 2 else -1.0) for i, p in enumerate(PROMPTS)]
    paths = ["object_store"] + (["broadcast"] if whole or device == "cpu" else [])
    figures, model = {"engine": engine_name, "dtype": dtype}, _hf(path, device)
    vocab = len(AutoTokenizer.from_pretrained(path))
    version = 0
    for how in paths:
        group.train_step(ray.put(samples))
        version += 1
        group.weights = WeightSync(how, dtype, backend, 64 << 20, 120.0)
        published = group.publish(version)
        start = time.perf_counter()
        pool.load_weights(published, version)
        seconds = time.perf_counter() - start
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict({k: v.to(device) for k, v in ray.get(group.export_weights()).items()}, strict=False)
        (res,) = pool.router().call_sync(f"w{version}", "generate",
                                         [SegmentRequest(f"w{version}", PROMPTS[0], 32, 1, SamplingParams(1.0, seed=1))])
        child = res.children[0]
        gap_new = _logprob_gap(model, PROMPTS[0], child.token_ids, child.logprobs, vocab)
        model.load_state_dict(before)
        gap_old = _logprob_gap(model, PROMPTS[0], child.token_ids, child.logprobs, vocab)
        if not (res.weights_version == version and gap_new < 0.05 and gap_new < gap_old / 2):
            raise AssertionError(f"{how}: the engine does not run weights v{version} (version "
                                 f"{res.weights_version}, log-prob gap {gap_new:.4f} to the new weights, "
                                 f"{gap_old:.4f} to the old)")
        figures[how] = {"bytes": published.metrics()["weights/bytes"], "seconds": seconds,
                        "logprob_gap_new": gap_new, "logprob_gap_old": gap_old}
        model.load_state_dict({k: v.to(device) for k, v in ray.get(group.export_weights()).items()}, strict=False)
    if "broadcast" not in figures:
        figures["broadcast"] = "skipped: needs 2 GPUs (NCCL refuses two ranks on one GPU)"
    pool.close()
    group.close()
    return figures


def _has_vllm() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def leg_learner_step(context: dict) -> dict:
    import ray

    from treepo_ray.job.config import RuntimeConfig
    from treepo_ray.learner import LearnerConfig, TrainSample
    from treepo_ray.runtime.learner import LearnerGroup
    from treepo_ray.runtime.weights import WeightSync

    device, gpus = context["device"], context["gpus"]
    ranks = 2 if gpus >= 2 or device == "cpu" else 1
    _start_ray(context)
    cfg = LearnerConfig(lr=1e-5, micro_batch_size=4, dtype="bfloat16" if device == "cuda" else "float32",
                        gradient_checkpointing=True)
    group = LearnerGroup(context["models"]["engine"], cfg,
                         RuntimeConfig(learner_ranks=ranks, learner_cpus=1, learner_gpus=1 if device == "cuda" else 0),
                         WeightSync("object_store", "float32", "gloo", 1 << 20, 120.0))
    samples = [TrainSample(p, p * 8, advantages=1.0 if i % 2 else -1.0) for i, p in enumerate(PROMPTS * 2)]
    start = time.perf_counter()
    metrics = group.train_step(ray.put(samples))
    seconds = time.perf_counter() - start
    group.close()
    if metrics["skipped"] or not metrics["steps"]:
        raise AssertionError(f"the step was skipped: {metrics}")
    return {"ranks": ranks, "backend": "nccl" if device == "cuda" and ranks > 1 else "none" if ranks == 1 else "gloo",
            "seconds": seconds, "tokens": metrics["tokens"], "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"]}


def leg_learner_memory(context: dict) -> dict:
    import torch

    from treepo_ray.learner import Learner, LearnerConfig, TrainSample

    device = context["device"]
    rehearse = context["rehearse"]
    seqs, length = (4, 128) if rehearse else (4, 8192)
    cfg = LearnerConfig(lr=1e-6, micro_batch_size=4, dtype="bfloat16" if device == "cuda" else "float32",
                        gradient_checkpointing=True, strategy="none")
    learner = Learner(context["models"]["memory"], cfg)
    gen = torch.Generator().manual_seed(0)
    vocab = learner.vocab_size - 400 if not rehearse else 1000
    samples = [TrainSample(torch.randint(2, vocab, (64,), generator=gen).tolist(),
                           torch.randint(2, vocab, (length - 64,), generator=gen).tolist(),
                           advantages=1.0 if i % 2 else -1.0) for i in range(seqs)]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    metrics = learner.train_step(samples)
    seconds = time.perf_counter() - start
    config = learner.model.config
    figures = {"shape": {"vocab": config.vocab_size, "hidden": config.hidden_size, "layers": config.num_hidden_layers,
                         "sequences": seqs, "tokens_each": length},
               "seconds": seconds, "loss": metrics["loss"]}
    if device == "cuda":
        figures["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        figures["gpu_gib"] = torch.cuda.get_device_properties(0).total_memory / 2**30
    return figures


def leg_treepo_e2e(context: dict) -> dict:
    from treepo_ray.runtime.train import main as train

    device, gpus = context["device"], context["gpus"]
    run_dir = Path(context["out"]) / "treepo_e2e"
    engine = "vllm" if device == "cuda" or _has_vllm() else "hf"
    if device == "cuda":
        _require_vllm(device)
    share = 1 if gpus >= 2 else 0.5  # 2 GPUs: a whole one each (the weights go by NCCL broadcast)
    kwargs = _vllm_kwargs(context, 0.8 if gpus >= 2 else 0.3) if engine == "vllm" else {}
    overrides = [
        f"model.path={context['models']['engine']}", f"model.engine={engine}",
        "model.engine_kwargs=" + json.dumps(kwargs), f"model.cache_dir={Path(context['out']) / 'cache'}",
        "algo.name=treepo", "algo.dynamic_sampling=false", "rollout.treepo.width=8", "rollout.treepo.max_depth=3",
        "rollout.treepo.segment_len=32", "trainer.steps=2", "trainer.prompts_per_step=8", "trainer.eval_size=8",
        "trainer.eval_samples=1", "trainer.eval_every=0", "trainer.save_every=0", f"trainer.run_dir={run_dir}",
        "learner.lr=1e-5", "learner.micro_batch_size=8", "log.wandb=false", "log.trees_per_step=0",
        "runtime.num_cpus=4", "runtime.max_staleness=0",  # step 2 is grown after a weight sync
    ]
    if device == "cuda":
        overrides += [f"runtime.engine_gpus={share}", f"runtime.learner_gpus={share}", "learner.dtype=bfloat16"]
    start = time.perf_counter()
    code = train(overrides)
    seconds = time.perf_counter() - start
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    synced = [r for r in rows if r.get("weights/bytes", 0) > 0]
    if code != 0 or not summary["completed"] or not synced:
        raise AssertionError(f"the run did not complete with a weight sync (exit {code}, summary {summary})")
    return {"engine": engine, "steps": summary["steps"], "seconds": seconds,
            "weights_broadcast": synced[-1].get("weights/broadcast"), "weights_bytes": synced[-1]["weights/bytes"],
            "trajectories_per_s": summary["trajectories_per_s"]}


def leg_vllm_tp2(context: dict) -> dict:
    from transformers import AutoTokenizer

    from treepo_ray.engines.base import SamplingParams, SegmentRequest
    from treepo_ray.job.config import RuntimeConfig
    from treepo_ray.runtime.pool import EngineSpec, GeneratorPool

    _require_vllm(context["device"])
    path = context["models"]["engine"]
    _start_ray(context)
    kwargs = {**_vllm_kwargs(context, 0.6), "tensor_parallel_size": 2}
    pool = GeneratorPool(EngineSpec("vllm", path, kwargs, 1, 1, 2, {}), RuntimeConfig(engine_gpus=2))
    (res,) = pool.router().call_sync("tp", "generate", [SegmentRequest("tp", PROMPTS[0], 32, 4,
                                                                       SamplingParams(1.0, seed=3))])
    pool.close()
    model = _hf(path, context["device"])
    vocab = len(AutoTokenizer.from_pretrained(path))
    gap = max(_logprob_gap(model, PROMPTS[0], c.token_ids, c.logprobs, vocab) for c in res.children)
    if gap > 0.05:
        raise AssertionError(f"tensor-parallel vLLM's log-probs differ from the HF model's by {gap:.4f} (> 0.05)")
    return {"logprob_gap_max_mean": gap, "tokens": sum(len(c.token_ids) for c in res.children)}


if __name__ == "__main__":
    sys.exit(main())
