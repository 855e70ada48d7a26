"""The tiny base model: a small Qwen2 pretrained on NOISY worked solutions of a synthetic task.

The default task's text (running sums, data/chain.py) also rambles, repeats or gives up now and then, and a quarter
of it teaches the task's critique format (critique naming the step to redo, corrected continuation), which CATPO's
healing prompts use. `treepo-ray pretrain [--cache-dir DIR] [key=value ...]` (task=synthetic_addition for the easy
task) and `prepare_base_model(cache_dir, seed, base_model_config(task))` (what the train job calls when it is
given no model) build it. The result is an ordinary HF model directory, cached under a hash
of its settings, with `base_eval.json` beside the weights: the model's held-out pass@1 when sampling at
temperature 1.0 (as RL samples) and greedily. The noise rate keeps it imperfect on purpose: a base model with room
to learn from reward, as in RL-zero.

Deterministic from the seed on a given CPU: the model's initial weights, the training problems, the noise and the
evaluation all derive from it, and the budget is a number of optimizer steps, not a time (float32 with a fixed
thread count; a different thread count or CPU changes the last bits), extended while a check of its sampled
accuracy falls short of `min_pass1`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from treepo_ray import config as config_io
from treepo_ray.data.chain import ChainTaskConfig
from treepo_ray.data.synthetic import Problem, SyntheticTaskConfig, make_problems, pretrain_text, task_config
from treepo_ray.engines.tiny import TinyModelConfig, build_tiny_model
from treepo_ray.rewards.synthetic import verify

FORMAT_VERSION = 3  # bump when the training recipe changes in a way the settings do not show, to refresh caches


@dataclass
class PretrainConfig:
    """Settings of the base model's pretraining; their hash names the cache entry. The defaults are the default
    task's (`base_model_config` gives each task's)."""

    seed: int = 0
    """Seed of the initial weights, the training problems, the noise and the evaluation problems."""
    task: str = "synthetic"
    """Which synthetic task (data/synthetic.py TASKS): 'synthetic' (running sums) or 'synthetic_addition'."""
    chain: ChainTaskConfig = field(default_factory=ChainTaskConfig)
    """The running-sum task and the imperfections of its training text (task 'synthetic')."""
    addition: SyntheticTaskConfig = field(default_factory=lambda: SyntheticTaskConfig(noise=0.6))
    """The addition task, with the carry-drop rate of its training text (task 'synthetic_addition'). Above 0.5, so
    the model learns to drop carries more often than not: greedy decoding then drops them too and is as imperfect
    as sampling (measured: noise 0.3 gave pass@1 0.62 sampled but 0.995 greedy; 0.6 about 0.32 and 0.14)."""
    model: TinyModelConfig = field(
        default_factory=lambda: TinyModelConfig(hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                                                num_kv_heads=2, max_positions=768)
    )
    """Shape of the model (its seed is replaced by `seed`)."""
    steps: int = 500
    """Optimizer steps (the deterministic budget). The running-sum layout is learnt in a jump between about 250
    and 500 steps of 32 texts (measured: greedy accuracy 5% at step 300, 68% at 400, 98% at 500), and sampled
    accuracy moves steeply with the budget (steps of 28 texts, 7 micro-batches, carry noise 0.2: 500 steps pass@1
    0.123, greedy 0.69, 201 CPU-seconds; 600 steps 0.290, greedy 0.95, 247 CPU-seconds; carry noise 0.1 on a
    2-vCPU Xeon: 500 steps 0.099, 525 steps 0.179, greedy 0.85): 500 keeps pretraining within about three minutes
    on 2 cores with the base model in the 10-30% band (see `min_pass1` for a CPU where it does not)."""
    batch_size: int = 28
    """Training texts per step (fresh problems every step)."""
    micro_batches: int = 7
    """Each step's texts, sorted by length, go through the model in this many batches (at most one per text;
    less padding; the step's loss is the same token mean). Measured on a shared machine, 60 steps of 28 texts:
    47 s in 1 batch, 34 s in 2, 27 s in 4, 25 s in 7."""
    max_len: int = 288
    """A text that never ends (rambling, repeating) is cut to this many tokens after the question, without EOS:
    a little over the 256-token responses the default job samples."""
    lr: float = 3e-3
    """Peak AdamW learning rate (linear warmup, cosine decay to 10%)."""
    warmup_steps: int = 50
    """Steps of linear warmup."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    num_threads: int = 2
    """torch threads of the pretraining process (see pretrain_in_subprocess for why two cost little when the
    machine is busy)."""
    eval_problems: int = 500
    """Held-out problems of the base evaluation."""
    eval_samples: int = 4
    """Samples per problem at temperature 1.0 (pass@1 = their mean accuracy)."""
    eval_max_new_tokens: int = 256
    """Response length cap of the evaluation."""
    min_pass1: float = 0.10
    """After `steps`, training goes on at the final learning rate, `check_every` steps at a time, until the
    sampled pass@1 (temperature 1.0, `eval_samples` each) on `check_problems` fresh training-split problems
    reaches this; 0 = no check. The jump in accuracy comes at a step that float rounding moves from one CPU to
    another (measured, 500 steps: pass@1 0.123, greedy 0.69 on the machines of earlier sessions; 0.051, greedy 0.60
    on an AVX2-only AMD EPYC), so a fixed budget alone can leave the base model below the 10-30% band. Only ever
    adds steps: where 500 already reach it, the model is the one a fixed budget gives."""
    check_problems: int = 250
    """Problems of each check (x eval_samples answers: 1000 by default, a standard error of 0.01 at 0.1)."""
    check_every: int = 25
    """Steps between checks."""
    max_extra_steps: int = 200
    """At most this many steps past `steps`, reached or not."""

    def __post_init__(self) -> None:
        task_config(self.task)  # raises on an unknown task
        if self.micro_batches < 1:
            raise ValueError(f"micro_batches = {self.micro_batches}; it must be >= 1")
        if self.min_pass1 > 0 and (self.check_every < 1 or self.check_problems < 1):
            raise ValueError(f"check_every = {self.check_every}, check_problems = {self.check_problems}: both must"
                             " be >= 1 when min_pass1 > 0")

    @property
    def task_config(self) -> ChainTaskConfig | SyntheticTaskConfig:
        return self.chain if self.task == "synthetic" else self.addition


