"""Chaos: actors killed on purpose while training runs (runtime.chaos; `treepo-ray bench chaos`), to rehearse the
recovery of every kind: an engine, a scheduler, a verifier or a learner rank every N seconds, in turn, by ray.kill
or SIGKILL of the actor's process; and learner rank 0 once, right after a given step is logged and checkpointed."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import ray
from ray.exceptions import GetTimeoutError

from treepo_ray.job.faults import report
from treepo_ray.runtime.liveness import brief


def _pid_and_node(_actor) -> tuple[int, str]:
    return os.getpid(), ray.get_runtime_context().get_node_id()


def _kill_self(_actor) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_actor(actor, how: str) -> str:
    """Kill `actor` as a crash would: ray.kill ('ray'; an actor Ray restarts in place, a verifier, is restarted) or
    SIGKILL of its process ('signal'; from here when it runs on this node, else by itself; an actor too busy to
    say its pid within 5 s, a sync actor in a long call, gets ray.kill). Returns how it was done."""
    if how == "ray":
        ray.kill(actor, no_restart=False)
        return "ray.kill"
    try:
        pid, node = ray.get(actor.__ray_call__.remote(_pid_and_node), timeout=5)
    except GetTimeoutError:
        ray.kill(actor, no_restart=False)
        return "ray.kill (busy)"
    if node == ray.get_runtime_context().get_node_id():
        os.kill(pid, signal.SIGKILL)
    else:
        actor.__ray_call__.remote(_kill_self)
    return f"SIGKILL pid {pid}"


class ChaosMonkey:
    """Kills one actor every `cfg.kill_every` seconds (wall time), the kinds of `cfg.kill` in turn (engine,
    scheduler, verifier, learner rank) among the supervisor's live ones, so with one engine each replacement serves
    before the next kill. `kills` counts the kills per kind; each is journaled as fault/chaos_kills_<kind>."""

    def __init__(self, supervisor, cfg):
        self.supervisor, self.cfg = supervisor, cfg
        self.kills = {kind: 0 for kind in cfg.kill}
        self._rng = np.random.default_rng(cfg.seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        turn = 0
        while not self._stop.wait(self.cfg.kill_every):
            kind = self.cfg.kill[turn % len(self.cfg.kill)]
            turn += 1  # the next kind next time, even if this one is found dead already (being replaced)
            victims = self.supervisor.victims(kind)
            if not victims:
                continue
            done_so_far = sum(self.kills.values())
            how = self.cfg.how if self.cfg.how != "alternate" else ("ray", "signal")[done_so_far % 2]
            victim = victims[int(self._rng.integers(len(victims)))]
            try:
                done = kill_actor(victim, how)
                self.kills[kind] += 1
                self.supervisor.journal(f"chaos_kills_{kind}", f"chaos killed a {kind} ({done})")
            except Exception as err:  # noqa: BLE001 - it died some other way meanwhile
                report(f"chaos: could not kill a {kind}: {brief(err)}")
