"""The GPU check (`bash jobs/gpu_check.sh [MODEL_DIR]`): every GPU path the CPU tests cannot show, one leg each, in
at most 10 minutes on one GPU. Each leg runs in a process of its own (one vLLM engine per process: the first would
hold most of the GPU), within what is left of the time budget, and ends passed, failed, or not run (with why).

    vllm_generate        the vLLM engine on the GPU (its V2 model runner): tree requests with n children, no padded id
                         sampled, sampled tokens' log-probs against the Hugging Face model's
    weights_cuda_graphs  a learner step's weights into a running vLLM engine with CUDA graphs (enforce_eager=False)
                         through the object store, twice: the captured graphs must run the new weights (log-probs)
    weights_broadcast    the same by NCCL broadcast from learner rank 0 (two GPUs: a whole one each)
    learner_step         a learner step with two FSDP2 ranks over NCCL (two GPUs)
    learner_memory       the learner's peak GPU memory for one step under FSDP2's mixed precision (bf16 compute,
                         float32 master weights and AdamW): Qwen2.5-7B's vocabulary and width at 1 and 2 layers, 4
                         sequences of 8k tokens, gradient checkpointing; extrapolated per layer to its 28 layers and
                         compared with the GPU's memory (the fewest ranks, up to 8, whose share fits)
    learner_deep_tree    a paper-depth TreePO tree (16 paths, 14 segments of 512 tokens) packed and trained
    treepo_e2e           `treepo-ray train`: a 2-step TreePO run with vLLM engines and a GPU learner, end to end
    vllm_tp2_weights     a vLLM engine with tensor_parallel_size 2 started by the generator pool, a weight reload into
                         it, its log-probs then following the new weights (two GPUs; by broadcast with a third)

With no MODEL_DIR, the engine legs use a random Qwen2.5-0.5B-shaped model (real vocabulary, padded as the real one)
built offline. Writes OUT_DIR/summary.json. Exit status: 0 every leg ran and passed; 1 a leg failed, or did not run
for a reason other than this machine's hardware (the time budget included), or the NVIDIA driver is too old or CUDA
unusable; 2 bad arguments; 3 no GPU on this machine (nothing ran); 4 no leg failed, but some could not run on this
hardware (e.g. they need two GPUs): not a pass.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NO_GPU = 3
NOT_ALL_RUN = 4
MIN_DRIVER = 580
"""The oldest NVIDIA driver the vLLM 0.32.0 CUDA 13 wheel runs on."""
BUDGET_S = 570.0  # of the 10 minutes: the rest is start-up and the summary
# name -> (GPUs it needs, seconds it may take at most); run in this order.
LEGS = {
    "vllm_generate": (1, 80),
    "weights_cuda_graphs": (1, 130),
    "weights_broadcast": (2, 120),
    "learner_step": (2, 90),
    "learner_memory": (1, 120),
    "learner_deep_tree": (1, 90),
    "treepo_e2e": (1, 140),
    "vllm_tp2_weights": (2, 150),
}
PAPER_LAYERS = 28  # Qwen2.5-7B's
PROMPTS = [[40 + i, 41, 42 + 2 * i, 43, 44, 45 + i, 46, 47] * 4 for i in range(4)]


# ---------------------------------------------------------------------------------------------- the summary


class CannotRunHere(Exception):
    """Raised by a leg that this machine's hardware cannot run: the leg ends 'not run', never 'passed'."""


def exit_status(legs: dict[str, dict]) -> int:
    """0 when every leg ran and passed; 1 when one failed or did not run for another reason than the hardware;
    else NOT_ALL_RUN (some legs could not run on this hardware)."""
    if any(leg["status"] == "failed" or (leg["status"] == "not_run" and not leg.get("hardware"))
           for leg in legs.values()):
        return 1
    return NOT_ALL_RUN if any(leg["status"] != "passed" for leg in legs.values()) else 0


def driver_version() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out[0] if out else None


