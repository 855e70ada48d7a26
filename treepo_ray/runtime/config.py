"""The training job's configuration: the layers' own config dataclasses, composed, plus the runtime's sections.

Defaults of each layer live with that layer (tree growers, learner, loss); this file only adds what the pipeline
itself decides (resources, staleness, steps, checkpoints). YAML files under jobs/configs/ set any subset;
`key.sub=value` arguments override them.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from treepo_ray import config as config_io
from treepo_ray.data.datasets import DatasetConfig
from treepo_ray.learner.config import LearnerConfig
from treepo_ray.runtime.batch import LOSS_PRESETS, AlgoConfig
from treepo_ray.runtime.fault_config import ChaosConfig, ElasticConfig, FaultConfig
from treepo_ray.runtime.logs import LogConfig
from treepo_ray.tree import SequentialConfig, TreePOConfig, TreeRPOConfig

# The CPU demo configuration `treepo-ray train` runs when given no YAML file.
CONFIG_DIR = Path(__file__).resolve().parents[2] / "jobs" / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "cpu.yaml"


@dataclass
class ModelConfig:
    """The policy model and the engine that samples from it."""

    path: str = ""
    """Hugging Face model directory; empty = the tiny base model of the synthetic task (built once, cached)."""
    cache_dir: str = ".cache/treepo-ray"
    """Where the tiny base model and the synthetic data are cached."""
    engine: str = "hf"
    """Generation backend (treepo_ray.engines.make_engine): 'hf' or 'vllm'."""
    engine_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of the engine's constructor."""


@dataclass
class DataConfig:
    """The prompts: the synthetic task, or local dataset files (see treepo_ray.data.load_records)."""

    name: str = "synthetic"
    """'synthetic' (the built-in addition task), a folder with train/test files, 'train.jsonl,test.jsonl', or one
    file (then nothing is held out)."""
    seed: int = 0
    """Seed of the synthetic task's problems and of the base model's pretraining."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch (deterministically from trainer.seed and the epoch)."""
    prompt: DatasetConfig = field(default_factory=DatasetConfig)
    """How rows become prompts (chat template, length limit, bad rows)."""


