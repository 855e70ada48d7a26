"""Configuration of fault tolerance, the elastic generator pool and chaos testing (`runtime.faults`,
`runtime.elastic`, `runtime.chaos`). No Ray here: the config loads without starting anything."""

from __future__ import annotations

from dataclasses import dataclass

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

    def __post_init__(self) -> None:
        for name in ("max_learner_restarts", "max_resends", "verifier_retries"):
            if getattr(self, name) < 0:
                raise ValueError(f"runtime.faults.{name} = {getattr(self, name)}; it must be >= 0")
        for name in ("engine_wait_s", "verifier_call_timeout_s", "learner_ping_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"runtime.faults.{name} = {getattr(self, name)}; it must be > 0")


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


@dataclass
class ChaosConfig:
    """Deliberate faults, to rehearse recovery by hand (off by default)."""

    kill_generator_every: float = 0.0
    """Kill one live engine actor every this many SECONDS of wall time while training runs (0 = off). Seconds, not
    steps: a kill then lands in the middle of a segment, where it tests the re-sending, not between batches."""
    how: str = "alternate"
    """'ray' (ray.kill), 'signal' (SIGKILL to the actor's process) or 'alternate' (one, then the other)."""
    seed: int = 0
    """Seed of which engine is killed."""
    kill_learner_after_step: int = 0
    """SIGKILL learner rank 0 once, right after this training step is logged and checkpointed (0 = off): the run
    rebuilds the learner from the newest checkpoint and trains the steps after it again."""

    def __post_init__(self) -> None:
        if self.kill_learner_after_step < 0:
            raise ValueError(f"runtime.chaos.kill_learner_after_step = {self.kill_learner_after_step}; it must be >= 0")
        if self.kill_generator_every < 0:
            raise ValueError(f"runtime.chaos.kill_generator_every = {self.kill_generator_every}; it must be >= 0")
        if self.how not in KILL_MODES:
            raise ValueError(f"runtime.chaos.how = {self.how!r}; it must be one of {KILL_MODES}")