def base_model_config(task: str = "synthetic", seed: int = 0) -> PretrainConfig:
    """The base model's settings for a synthetic task (`task` not one of them: the default task's)."""
    if task == "synthetic_addition":  # short answers: a short context, and the budget measured for it
        return PretrainConfig(seed=seed, task=task, steps=1200, batch_size=32, micro_batches=1, max_len=64,
                              num_threads=1, min_pass1=0.0,
                              eval_samples=8, eval_max_new_tokens=96,
                              model=TinyModelConfig(hidden_size=128, intermediate_size=384, num_layers=2,
                                                    num_heads=4, num_kv_heads=2, max_positions=256))
    return PretrainConfig(seed=seed)


def settings_hash(cfg: PretrainConfig) -> str:
    """Short hash of every setting that changes the model (thread count and evaluation size included)."""
    blob = json.dumps({"format": FORMAT_VERSION, **config_io.to_dict(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _lr_at(step: int, cfg: PretrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _batches(problems: list[Problem], cfg: PretrainConfig, rng: random.Random, tokenizer):
    """One step's training texts as `cfg.micro_batches` padded batches (input ids, attention mask, labels, label
    tokens) of texts of similar length, so little compute goes to padding; the loss covers the text after the
    question (and its EOS) only."""
    rows = []
    for p in problems:
        question, text, eos = pretrain_text(p, cfg.task_config, rng)
        prompt = tokenizer(question, add_special_tokens=False).input_ids
        answer = tokenizer(text, add_special_tokens=False).input_ids
        answer = answer + [tokenizer.eos_token_id] if eos else answer[: cfg.max_len]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    rows.sort(key=lambda r: len(r[0]))
    pad, size = tokenizer.pad_token_id, -(-len(rows) // min(cfg.micro_batches, len(rows)))  # at most one per text
    for part in (rows[i:i + size] for i in range(0, len(rows), size)):
        width = max(len(r) for r, _ in part)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in part])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in part])
        lab = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in part])
        yield ids, mask, lab, int((lab != -100).sum())