@dataclass
class RolloutConfig:
    """How trees (or i.i.d. groups) are sampled; algo.name picks which grower config is used."""

    temperature: float = 1.0
    """Sampling temperature (TreePO: 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    treepo: TreePOConfig = field(default_factory=TreePOConfig)
    """TreePO tree sampler (algo treepo, treepo_flat)."""
    treerpo: TreeRPOConfig = field(default_factory=TreeRPOConfig)
    """TreeRPO N-ary tree sampler (algo treerpo)."""
    sequential: SequentialConfig = field(default_factory=SequentialConfig)
    """i.i.d. sampler (algo grpo, dapo)."""

    def sampler_config(self, sampler: str):
        return getattr(self, sampler)


@dataclass
class RuntimeConfig:
    """Actors, resources and the asynchrony bound."""

    address: str = ""
    """Ray cluster to join ('auto', 'ray://host:10001'); empty = RAY_ADDRESS if set, else a new local Ray."""
    num_cpus: int = 0
    """CPUs of a new local Ray (0 = all of this machine's)."""
    max_staleness: int = 1
    """Generators run weights at most this many versions behind the learner (0 = fully synchronous)."""
    num_engines: int = 1
    """Engine actors in the generator pool."""
    engine_cpus: float = 1.0
    """CPUs reserved by each engine actor."""
    engine_gpus: float = 0.0
    """GPUs reserved by each engine actor."""
    engine_resources: dict = field(default_factory=dict)
    """Custom Ray resources of each engine actor (e.g. {generator_gpu: 1} to land on generator nodes)."""
    num_schedulers: int = 1
    """Tree scheduler actors (prompts are sharded over them)."""
    num_verifiers: int = 1
    """Verifier actors (CPU)."""
    verifier_cpus: float = 0.0
    """CPUs reserved by each verifier actor (0 = share the machine; verification is light)."""
    verifier_timeout_s: float = 5.0
    """Per-solution time limit of the verifier."""
    learner_ranks: int = 1
    """Learner ranks (processes joined by torch.distributed)."""
    learner_cpus: float = 1.0
    """CPUs reserved by each learner rank."""
    learner_gpus: float = 0.0
    """GPUs reserved by each learner rank."""
    learner_resources: dict = field(default_factory=dict)
    """Custom Ray resources of each learner rank (e.g. {learner_gpu: 1})."""
    torch_threads: int = 1
    """torch threads of each engine and learner actor."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Lost actors and bad values: learner restarts, re-sent requests, verifier retries."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Generator pool size between num_engines and elastic.max_engines, following the cluster."""
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    """Deliberate engine kills, to rehearse recovery (off by default)."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"runtime.max_staleness = {self.max_staleness}; it must be >= 0")
        for name in ("num_engines", "num_schedulers", "num_verifiers", "learner_ranks", "torch_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"runtime.{name} = {getattr(self, name)}; it must be >= 1")


@dataclass
class TrainerConfig:
    """Steps, batch size, evaluation and checkpoints."""

    steps: int = 100
    """Training steps (one learner update of one batch each)."""
    prompts_per_step: int = 32
    """Prompts whose trees make one training batch."""
    seed: int = 0
    """Seed of the prompt order and of every tree's sampling."""
    run_dir: str = ""
    """Run directory (metrics, trees, checkpoints, summary); empty = runs/<algo>-<timestamp>."""
    resume: str = ""
    """'' = fresh run; 'auto' = the latest checkpoint of run_dir (or of the newest runs/<algo>-*); or a path."""
    save_every: int = 50
    """Save a checkpoint every this many steps (and at the end; 0 = only at the end)."""
    keep_checkpoints: int = 2
    """Keep the newest this many checkpoints; older ones are deleted."""
    eval_size: int = 500
    """Held-out problems evaluated before training and at the end (0 = no evaluation)."""
    eval_samples: int = 4
    """Answers sampled per held-out problem; accuracy is pass@1, their mean (1 answer when greedy)."""
    eval_temperature: float = 1.0
    """Sampling temperature of evaluation (0 = greedy decoding)."""
    eval_every: int = 0
    """Also evaluate every this many steps during training (0 = only before and after)."""
    eval_max_new_tokens: int = 0
    """Answer length cap in evaluation (0 = the sampler's response limit)."""
    stop_after: int = 0
    """Stop (checkpoint and exit) after this many steps of this invocation, as if interrupted (0 = run to the end)."""

    def __post_init__(self) -> None:
        for name in ("steps", "prompts_per_step", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} = {getattr(self, name)}; it must be >= 1")
        if self.resume not in ("", "auto") and not Path(self.resume).exists():
            raise ValueError(f"trainer.resume = {self.resume!r} is neither '', 'auto' nor an existing checkpoint")


@dataclass
class TrainConfig:
    """Everything `treepo-ray train` reads."""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm and credit assignment."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model and engine."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """Optimiser and loss."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    """Actors and asynchrony."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, evaluation, checkpoints."""
    log: LogConfig = field(default_factory=LogConfig)
    """Logging sinks."""

    @property
    def sampler_config(self):
        return self.rollout.sampler_config(self.algo.sampler)


def _dotted(cls: type, data: dict, prefix: str = "") -> list[str]:
    """A YAML mapping as `a.b=value` overrides: sections (dataclass fields) are walked into, every other value
    (free-form mappings such as model.engine_kwargs included) is set whole."""
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    out = []
    for key, value in data.items():
        sub = hints.get(key)
        if isinstance(value, dict) and sub is not None and dataclasses.is_dataclass(sub):
            out += _dotted(sub, value, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}={yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()}")
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults, then the YAML file at `path`, then `key.sub=value` overrides; errors name the file and key.

    The file goes through the same dotted-override path as the command line, so a free-form mapping
    (engine_kwargs, *_resources) is replaced whole rather than merged key by key into its empty default."""
    file_args: list[str] = []
    if path is not None:
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of config sections, got {type(data).__name__}")
        file_args = _dotted(TrainConfig, data)
        try:
            config_io.load(TrainConfig, None, file_args)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    args = file_args + list(overrides or [])
    cfg = config_io.load(TrainConfig, None, args)
    if not cfg.algo.loss_preset:
        return cfg
    # The algorithm's own loss goes under everything given explicitly (first, so later arguments win).
    preset = [f"learner.loss.{k}={v}" for k, v in LOSS_PRESETS[cfg.algo.name].items()]
    return config_io.load(TrainConfig, None, preset + args)
