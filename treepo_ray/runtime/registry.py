"""The run's control plane: a small actor that imports nothing heavy (no torch), placed on the driver's node so that
it fails only with the driver.

    RuntimeRegistry   the generator pool's current members (every engine router catches up from it) and the journal
                      of fault events, drained into each step's `fault/*` metrics
    record            how an event is journaled, from any process: its reason printed where it happened, and the
                      call waited for, so an event is in the journal before the work it belongs to returns (a drain
                      after that work counts it: the counts do not depend on timing)
"""

from __future__ import annotations

import time

import ray

from treepo_ray.job.faults import report
from treepo_ray.runtime.liveness import get, within

QUIET = ("resent_requests", "verifier_retries", "regrown_prompts", "reward_error", "reward_timeout", "reward_nonfinite",
         "reward_verifier")
"""Events counted, not printed (their cause is printed once, as its own event)."""


@ray.remote(num_cpus=0)
class RuntimeRegistry:
    """The run's membership list and fault journal. Small, stateless about trees, called rarely."""

    def __init__(self):
        self._epoch, self._members = 0, []
        self._events: list[tuple[float, str, str, int]] = []

    # The member list travels as [ObjectRef of {id: engine actor}]: a ref nested in a list is passed on as a ref, so
    # this process never deserialises engine handles (which would import the engine's module, torch and all).
    def set_engines(self, epoch: int, members: list) -> None:
        if epoch > self._epoch:  # calls from the one driver arrive in order; the guard keeps it so
            self._epoch, self._members = epoch, list(members)

    def engines_since(self, epoch: int):
        """(epoch, [ObjectRef of {id: engine}]) if the members changed after `epoch`, else None."""
        return None if epoch >= self._epoch else (self._epoch, self._members)

    def record(self, kind: str, detail: str = "", count: int = 1) -> None:
        self._events.append((time.time(), kind, detail, int(count)))

    def drain(self) -> list[tuple[float, str, str, int]]:
        out, self._events = self._events, []
        return out


def record(registry, kind: str, detail: str, timeout_s: float, count: int = 1) -> None:
    """Journal a fault event (blocking; for the driver's threads and threaded actors)."""
    if kind not in QUIET:
        report(detail)
    get(registry.record.remote(kind, detail, count), timeout_s, "the run's registry")


async def record_async(registry, kind: str, detail: str, timeout_s: float, count: int = 1) -> None:
    """`record`, awaited (async actors)."""
    if kind not in QUIET:
        report(detail)
    await within(registry.record.remote(kind, detail, count), timeout_s, "the run's registry")


def event_metrics(events: list[tuple[float, str, str, int]]) -> dict[str, float]:
    """`fault/<kind>` totals of drained journal events."""
    out: dict[str, float] = {}
    for _, kind, _, count in events:
        out[f"fault/{kind}"] = out.get(f"fault/{kind}", 0.0) + count
    return out