def train(out_dir: Path, cfg: PretrainConfig, log=print) -> dict:
    """Pretrain a fresh tiny model on noisy worked solutions and save it (with its tokenizer) to `out_dir`; return
    the steps it took and the checks past `cfg.steps` ({"steps": n, "checks": [[step, pass@1], ...]})."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    torch.set_num_threads(max(1, cfg.num_threads))
    model_cfg = TinyModelConfig(**{**config_io.to_dict(cfg.model), "seed": cfg.seed})
    build_tiny_model(out_dir, model_cfg)
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    model = Qwen2ForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    extra = cfg.max_extra_steps if cfg.min_pass1 > 0 else 0
    problems = make_problems((cfg.steps + extra) * cfg.batch_size, cfg.task_config, cfg.seed, "train", unique=False)
    noise_rng = random.Random(f"{cfg.seed}/noise")
    start, ema = time.time(), None

    def check(step: int) -> float:
        model.save_pretrained(out_dir)
        acc = evaluate_pass1(out_dir, make_problems(cfg.check_problems, cfg.task_config, f"{cfg.seed}/check"),
                             cfg.eval_samples, 1.0, cfg.eval_max_new_tokens, cfg.seed, cfg.num_threads)
        log(f"pretrain step {step}: check pass@1 {acc:.3f} on {cfg.check_problems} fresh training problems"
            f" (at least {cfg.min_pass1} wanted)")
        return acc

    steps, checks = cfg.steps, []
    step = 0
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = _lr_at(min(step, cfg.steps - 1), cfg)  # past the budget: the schedule's last rate
        chunk = problems[step * cfg.batch_size : (step + 1) * cfg.batch_size]
        parts = list(_batches(chunk, cfg, noise_rng, tokenizer))
        total, loss = sum(p[3] for p in parts), 0.0
        opt.zero_grad(set_to_none=True)
        for ids, mask, labels, n in parts:  # the step's loss: the mean over all its label tokens
            part = model(input_ids=ids, attention_mask=mask, labels=labels).loss * (n / total)
            part.backward()
            loss += part.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        step += 1
        if step % max(1, cfg.steps // 10) == 0 or step == steps:
            log(f"pretrain step {step}/{steps}  loss {ema:.4f}  {time.time() - start:.0f}s  ({params} params)")
        if step == steps and step < cfg.steps + extra:
            model.eval()
            checks.append([step, check(step)])
            model.train()
            if checks[-1][1] < cfg.min_pass1:
                steps = min(steps + cfg.check_every, cfg.steps + extra)
    model.eval()
    model.save_pretrained(out_dir)
    return {"steps": steps, "checks": checks}


def evaluate_pass1(model_dir: Path, problems: list[Problem], samples: int, temperature: float,
                   max_new_tokens: int, seed: int, num_threads: int = 1) -> float:
    """Mean exact accuracy of `samples` completions per problem (temperature 0 = greedy, one completion),
    sampled by the project's engine and sequential grower, the same path as `treepo-ray eval`."""
    from transformers import AutoTokenizer

    from treepo_ray.data.prompts import Prompt
    from treepo_ray.data.sampling import SampleSettings, sample_answers
    from treepo_ray.engines.hf import HFEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine(model_dir, num_threads=num_threads, seed=seed)
    records = [Prompt(p.id, tuple(tokenizer(p.question, add_special_tokens=False).input_ids), p.answer,
                      p.data_source, p.question) for p in problems]
    # One segment per path: the whole response at once.
    settings = SampleSettings(n=samples, temperature=temperature, max_new_tokens=max_new_tokens,
                              segment_len=max_new_tokens, seed=seed)
    texts = sample_answers(records, engine, tokenizer, settings)
    correct = [verify(t, p.answer) for p, ts in zip(problems, texts) for t in ts]
    return sum(correct) / len(correct)


