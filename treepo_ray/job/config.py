"""The training job's configuration: the layers' own config dataclasses, composed, plus what the job itself decides
(algorithm, resources, fault handling, staleness, steps, checkpoints).

Defaults of each layer live with that layer (tree growers, learner, loss, datasets, healing); this file holds the
rest. YAML files under jobs/configs/ set any subset; `key.sub=value` arguments override them (treepo_ray/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import warnings

import yaml

from treepo_ray import config as config_io
from treepo_ray.config import UserError
from treepo_ray import storage
from treepo_ray.algo.catpo import score_tree
from treepo_ray.algo.credit import ALGORITHMS, PER_NODE, TREEPO_SCALES, tree_advantages, tree_credit
from treepo_ray.algo.overlong import OverlongConfig, with_overlong_penalty
from treepo_ray.data.datasets import DataConfig
from treepo_ray.data.evaluate import EvalConfig
from treepo_ray.healing.critique import HealingConfig
from treepo_ray.job.logs import LogConfig
from treepo_ray.learner.config import LearnerConfig
from treepo_ray.rewards.custom import RewardFunctionConfig
from treepo_ray.tree import SequentialConfig, TreePOConfig, TreeRPOConfig

# The CPU demo configuration `treepo-ray train` runs when given no YAML file.
CONFIG_DIR = Path(__file__).resolve().parents[2] / "jobs" / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "cpu.yaml"


# ---------------------------------------------------------------------------------------------- algorithm


@dataclass
class CatpoConfig:
    """CATPO's informativeness thresholds and healing (paper Tables 1 and 5); read only when algo.name=catpo."""

    tau_low: float = 0.025
    """F at or below this (with near-unanimous leaves) makes a tree dead-correct or dead-wrong."""
    tau_high: float = 0.10
    """F above this makes a tree informative; between the two it is stale."""
    var_cut: float = 0.05
    """Dead-tree variance cutoff: p (1 - p) below this counts as near-unanimous."""
    heal: bool = True
    """Phase 3: critique-guided healing of dead-wrong trees (off = score and weight only)."""
    weighting: bool = True
    """Phase 4: scale each tree's advantages by w(T) = F / mean F (off = TreeRPO's uniform weights)."""
    healing: HealingConfig = field(default_factory=HealingConfig)
    """Healing settings (k, temperatures, critique length, prompts file); step_len 0 = rollout.treerpo.step_len."""
    heal_concurrency: int = 8
    """Trees the healer actor heals at once (each mostly waits on the generator pool)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.tau_low <= self.tau_high:
            raise ValueError(f"algo.catpo: need 0 <= tau_low ({self.tau_low}) <= tau_high ({self.tau_high})")
        if not self.var_cut > 0:
            raise ValueError(f"algo.catpo.var_cut = {self.var_cut}; it must be > 0")
        if self.heal_concurrency < 1:
            raise ValueError(f"algo.catpo.heal_concurrency = {self.heal_concurrency}; it must be >= 1")

    def score(self, tree) -> dict:
        """CATPO phase 2 for one verified tree with these thresholds (algo/catpo.py: score_tree)."""
        return score_tree(tree, self.tau_low, self.tau_high, self.var_cut)


# Each algorithm's own policy loss (its paper's setting), applied under anything a YAML file or the command line
# sets in learner.loss (see load_config). GRPO: Shao et al. 2024 (PPO clip, per-sequence mean,
# KL to the reference); DAPO: Yu et al. 2025 (clip-higher, token-level mean, no KL), which TreePO adopts;
# TreeRPO/CATPO: PPO clip with a k3 KL of 0.001 (CATPO paper, appendix B), each node once (CATPO eq. 7: node-mean).
_PPO_KL = {"aggregation": "token-mean", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.001, "kl_estimator": "k3"}
_DAPO = {"aggregation": "token-mean", "clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0}
LOSS_PRESETS = {
    "grpo": {**_PPO_KL, "aggregation": "seq-mean"},
    "dapo": _DAPO, "treepo": _DAPO, "treepo_flat": _DAPO,
    "treerpo": {**_PPO_KL, "aggregation": "node-mean"}, "catpo": {**_PPO_KL, "aggregation": "node-mean"},
}

DYNAMIC_SAMPLING_BY_DEFAULT = ("dapo", "treepo", "treepo_flat")

# Which grower config an algorithm samples with.
SAMPLER_OF = {"grpo": "sequential", "dapo": "sequential", "treepo": "treepo", "treepo_flat": "treepo",
              "treerpo": "treerpo", "catpo": "treerpo"}


@dataclass
class AlgoConfig:
    """Which algorithm runs, and its credit-assignment knobs (the loss lives in learner.loss)."""

    name: str = "treepo"
    """grpo | dapo | treepo | treepo_flat (tree sampling, flat GRPO advantage) | treerpo | catpo (TreeRPO trees,
    scored, healed and weighted: algo/catpo.py)."""
    dynamic_sampling: bool | None = None
    """DAPO dynamic sampling: drop prompts whose trajectories all got the same reward, refill from new prompts.
    None = the algorithm's own: on for dapo, treepo and treepo_flat (TreePO trains with DAPO's protocol; a group
    without signal would only shift the batch whitening), off for grpo and treerpo."""
    oversample: float = 1.0
    """With dynamic sampling: prompts grown per round as a multiple of trainer.prompts_per_step (DAPO/TreePO: 3)."""
    max_extra_rounds: int = 2
    """With dynamic sampling: at most this many extra rounds when too few prompts kept (then train on what is kept)."""
    treepo_weighting: str = "average"
    """TreePO subgroup aggregation: 'average' (paper default) or 'size'."""
    treepo_root_group: bool = True
    """TreePO: the whole prompt's group is one of each trajectory's levels (False = the paper's no-root ablation)."""
    treepo_subgroup_rejection: bool = False
    """TreePO: skip subgroups whose rewards are all equal (the paper's subgroup-level rejection ablation)."""
    treepo_scale: str = "batch"
    """TreePO: 'batch' whitens the subgroup scores over the whole batch (the official script's REINFORCE++
    normalisation); 'prompt' divides each prompt's scores by the std of its rewards, as GRPO does per group."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO's overlong reward buffer, applied to trajectory rewards before credit (algo/overlong.py)."""
    whiten_by_tokens: bool = True
    """TreePO: batch whitening weighted by each trajectory's token count (False = one weight per trajectory)."""
    grpo_scale: bool = True
    """GRPO/DAPO/treepo_flat: divide by the group's std (False = only subtract the mean, Dr. GRPO style)."""
    treerpo_prune_range: float = 0.1
    """TreeRPO: a sibling group takes part only if its reward range reaches this (tau_prune)."""
    loss_preset: bool = True
    """Start learner.loss from the algorithm's own loss (LOSS_PRESETS); keys set in learner.loss by a YAML file or
    the command line still win. False = learner.loss's plain defaults."""
    correct_threshold: float = 1.0
    """A trajectory counts as correct (accuracy metrics) when its reward is at least this."""
    catpo: CatpoConfig = field(default_factory=CatpoConfig)
    """CATPO: informativeness thresholds, healing, loss weights (used when name = catpo)."""

    def __post_init__(self) -> None:
        if self.name not in ALGORITHMS:
            raise ValueError(f"algo.name = {self.name!r}; choose one of {ALGORITHMS}")
        if self.oversample < 1.0:
            raise ValueError(f"algo.oversample = {self.oversample}; it must be >= 1")
        if self.max_extra_rounds < 0:
            raise ValueError(f"algo.max_extra_rounds = {self.max_extra_rounds}; it must be >= 0")
        if self.treepo_scale not in TREEPO_SCALES:
            raise ValueError(f"algo.treepo_scale = {self.treepo_scale!r}; choose one of {TREEPO_SCALES}")

    @property
    def sampler(self) -> str:
        return SAMPLER_OF[self.name]

    @property
    def filters_groups(self) -> bool:
        """Whether DAPO dynamic sampling is on (dynamic_sampling, or the algorithm's default when None)."""
        if self.dynamic_sampling is None:
            return self.name in DYNAMIC_SAMPLING_BY_DEFAULT
        return self.dynamic_sampling

    def advantages(self, trees: list) -> list:
        """Every trajectory's advantage under this algorithm's credit settings (algo/credit.py), from the rewards
        with the overlong penalty when it is on."""
        return tree_advantages(self._penalised(trees), self.name, **self._credit_settings())

    def credit(self, trees: list) -> list:
        """Each tree's credit as the learner takes it: trajectory advantages, and per-node ones for TreeRPO and
        CATPO (algo/credit.py: tree_credit), from the rewards with the overlong penalty when it is on."""
        return tree_credit(self._penalised(trees), self.name, **self._credit_settings())

    def _penalised(self, trees: list) -> list:
        return with_overlong_penalty(trees, self.overlong) if self.overlong.enable else trees

    def _credit_settings(self) -> dict:
        return dict(treepo_weighting=self.treepo_weighting, whiten_by_tokens=self.whiten_by_tokens,
                    grpo_scale=self.grpo_scale, treerpo_prune_range=self.treerpo_prune_range,
                    treepo_root_group=self.treepo_root_group,
                    treepo_subgroup_rejection=self.treepo_subgroup_rejection, treepo_scale=self.treepo_scale)


# ---------------------------------------------------------------------------------------------- runtime

KILL_MODES = ("ray", "signal", "alternate")


@dataclass
class FaultConfig:
    """How the run survives lost actors and bad values."""

    max_learner_restarts: int = 3
    """A lost learner is rebuilt from the newest checkpoint at most this many times per run (then the run fails)."""
    max_resends: int = 16
    """A tree's requests are sent again to another engine at most this many times per call (engine losses)."""
    engine_wait_s: float = 900.0
    """A scheduler that has no live engine waits this long for a replacement before failing the run."""
    verifier_retries: int = 2
    """A scoring call that fails (verifier lost) or times out is retried this many times on the next verifier;
    after that its solutions are scored as failures (the rewards layer's wrong score), with the reason logged."""
    verifier_call_timeout_s: float = 120.0
    """One scoring call longer than this is abandoned, its verifier restarted, and the call retried."""
    learner_ping_s: float = 30.0
    """When the loop fails, a learner rank that does not answer a ping within this long counts as lost."""
    max_engine_errors: int = 3
    """An engine whose step raises (out of memory, a CUDA error) is killed and replaced and the call re-sent; a call
    that makes more than this many engines fail raises the error (a fault of the request, not of the engines)."""
    max_regrows: int = 4
    """A shard of a batch whose scheduler (or the CATPO healer) is lost or stuck is grown again, with the same seeds,
    on a replacement at most this many times per batch."""
    max_verify_failed_share: float = 0.1
    """A trajectory whose verification failed after the retries is left out of the loss (verify/failed); a step in
    which more than this share of trajectories failed stops the run."""

    def __post_init__(self) -> None:
        for name in ("max_learner_restarts", "max_resends", "verifier_retries", "max_engine_errors", "max_regrows"):
            if getattr(self, name) < 0:
                raise ValueError(f"runtime.faults.{name} = {getattr(self, name)}; it must be >= 0")
        for name in ("engine_wait_s", "verifier_call_timeout_s", "learner_ping_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"runtime.faults.{name} = {getattr(self, name)}; it must be > 0")
        if not 0.0 <= self.max_verify_failed_share <= 1.0:
            raise ValueError(f"runtime.faults.max_verify_failed_share = {self.max_verify_failed_share}; it must be "
                             "in [0, 1]")


@dataclass
class DeadlineConfig:
    """How long each kind of blocking call on an actor may take before it counts as hung (runtime/liveness.py)."""

    start_s: float = 900.0
    """A new actor (learner rank, verifier, scheduler, healer) must be scheduled and constructed within this; if not,
    the run stops naming it and the resources it asked for."""
    heartbeat_s: float = 120.0
    """An engine, scheduler or the healer that leaves a ping unanswered this long is stuck: it is killed and replaced
    like a dead one (its requests re-sent, its prompts grown again)."""
    call_s: float = 300.0
    """Control calls: member lists, counters, a checkpoint's learner pings, loading weights into one engine."""
    generate_s: float = 1800.0
    """One engine call (a tree's segment requests); longer, and the engine is treated as stuck."""
    grow_s: float = 7200.0
    """One scheduler's shard of a batch: its trees grown, verified and healed."""
    train_step_s: float = 7200.0
    """One learner step, and exporting the weights after it."""
    checkpoint_s: float = 3600.0
    """Writing or loading one checkpoint."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value <= 0:
                raise ValueError(f"runtime.deadlines.{name} = {value}; it must be > 0")


@dataclass
class ElasticConfig:
    """The generator pool's size: runtime.num_engines is the floor, max_engines the ceiling."""

    max_engines: int = 0
    """Add engines, up to this many, whenever Ray reports room for one more (a node joined); 0 = num_engines
    (no growth past the configured size; lost engines are still replaced)."""
    poll_s: float = 0.5
    """How often the pool looks for dead engines, engines ready to join, and new room."""
    startup_timeout_s: float = 600.0
    """At start, wait this long for the first num_engines engines (the run needs at least one)."""

    def __post_init__(self) -> None:
        if self.max_engines < 0:
            raise ValueError(f"runtime.elastic.max_engines = {self.max_engines}; it must be >= 0")
        if self.poll_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("runtime.elastic.poll_s and startup_timeout_s must be > 0")


CHAOS_KINDS = ("engine", "scheduler", "verifier", "learner")


@dataclass
class ChaosConfig:
    """Deliberate faults, to rehearse recovery (off by default; `treepo-ray bench chaos` turns them on)."""

    kill_every: float = 0.0
    """Kill one actor every this many SECONDS of wall time while training runs (0 = off). Seconds, not steps: a
    kill then lands in the middle of a segment, a verification or a learner step, where it tests the recovery."""
    kill: list[str] = field(default_factory=lambda: ["engine"])
    """The kinds of actor killed, in turn: engine, scheduler, verifier, learner."""
    how: str = "alternate"
    """'ray' (ray.kill), 'signal' (SIGKILL to the actor's process) or 'alternate' (one, then the other)."""
    seed: int = 0
    """Seed of which actor of a kind is killed."""
    kill_learner_after_step: int = 0
    """SIGKILL learner rank 0 once, right after this training step is logged and checkpointed (0 = off): the run
    rebuilds the learner from the newest checkpoint and trains the steps after it again."""

    def __post_init__(self) -> None:
        if self.kill_learner_after_step < 0:
            raise ValueError(f"runtime.chaos.kill_learner_after_step = {self.kill_learner_after_step}; it must be >= 0")
        if self.kill_every < 0:
            raise ValueError(f"runtime.chaos.kill_every = {self.kill_every}; it must be >= 0")
        if self.how not in KILL_MODES:
            raise ValueError(f"runtime.chaos.how = {self.how!r}; it must be one of {KILL_MODES}")
        bad = [k for k in self.kill if k not in CHAOS_KINDS]
        if bad or not self.kill:
            raise ValueError(f"runtime.chaos.kill = {self.kill}; name one or more of {CHAOS_KINDS}")


WEIGHT_PATHS = ("auto", "broadcast", "object_store")


@dataclass
class WeightSyncConfig:
    """How each new version of the weights reaches the engines (runtime/weights.py)."""

    path: str = "auto"
    """'broadcast': learner rank 0 sends them to every engine over a process group of their own (nccl between GPUs,
    gloo on CPU); 'object_store': one object-store copy, read without a copy on each node; 'auto': broadcast when
    learner ranks and engines each hold whole GPUs and every engine loads weights in its own process (not vLLM with
    tensor_parallel_size > 1), else object_store."""
    bucket_mb: int = 512
    """A broadcast sends the weights in pieces of whole tensors of at most this many MiB (receive buffers)."""
    timeout_s: float = 300.0
    """A broadcast (rendezvous included) that takes longer fails; the pool then sends again without any engine that
    died meanwhile (with NCCL a dead peer is only noticed at this timeout)."""

    def __post_init__(self) -> None:
        if self.path not in WEIGHT_PATHS:
            raise ValueError(f"runtime.weights.path = {self.path!r}; choose one of {WEIGHT_PATHS}")
        if self.bucket_mb < 1 or self.timeout_s <= 0:
            raise ValueError("runtime.weights.bucket_mb must be >= 1 and runtime.weights.timeout_s > 0")


# ---------------------------------------------------------------------------------------------- the job


@dataclass
class ModelConfig:
    """The policy model and the engine that samples from it."""

    path: str = ""
    """A Hugging Face model directory (`~` expanded) or hub id such as Qwen/Qwen2.5-0.5B, read from the local
    Hugging Face cache (HF_HUB_CACHE) without network; empty = the tiny base model of the synthetic task (built
    once, cached)."""
    cache_dir: str = ".cache/treepo-ray"
    """Where the tiny base model and the synthetic data are cached."""
    engine: str = "hf"
    """Generation backend (treepo_ray.engines.make_engine): 'hf' or 'vllm'."""
    engine_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of the engine's constructor."""


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
    deadlines: DeadlineConfig = field(default_factory=DeadlineConfig)
    """How long each kind of call on an actor may take; heartbeats of engines, schedulers and the healer."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Generator pool size between num_engines and elastic.max_engines, following the cluster."""
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    """Deliberate engine kills, to rehearse recovery (off by default)."""
    weights: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """How new weights reach the engines: broadcast (NCCL on GPUs) or the object store."""

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
    storage_path: str = "runs"
    """Run storage, reachable from every node: a local directory (one machine), a shared mount at the same path on
    every node, or an s3:// / gs:// URI (pyarrow.fs). Holds the run directories; a relative path is resolved once,
    on the driver."""
    run_dir: str = ""
    """Run directory (metrics, trees, checkpoints, summary), a path or a URI; empty = <storage_path>/<algo>-<time>."""
    resume: str = ""
    """'' = fresh run; 'auto' = the latest checkpoint of run_dir, or (no run_dir) of the newest run in storage_path
    whose config is compatible (job/rundir.py: IDENTITY); or a checkpoint's path."""
    lock_stale_s: float = 300.0
    """A run directory's lock whose holder has not renewed it for this long (and cannot be checked: another host)
    is taken over; a holder on this host whose process exited is taken over at once."""
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
        if self.resume not in ("", "auto") and not storage.exists(storage.absolute(self.resume)):
            raise ValueError(f"trainer.resume = {self.resume!r} is neither '', 'auto' nor an existing checkpoint")
        if self.lock_stale_s <= 0:
            raise ValueError(f"trainer.lock_stale_s = {self.lock_stale_s}; it must be > 0")


@dataclass
class TrainConfig:
    """Everything `treepo-ray train` reads."""

    algo: AlgoConfig = field(default_factory=AlgoConfig)
    """Algorithm and credit assignment."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model and engine."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    custom_reward_function: RewardFunctionConfig = field(default_factory=RewardFunctionConfig)
    """Your own reward function (verl's custom_reward_function.path / .name); unset = the built-in scorers."""
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

    def __post_init__(self) -> None:
        overlong = self.algo.overlong
        if overlong.enable and not overlong.max_len:  # the buffer ends at the sampler's response limit
            overlong.max_len = self.sampler_config.response_limit()
        if overlong.enable and overlong.buffer_len > overlong.max_len:
            raise ValueError(f"algo.overlong.buffer_len = {overlong.buffer_len} exceeds the response limit "
                             f"{overlong.max_len}")

    @property
    def sampler_config(self):
        return self.rollout.sampler_config(self.algo.sampler)


@dataclass
class EvalJobConfig(TrainConfig):
    """Everything `treepo-ray eval` reads: the training job's keys (a training config file works as is) plus the
    eval section."""

    eval: EvalConfig = field(default_factory=EvalConfig)
    """What evaluation sets beyond the training job's keys (split, sampler, k, sweep, output folder)."""


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                cls: type[TrainConfig] = TrainConfig) -> TrainConfig:
    """Defaults, then the YAML file at `path`, then `key.sub=value` overrides; errors (UserError) name the file
    and key. The algorithm's own loss (LOSS_PRESETS) goes under everything given explicitly, and so does
    learner.off_policy = behaviour when runtime.max_staleness > 0. `cls`: TrainConfig,
    or EvalJobConfig for `treepo-ray eval`."""
    args = config_io.read_file_overrides(cls, path) + list(overrides or [])
    cfg = config_io.load(cls, None, args)
    preset = []
    if cfg.algo.loss_preset:
        preset = [f"learner.loss.{k}={v}" for k, v in LOSS_PRESETS[cfg.algo.name].items()]
    if cfg.runtime.max_staleness > 0:  # under the explicit keys, as the loss preset
        # Batches sampled by older weights: the PPO ratio must be to the weights that sampled them. "recompute"
        # takes it to the learner's current weights, so the staleness goes uncorrected (with one pass the ratio is
        # 1 and never clips). catpo_cpu.yaml (staleness 1), TreeRPO, 60 s, held-out from 0.40 at 5 points, two
        # runs: recompute swung between 0.14 and 0.43; behaviour rose at every point, to 0.55-0.56.
        preset.append("learner.off_policy=behaviour")
    if preset:
        cfg = config_io.load(cls, None, preset + args)
    if cfg.runtime.max_staleness > 0 and cfg.learner.off_policy == "recompute":
        warnings.warn(f"learner.off_policy = 'recompute' with runtime.max_staleness = {cfg.runtime.max_staleness}: "
                      f"batches sampled by older weights train as if on-policy (the ratio to the current weights); "
                      f"'behaviour' (the default here) or 'decoupled' correct for the staleness", stacklevel=2)
    if cfg.learner.loss.aggregation == "node-mean" and cfg.algo.name not in PER_NODE:
        raise UserError(f"learner.loss.aggregation = 'node-mean' needs per-node advantages (algo.name one of "
                        f"{PER_NODE}), not algo.name = {cfg.algo.name!r}")
    return cfg


def parse_config(argv: list[str], command: str, cls: type[TrainConfig] = TrainConfig) -> TrainConfig:
    """A command line `[config.yaml] [key.sub=value ...]` (default file: jobs/configs/cpu.yaml) as a config of
    `cls`; UserError on a missing file, a bad key or an argument that is not key=value."""
    path: Path = DEFAULT_CONFIG
    for arg in argv:
        if arg.startswith("--"):
            raise UserError(f"{arg!r}: `treepo-ray {command}` takes a config file and key=value overrides, not "
                            f"--flags (e.g. model.path=DIR trainer.eval_samples=8; `treepo-ray {command} --help`)")
    if argv and "=" not in argv[0]:
        path, argv = Path(argv[0]), argv[1:]
    for arg in argv:
        if "=" not in arg:
            raise UserError(f"{arg!r} is not a key=value override (usage: treepo-ray {command} [config.yaml] "
                            f"[key.sub=value ...])")
    return load_config(path, argv, cls)


def print_config(cfg: TrainConfig) -> None:
    """The resolved config (defaults, file and overrides applied), as the command will use it."""
    print("resolved config:\n" + yaml.safe_dump(config_io.to_dict(cfg), sort_keys=False), flush=True)
