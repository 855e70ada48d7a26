"""The run's control plane: a small actor that imports nothing heavy (no torch), placed on the driver's node so that
it fails only with the driver, and the helpers every actor module shares (placement, telling a lost actor from
other errors, fault reports).

    RuntimeRegistry   the generator pool's current members (each scheduler's routing table catches up from it)
                      and a journal of fault events, drained into each step's `fault/*` metrics
"""

from __future__ import annotations

import sys
import time

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def on_this_node() -> NodeAffinitySchedulingStrategy:
    """Scheduling strategy that places an actor on the caller's node (the driver's: same failure domain)."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def actor_lost(err: BaseException) -> bool:
    """True when `err` says the called actor itself died. A task whose *argument* came from a dead actor fails
    with RayTaskError(ActorDiedError), which is also a RayActorError but says nothing about the callee."""
    return isinstance(err, RayActorError) and not isinstance(err, RayTaskError)


def _ping(_actor) -> bool:
    return True


def ping(actor):
    """ObjectRef that resolves once `actor` runs a trivial call (fails if it is dead); no method needed."""
    return actor.__ray_call__.remote(_ping)


def actor_id(actor) -> str:
    return actor._actor_id.hex()


# ---------------------------------------------------------------------------------------------- registry


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


def event_metrics(events: list[tuple[float, str, str, int]]) -> dict[str, float]:
    """`fault/<kind>` totals of drained journal events."""
    out: dict[str, float] = {}
    for _, kind, _, count in events:
        out[f"fault/{kind}"] = out.get(f"fault/{kind}", 0.0) + count
    return out


def brief(err: BaseException) -> str:
    """An error as one line: its type and the first line of its message (Ray's carry pages of context)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def report(message: str) -> None:
    """A fault's reason, on the console of the process that saw it (Ray forwards actors' stderr to the driver)."""
    print(f"[treepo-ray fault] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- verification
