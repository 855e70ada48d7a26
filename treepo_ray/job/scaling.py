"""The generator pool's scaling policy: how many engines a run should hold, from what each training step measured.

    up     the learner waited for its batch (at least elastic.scale_up_wait of the step) and no grown batch was
           waiting: rollout is the bottleneck, so one more engine, up to elastic.max_engines
    down   the learner hardly waited (at most elastic.scale_down_wait) and rollout is ahead of it (every slot of the
           queue held a grown batch), or the engines were idle (busy under elastic.idle_busy): one engine fewer, down
           to runtime.num_engines

The first runtime.max_staleness + 1 steps are not measured: their learner waits for the pipeline to fill.
Hysteresis: the two thresholds are apart, a signal must hold elastic.patience steps in a row, and no decision
follows another within elastic.cooldown_s (a node takes that long to join or go). No engine is added while
engines asked for have not joined (the pool is still short of its target: the nodes are coming, or there are
none). Plain logic, fed numbers: the runtime's pool (runtime/pool.py) carries out what it decides.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepMeasure:
    """What one training step measured."""

    wait_share: float
    """The learner's wait for its batch, as a share of the step's wall time."""
    queued: int
    """Grown batches waiting in the queue when the learner took its batch (at most runtime.max_staleness)."""
    busy_share: float | None = None
    """The engines' busy time over the step, as a share of (engines x step); None when not measured."""


@dataclass(frozen=True)
class Decision:
    target: int
    reason: str

    def line(self, before: int) -> str:
        return f"pool: target {before} -> {self.target} engines ({self.reason})"


class ScalingPolicy:
    """The target size of the pool between `floor` and `ceiling` (module docstring); `elastic` is
    runtime.elastic, `max_staleness` runtime.max_staleness (the queue holds that many batches ahead at most)."""

    def __init__(self, floor: int, ceiling: int, elastic, max_staleness: int, warmup: int | None = None):
        self.floor, self.ceiling, self.cfg = floor, max(ceiling, floor), elastic
        self.full_queue = max(max_staleness, 1)
        # The first max_staleness + 1 steps wait for the pipeline to fill (every batch starts growing then): that
        # wait says nothing about the pool's size, so they are not measured.
        self.warmup = max_staleness + 1 if warmup is None else warmup
        self._seen = 0
        self.target = floor
        self.scale_ups = self.scale_downs = 0
        self._ups = self._downs = 0  # steps in a row showing each signal
        self._last_change = float("-inf")

    def observe(self, m: StepMeasure, now: float, joined: bool = True) -> Decision | None:
        """One step's measure at time `now` (seconds, any monotonic clock); `joined`: every engine of the target is
        in the pool. A decision when the target changes, else None."""
        cfg = self.cfg
        self._seen += 1
        if self._seen <= self.warmup:
            return None
        idle = m.busy_share is not None and m.busy_share < cfg.idle_busy
        starved = m.wait_share >= cfg.scale_up_wait and m.queued == 0 and not idle
        ahead = m.wait_share <= cfg.scale_down_wait and (m.queued >= self.full_queue or idle)
        self._ups = self._ups + 1 if starved else 0
        self._downs = self._downs + 1 if ahead else 0
        if now - self._last_change < cfg.cooldown_s:
            return None
        busy = "" if m.busy_share is None else f", engines busy {m.busy_share:.0%}"
        if self._ups >= cfg.patience and self.target < self.ceiling and joined:
            why = (f"the learner waited {m.wait_share:.0%} of each of {self._ups} steps for a batch, none "
                   f"waiting{busy}")
            self.scale_ups += 1
            return self._change(self.target + 1, why, now)
        if self._downs >= cfg.patience and self.target > self.floor:
            ahead_by = f"{m.queued} batches waiting" if m.queued >= self.full_queue else "engines idle"
            why = f"the learner waited {m.wait_share:.0%} of each of {self._downs} steps, {ahead_by}{busy}"
            self.scale_downs += 1
            return self._change(self.target - 1, why, now)
        return None

    def _change(self, target: int, reason: str, now: float) -> Decision:
        self.target, self._last_change = target, now
        self._ups = self._downs = 0
        return Decision(target, reason)