def driver_problem(version: str | None) -> str | None:
    """Why this driver cannot run the check, or None."""
    if version is None:
        return None
    try:
        major = int(version.split(".")[0])
    except ValueError:
        return f"cannot read the NVIDIA driver version {version!r}"
    if major < MIN_DRIVER:
        return (f"NVIDIA driver {version} is older than the {MIN_DRIVER} that vLLM 0.32.0's CUDA 13 wheel needs: "
                "upgrade the driver")
    return None


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
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="jobs/gpu_check.sh", description=__doc__.split("\n\n")[0])
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
    driver = driver_version()
    summary = {"gpus": gpus, "gpu_names": names, "driver": driver, "python": sys.executable, "legs": {}}
    stop, status = None, 0
    if not args.rehearse_on_cpu:
        if driver_problem(driver):
            stop, status = driver_problem(driver), 1
        elif gpus == 0 and driver:
            stop, status = (f"NVIDIA driver {driver} is here, but torch {_torch_build()} cannot use CUDA: a CPU "
                            "build of torch, or a driver too old for it"), 1
        elif gpus == 0:
            stop, status = "no GPU on this machine (torch sees no CUDA device, no nvidia-smi)", NO_GPU
    if stop:
        print(f"gpu_check: {stop}: nothing ran (exit {status})", file=sys.stderr)
        summary["exit_status"], summary["stopped"] = status, stop
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return status
    device = "cpu" if args.rehearse_on_cpu else "cuda"
    started = time.monotonic()
    context = {"device": device, "gpus": gpus, "out": str(out), "model": args.model,
               "rehearse": args.rehearse_on_cpu}
    print(f"== gpu_check: {gpus} GPU(s) {names}, NVIDIA driver {driver}, python {sys.executable}, legs {legs}",
          flush=True)
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
            summary["legs"][name] = {"status": "not_run", "hardware": True, "reason": f"needs {need} GPUs"}
        elif left < 20:
            summary["legs"][name] = {"status": "not_run", "reason": f"the {BUDGET_S:.0f} s budget ran out"}
        else:
            summary["legs"][name] = run_leg_process(name, out, min(limit, left))
        leg = summary["legs"][name]
        print(f"== {name}: {leg['status'].replace('_', ' ')}" + (f" ({leg['reason']})" if leg.get("reason") else "")
              + (f" {json.dumps(leg.get('figures', {}))}" if leg.get("figures") else ""), flush=True)
    summary["seconds"] = time.monotonic() - started
    summary["exit_status"] = status = exit_status(summary["legs"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    counts = {s: sum(leg["status"] == s for leg in summary["legs"].values()) for s in ("passed", "failed", "not_run")}
    verdict = {0: "every leg ran and passed", 1: "FAILED",
               NOT_ALL_RUN: "not a pass: some legs could not run on this hardware"}[status]
    print(f"== gpu_check: {verdict} ({counts['passed']} passed, {counts['failed']} failed, {counts['not_run']} not "
          f"run); exit {status} after {summary['seconds']:.0f} s; {out / 'summary.json'}")
    return status


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
    except CannotRunHere as err:
        result = {"status": "not_run", "hardware": True, "reason": str(err)}
    except Exception as err:  # noqa: BLE001 - a failed leg is reported, the others still run
        traceback.print_exc()
        result = {"status": "failed", "reason": f"{type(err).__name__}: {err}"}
    path.write_text(json.dumps(result, indent=2))
    return 0 if result["status"] == "passed" else 1


def _torch_build() -> str:
    try:
        import torch
    except ImportError:
        return "(not installed)"
    return f"{torch.__version__} (CUDA {torch.version.cuda})"


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
    # The memory leg's two depths (one layer's cost is their difference): the 2-layer model, and its 1-layer view
    # (its config, its weights file: the second layer's weights go unused), so only one large model is built.
    two = where / ("tiny-wide" if rehearse else "qwen2.5-7b-2layers")
    if not (two / "config.json").is_file():
        build_random_model(two, "qwen2.5-7b", max_positions=8192 + 64, **{**(TINY if rehearse else {}),
                                                                         "num_hidden_layers": 2})
    one = where / (two.name + "-1layer")
    if not (one / "config.json").is_file():
        one.mkdir(parents=True, exist_ok=True)
        for item in two.iterdir():
            if item.name != "config.json":
                (one / item.name).unlink(missing_ok=True)
                (one / item.name).symlink_to(item.resolve())
        config = json.loads((two / "config.json").read_text())
        config["num_hidden_layers"] = 1
        if "layer_types" in config:  # one entry per layer
            config["layer_types"] = config["layer_types"][:1]
        (one / "config.json").write_text(json.dumps(config, indent=2))
    models["memory1"], models["memory2"] = str(one), str(two)
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


def _vllm_kwargs(context: dict, share: float, eager: bool = True) -> dict:
    """vLLM engine arguments: bf16 on the GPU, `share` of the GPU's memory; `eager`: no CUDA graph capture (start-up
    time) where the leg is not about CUDA graphs."""
    if context["device"] != "cuda":
        return {"max_model_len": 1024}
    return {"dtype": "bfloat16", "enforce_eager": eager, "gpu_memory_utilization": share, "max_model_len": 2048}


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

    # address="local": a Ray of the leg's own, never a cluster that happens to run on this machine.
    ray.init(address="local", num_cpus=max(os.cpu_count() or 2, 4), num_gpus=context["gpus"], include_dashboard=False,
             log_to_driver=False)


def leg_weights_cuda_graphs(context: dict) -> dict:
    return _weights_leg(context, ("object_store", "object_store"), eager=False)


def leg_weights_broadcast(context: dict) -> dict:
    return _weights_leg(context, ("broadcast", "broadcast"), eager=True)


def leg_vllm_tp2_weights(context: dict) -> dict:
    """Both ways into a tensor-parallel engine: the object store (the engine hands CPU tensors to its workers), then a
    broadcast that each worker joins on its own GPU (NCCL from a learner on a third GPU; with two GPUs, gloo from a
    learner on the CPU)."""
    if context["device"] != "cuda":
        raise CannotRunHere("tensor parallelism needs vLLM on GPUs")
    return _weights_leg(context, ("object_store", "broadcast"), eager=True, tp=2)


def _weights_leg(context: dict, paths: tuple[str, str], eager: bool, tp: int = 1) -> dict:
    """A learner step's weights into a running engine (`tp` GPUs), once by each of `paths`; after each, the engine's
    log-probs must follow the new weights (and not the old ones)."""
    import ray
    from transformers import AutoTokenizer

    from treepo_ray.engines.base import SamplingParams, SegmentRequest
    from treepo_ray.job.config import RuntimeConfig
    from treepo_ray.learner import LearnerConfig, TrainSample
    from treepo_ray.runtime.learner import LearnerGroup
    from treepo_ray.runtime.pool import EngineSpec, GeneratorPool
    from treepo_ray.runtime.weights import WeightSync

    device, gpus = context["device"], context["gpus"]
    cuda = device == "cuda"
    engine_name = "vllm" if cuda or _has_vllm() else "hf"
    if cuda:
        _require_vllm(device)
    whole = gpus >= tp + 1  # learner and engine each on GPUs of their own; else they share one (tp = 1)
    if "broadcast" in paths and cuda and not whole and tp == 1:
        raise CannotRunHere("NCCL broadcast needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    path = context["models"]["engine"]
    _start_ray(context)
    engine_gpus = tp if whole or tp > 1 else (0.5 if cuda else 0.0)
    learner_gpus = 1.0 if whole else (0.5 if cuda and tp == 1 else 0.0)  # tp on every GPU: the learner on CPU
    kwargs = _vllm_kwargs(context, 0.8 if whole or tp > 1 else 0.3, eager) if engine_name == "vllm" else {}
    if tp > 1:
        kwargs["tensor_parallel_size"] = tp
    rt = RuntimeConfig(engine_cpus=1, engine_gpus=engine_gpus, learner_cpus=1, learner_gpus=learner_gpus)
    pool = GeneratorPool(EngineSpec(engine_name, path, kwargs, 1, 1, engine_gpus, {}), rt)
    dtype = ray.get(next(iter(pool.members().values())).describe.remote())["weights_dtype"]
    backend = "nccl" if learner_gpus else "gloo"
    learner_dtype = "bfloat16" if learner_gpus else "float32"
    group = LearnerGroup(path, LearnerConfig(lr=5e-3, micro_batch_size=4, dtype=learner_dtype), rt,
                         WeightSync(paths[0], dtype, backend, 64 << 20, 120.0, tp))
    samples = [TrainSample(p, p[:8], advantages=1.0 if i % 2 else -1.0) for i, p in enumerate(PROMPTS)]
    figures = {"engine": engine_name, "dtype": dtype, "backend": backend, "tensor_parallel_size": tp,
               "enforce_eager": eager, "loads": []}
    model, vocab = _hf(path, device), len(AutoTokenizer.from_pretrained(path))
    for version, how in enumerate(paths, start=1):
        group.weights = WeightSync(how, dtype, backend, 64 << 20, 120.0, tp)
        group.train_step(ray.put(samples))
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
        figures["loads"].append({"path": how, "bytes": published.metrics()["weights/bytes"], "seconds": seconds,
                                 "logprob_gap_new": gap_new, "logprob_gap_old": gap_old})
        model.load_state_dict({k: v.to(device) for k, v in ray.get(group.export_weights()).items()}, strict=False)
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

    device = context["device"]
    ranks = 2  # the leg needs two GPUs (LEGS)
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
    return {"ranks": ranks, "backend": "nccl" if device == "cuda" else "gloo",
            "seconds": seconds, "tokens": metrics["tokens"], "loss": metrics["loss"],
            "grad_norm": metrics["grad_norm"]}


def leg_learner_memory(context: dict) -> dict:
    """Peak memory of one step under FSDP2 (a process group of one rank) at 1 and 2 layers; the difference is one
    layer's cost, extrapolated to PAPER_LAYERS. The optimizer state (float32 weights, gradients, two AdamW moments:
    16 bytes a parameter) is what FSDP2 shards over ranks; the rest (activations, gathered bf16 layers) is not."""
    import gc

    import torch
    import torch.distributed as dist

    from treepo_ray.learner import Learner, LearnerConfig, TrainSample

    device, rehearse = context["device"], context["rehearse"]
    seqs, length = (4, 128) if rehearse else (4, 8192)
    cfg = LearnerConfig(lr=1e-6, micro_batch_size=4, micro_batch_tokens=length, strategy="fsdp2",
                        dtype="bfloat16" if device == "cuda" else "float32", gradient_checkpointing=True)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                            rank=0, world_size=1)
    peaks, params, figures = {}, {}, {}
    for layers in (1, 2):
        learner = Learner(context["models"][f"memory{layers}"], cfg)
        if type(learner.strategy).__name__ != "FSDP2":
            raise AssertionError(f"the learner runs {type(learner.strategy).__name__}, not FSDP2")
        gen = torch.Generator().manual_seed(0)
        vocab = learner.vocab_size - 1
        samples = [TrainSample(torch.randint(2, vocab, (64,), generator=gen).tolist(),
                               torch.randint(2, vocab, (length - 64,), generator=gen).tolist(),
                               advantages=1.0 if i % 2 else -1.0) for i in range(seqs)]
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        metrics = learner.train_step(samples)
        figures[f"seconds_{layers}_layers"] = time.perf_counter() - start
        if metrics["skipped"] or not metrics["steps"]:
            raise AssertionError(f"the step was skipped: {metrics}")
        peaks[layers] = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else 0.0
        params[layers] = sum(p.numel() for p in learner.model.parameters())
        config = learner.model.config
        learner.close()
        del learner
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    figures["shape"] = {"vocab": config.vocab_size, "hidden": config.hidden_size, "sequences": seqs,
                        "tokens_each": length, "paper_layers": PAPER_LAYERS}
    if device != "cuda":
        return figures
    per_layer = peaks[2] - peaks[1]
    if per_layer <= 0:
        raise AssertionError(f"a second layer did not add memory ({peaks[1]:.2f} -> {peaks[2]:.2f} GiB)")
    peak = peaks[1] + (PAPER_LAYERS - 1) * per_layer
    states = 16 * (params[1] + (PAPER_LAYERS - 1) * (params[2] - params[1])) / 2**30
    gpu = torch.cuda.get_device_properties(0).total_memory / 2**30
    per_rank = {r: peak - states * (1 - 1 / r) for r in (1, 2, 4, 8)}
    fits = [r for r, gib in per_rank.items() if gib < 0.9 * gpu]
    figures.update(peak_gib={str(k): v for k, v in peaks.items()}, per_layer_gib=per_layer, predicted_peak_gib=peak,
                   optimizer_state_gib=states, per_rank_gib={str(r): v for r, v in per_rank.items()}, gpu_gib=gpu,
                   ranks_needed=fits[0] if fits else None)
    if not fits:
        raise AssertionError(f"at {PAPER_LAYERS} layers one step would need {per_rank[8]:.1f} GiB on each of 8 "
                             f"ranks; this GPU has {gpu:.1f} GiB")
    return figures


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def paper_depth_tree(prompt_len: int, segment_len: int, vocab: int, depth: int = 14, width: int = 16, seed: int = 0):
    """A TreePO-shaped tree: `width` paths that split in two at each of the first log2(width) depths, then run on
    to `depth` segments each; random tokens, alternating advantages."""
    import random

    from treepo_ray.learner.batch import TrainTree

    rng = random.Random(seed)
    segment = lambda: [rng.randrange(2, vocab) for _ in range(segment_len)]  # noqa: E731
    parent, tokens, frontier = [-1], [[]], [0]
    for d in range(depth):
        children = 2 if len(frontier) < width else 1
        grown = []
        for node in frontier:
            for _ in range(children):
                parent.append(node)
                tokens.append(segment())
                grown.append(len(parent) - 1)
        frontier = grown
    return TrainTree([rng.randrange(2, vocab) for _ in range(prompt_len)], parent, tokens, frontier,
                     [1.0 if i % 2 else -1.0 for i in range(len(frontier))])


def leg_learner_deep_tree(context: dict) -> dict:
    import torch

    from treepo_ray.learner import Learner, LearnerConfig
    from treepo_ray.learner.batch import tree_tokens

    device, rehearse = context["device"], context["rehearse"]
    prompt_len, segment_len = (16, 8) if rehearse else (256, 512)
    longest = prompt_len + 14 * segment_len  # the micro-batch budget must hold the longest path
    cfg = LearnerConfig(lr=1e-6, micro_batch_size=4, micro_batch_tokens=longest + 64,
                        dtype="bfloat16" if device == "cuda" else "float32", gradient_checkpointing=True)
    learner = Learner(context["models"]["engine"], cfg)
    tree = paper_depth_tree(prompt_len, segment_len, learner.vocab_size)
    depths = [len(tree.path(leaf)) for leaf in tree.trajectories]
    start = time.perf_counter()
    metrics = learner.train_step([tree])
    seconds = time.perf_counter() - start
    if metrics["skipped"] or not metrics["steps"] or not math.isfinite(metrics["loss"]):
        raise AssertionError(f"the deep tree's step was skipped or not finite: {metrics}")
    figures = {"paths": len(tree.trajectories), "depth": max(depths), "unique_tokens": tree_tokens(tree),
               "path_tokens": sum(tree.response_length(leaf) for leaf in tree.trajectories),
               "seconds": seconds, "loss": metrics["loss"], "tokens": metrics.get("tokens")}
    if device == "cuda":
        figures["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
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


if __name__ == "__main__":
    sys.exit(main())