def pretrain(out_dir: str | Path, cfg: PretrainConfig, log=print) -> dict:
    """Train into `out_dir`, evaluate on held-out problems, write and return base_eval.json's content."""
    out_dir = Path(out_dir)
    threads = torch.get_num_threads()  # restored afterwards: the caller's process keeps its own setting
    try:
        start, cpu0 = time.time(), time.process_time()
        trained = train(out_dir, cfg, log)
        train_s, train_cpu_s = time.time() - start, time.process_time() - cpu0
        log(f"evaluating on {cfg.eval_problems} held-out problems ...")
        problems = make_problems(cfg.eval_problems, cfg.task_config, cfg.seed, "test")
        sampled = evaluate_pass1(out_dir, problems, cfg.eval_samples, 1.0, cfg.eval_max_new_tokens, cfg.seed,
                                 cfg.num_threads)
        greedy = evaluate_pass1(out_dir, problems, 1, 0.0, cfg.eval_max_new_tokens, cfg.seed, cfg.num_threads)
    finally:
        torch.set_num_threads(threads)
    result = {
        "pass@1": sampled,
        "pass@1_sampling": f"temperature 1.0, mean over {cfg.eval_samples} samples per problem",
        "greedy_accuracy": greedy,
        "held_out_problems": cfg.eval_problems,
        "steps": trained["steps"],
        "checks": trained["checks"],  # [step, pass@1 on fresh training problems] past the step budget
        "train_seconds": round(train_s, 1),
        "train_cpu_seconds": round(train_cpu_s, 1),  # what it costs on free cores, whatever else ran meanwhile
        "eval_seconds": round(time.time() - start - train_s, 1),
        "settings_hash": settings_hash(cfg),
        "config": config_io.to_dict(cfg),
    }
    (out_dir / "base_eval.json").write_text(json.dumps(result, indent=2))
    log(f"base model held-out pass@1 {sampled:.3f} (temperature 1.0, {cfg.eval_samples} samples x "
        f"{cfg.eval_problems} problems), greedy {greedy:.3f}; trained {trained['steps']} steps in {train_s:.0f}s")
    return result


def pretrain_in_subprocess(out_dir: Path, cfg: PretrainConfig, log=print) -> None:
    """`pretrain` in a fresh Python process (its lines passed to `log`): its own torch threads, set before torch
    starts, whose OpenMP threads spin a short while at each wait before they sleep (GOMP_SPINCOUNT). The model's
    ops are small, so a thread that sleeps at every wait (OMP_WAIT_POLICY=PASSIVE) costs a wake-up per op, and one
    that spins long steals a busy machine's cores; measured on 2 cores, 28-text steps: 0.47-0.50 s quiet and 1.5 s
    with the other core busy at a spin count of 5000, 1.05 s and 0.71 s passive, 0.47 s and 2.05 s at OpenMP's
    default spin. Pretraining runs before Ray starts, on a quiet machine."""
    import subprocess

    # The folder that holds this treepo_ray package (a checkout, or site-packages for an installed wheel), so the
    # child imports the same code whatever the working directory.
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "5000"),
           "PYTHONPATH": os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")])}
    args = config_io.file_overrides(PretrainConfig, config_io.to_dict(cfg))
    with subprocess.Popen([sys.executable, "-m", "treepo_ray.data.pretrain", "--out", str(out_dir), *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip())
            log(lines[-1])
    if proc.returncode:
        raise RuntimeError(f"pretraining failed (exit {proc.returncode}): " + " | ".join(lines[-5:]))


def prepare_base_model(cache_dir: str | Path, seed: int = 0, cfg: PretrainConfig | None = None, log=print) -> Path:
    """The pretrained tiny base model's directory under `cache_dir`, trained on the first call for these settings.

    Cached by a hash of the settings (`cfg`, with `seed` replacing cfg.seed): a second call returns at once.
    The model is built (in a subprocess) in a temporary directory and renamed into place, so an interrupted or
    concurrent build never leaves a half-written model behind.
    """
    cfg = config_io.from_dict(PretrainConfig, {**config_io.to_dict(cfg or PretrainConfig()), "seed": seed})
    root = Path(cache_dir)
    final = root / f"base-{settings_hash(cfg)}"
    if (final / "base_eval.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=root))
    try:
        pretrain_in_subprocess(tmp, cfg, log)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same model first: keep theirs
            if not (final / "base_eval.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"base model ready: {final}")
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        allow_abbrev=False,
        prog="treepo-ray pretrain",
        description="Pretrain the tiny base model on noisy worked solutions of the synthetic task (cached).",
    )
    parser.add_argument("--cache-dir", default=".cache/treepo-ray", help="cache root of base models")
    parser.add_argument("--out", default="", help="write the model here instead of the cache (always retrains)")
    parser.add_argument("overrides", nargs="*", help="PretrainConfig overrides, e.g. steps=800 chain.carry_noise=0.2")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    cfg = config_io.apply_overrides(PretrainConfig(), args.overrides)
    if args.out:
        result = pretrain(args.out, cfg)
        path = Path(args.out)
    else:
        path = prepare_base_model(args.cache_dir, cfg.seed, cfg)
        result = json.loads((path / "base_eval.json").read_text())
    print(json.dumps({"model": str(path), "pass@1": result["pass@1"], "greedy_accuracy": result["greedy_accuracy"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
