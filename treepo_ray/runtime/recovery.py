"""Recovery: the training loop that survives a lost learner (the job's entry into the pipeline), what it needs to
rebuild one, checkpoint write errors, and the chaos option that rehearses it all by killing actors on purpose.

    train_with_recovery   pipe.train(...) wrapped: a lost learner group is rebuilt from the newest checkpoint (in
                          run storage, so on any node), the batches that waited in the queue at that checkpoint
                          trained first, the prompt stream rewound to where they end, and training goes on
    LearnerWatch          one lost rank takes its whole group down (its peers would hang in a collective)
    save_checkpoint_or_report
                          a failed checkpoint write (full disk) is logged and training goes on
    ChaosMonkey           kills an engine, a scheduler, a verifier or a learner rank every N seconds, in turn
                          (runtime.chaos), by ray.kill or SIGKILL

Engine losses are handled by the generator pool itself (pool.py), scheduler and healer losses by the pipeline
(pipeline.py: grow), verifier losses by the verifier front (verifier.py).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError

from treepo_ray.data.prompts import PromptStream
from treepo_ray.job.rundir import load_pending
from treepo_ray.job.state import TrainerState
from treepo_ray.learner import latest_checkpoint
from treepo_ray.runtime.liveness import DeadlineExceeded, get
from treepo_ray.runtime.registry import actor_lost, brief, ping, report


# ---------------------------------------------------------------------------------------------- the learner


def learner_lost(group, timeout_s: float = 30.0) -> bool:
    """Whether a rank of the learner group is dead, or stuck (does not answer a ping within `timeout_s`; a rank
    whose peer died waits in a collective forever)."""
    try:
        get([ping(r) for r in group.ranks], timeout_s, "learner ranks")
    except DeadlineExceeded:
        return True
    except RayActorError as err:
        return actor_lost(err)
    return False


class BackgroundLoop:
    """A daemon thread that runs `self._run` until `stop()` sets `self._stop`."""

    def __init__(self, name: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _run(self) -> None:
        raise NotImplementedError

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


class LearnerWatch(BackgroundLoop):
    """Takes the whole learner group down when one of its ranks dies. The other ranks would wait in a collective
    for the dead one for the process group's timeout (many minutes) while the driver waits on rank 0; with every rank
    killed, the driver's call fails at once and train_with_recovery rebuilds the group. A thread pings each rank
    (a ping queues behind a running step, so a busy rank is not mistaken for a dead one)."""

    def __init__(self, get_group, registry, poll_s: float = 1.0):
        self.get_group, self.registry, self.poll_s = get_group, registry, poll_s
        self.takedowns = 0
        super().__init__("learner-watch")

    def _run(self) -> None:
        pings: dict[int, object] = {}
        taken_down = None
        while not self._stop.wait(self.poll_s):
            group = self.get_group()
            if len(group.ranks) < 2 or group is taken_down:
                continue  # one rank: its own call fails when it dies
            try:
                for i, rank in enumerate(group.ranks):
                    pings.setdefault(i, ping(rank))
                done, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=0)
                dead = []
                for i, ref in list(pings.items()):
                    if ref in done:
                        del pings[i]
                        try:
                            ray.get(ref)
                        except RayActorError as err:
                            if actor_lost(err):
                                dead.append(i)
                if dead:
                    for rank in group.ranks:
                        ray.kill(rank)
                    taken_down, pings = group, {}
                    self.takedowns += 1
                    msg = f"learner rank(s) {dead} lost: the group of {len(group.ranks)} ranks is taken down"
                    report(msg)
                    self.registry.record.remote("learner_takedowns", msg)
            except Exception as err:  # noqa: BLE001 - a monitoring hiccup must not end the run
                report(f"learner watch: {type(err).__name__}: {err}")


def resume_point(pipe, run_dir: str | None, state: TrainerState) -> tuple[list, int]:
    """(the batches that waited in the queue at the checkpoint of `state`, ready to train; the prompt stream's
    position after them)."""
    queued = [pipe.batch_from_record(r) for r in load_pending(run_dir, state.pending)] if state.pending else []
    return queued, (queued[-1].data_position if queued else state.data_position)


def restore_learner(pipe, run_dir: str | Path | None) -> TrainerState:
    """Replace a lost learner group: kill what is left of it, build a new one, load the newest complete checkpoint of
    `run_dir` (the base weights when there is none; run storage, so the new ranks may be on another node), and bring
    the engines to exactly those weights. Returns the trainer state to continue from."""
    for rank in pipe.learner.ranks:
        ray.kill(rank)
    pipe.pool.pause_growth()  # the room the dead learner left is for its replacement, not for an engine
    try:
        pipe.learner = pipe.build_learner()
    finally:
        pipe.pool.resume_growth()
    ckpt = latest_checkpoint(str(run_dir)) if run_dir else None
    state = TrainerState.from_dict(pipe.learner.load_checkpoint(str(ckpt))) if ckpt is not None else TrainerState()
    pipe.learner.publish(state.step)
    # The engines may run weights of steps the lost learner trained after the checkpoint: reload, even if "older".
    pipe.sync_weights(state.step, force=True)
    return state


def train_with_recovery(pipe, start: int, end: int, stream: PromptStream, on_step, run_dir: str | Path | None,
                        on_restart=None, queued: list = (), **train_kwargs) -> int:
    """`pipe.train(start, end, stream, on_step, queued=queued, ...)` that survives a lost learner: the group is
    rebuilt from the newest checkpoint of `run_dir`, the batches that waited in the queue at that checkpoint are
    trained first and the prompt stream rewound to where they end, and training goes on from the checkpoint's step,
    at most runtime.faults.max_learner_restarts times. Steps the lost learner trained after its checkpoint are
    trained again from that checkpoint, so each step of the final weights' history is trained once;
    `on_restart(state, error, steps_redone)` lets the caller log the rewind honestly.
    Runs runtime.chaos while training. Returns the number of steps completed."""
    faults, chaos_cfg = pipe.cfg.runtime.faults, pipe.cfg.runtime.chaos
    chaos = ChaosMonkey(pipe, chaos_cfg).start() if chaos_cfg.kill_every > 0 else None
    watch = LearnerWatch(lambda: pipe.learner, pipe.pool.registry).start()
    restarts, reached, learner_killed = 0, [start], [False]

    def counting(batch, metrics) -> bool:
        reached[0] = batch.step + 1
        go_on = on_step(batch, metrics)
        if reached[0] == chaos_cfg.kill_learner_after_step and not learner_killed[0]:
            learner_killed[0] = True
            done = kill_actor(pipe.learner.ranks[0], "signal")
            pipe.pool.registry.record.remote("chaos_kills_learner", f"chaos killed learner rank 0 ({done})")
        return go_on

    try:
        while True:
            try:
                return pipe.train(start, end, stream, counting, queued=queued, **train_kwargs)
            except Exception as err:  # noqa: BLE001 - re-raised below unless the learner is what was lost
                if not learner_lost(pipe.learner, faults.learner_ping_s):
                    raise
                while True:  # the new learner can be lost while it is being restored, too
                    if restarts >= faults.max_learner_restarts:
                        raise err
                    restarts += 1
                    report(f"learner lost after step {reached[0]} ({brief(err)}); restart {restarts} of "
                           f"{faults.max_learner_restarts}")
                    try:
                        state = restore_learner(pipe, run_dir)
                        break
                    except Exception as again:  # noqa: BLE001
                        if not learner_lost(pipe.learner, faults.learner_ping_s):
                            raise
                        err = again  # noqa: PLW2901 - the newest loss is the one to report
                queued, position = resume_point(pipe, str(run_dir) if run_dir else None, state)
                start = state.step
                redone, reached[0] = reached[0] - start, start
                msg = (f"learner rebuilt from the checkpoint of step {start} (data position "
                       f"{state.data_position}); the {redone} steps trained after it are trained again")
                report(msg)
                pipe.pool.registry.record.remote("learner_restarts", msg)
                if on_restart is not None:
                    on_restart(state, err, redone)
                # The same prompts in the same order as before the loss, from the checkpoint's position on.
                stream = stream.rewound(position)
    finally:
        watch.stop()
        if chaos is not None:
            chaos.stop()


def save_checkpoint_or_report(group, directory: str | Path, trainer_state: dict) -> str | None:
    """Save a checkpoint; on a write failure (full disk, ...) log it and return the message instead of raising, so
    training goes on (the learner writes atomically: the previous checkpoint stays whole). A lost learner is
    raised, for train_with_recovery."""
    try:
        group.save_checkpoint(str(directory), trainer_state)
    except Exception as err:  # noqa: BLE001
        if isinstance(err, RayActorError) and actor_lost(err):
            raise
        msg = f"checkpoint {str(directory).rstrip('/').rsplit('/', 1)[-1]} not written, training goes on: {err}"
        report(msg)
        return msg
    return None


# ---------------------------------------------------------------------------------------------- chaos


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


class ChaosMonkey(BackgroundLoop):
    """Kills one actor every `cfg.kill_every` seconds (wall time), the kinds of `cfg.kill` in turn (engine,
    scheduler, verifier, learner rank), to rehearse recovery. Only engines that have joined the pool are victims,
    so with one engine each replacement serves before the next kill. `kills` counts the kills per kind, and each
    kill is journaled as fault/chaos_kills_<kind>."""

    def __init__(self, pipe, cfg):
        self.pipe, self.cfg = pipe, cfg
        self.kills = {kind: 0 for kind in cfg.kill}
        self._rng = np.random.default_rng(cfg.seed)
        super().__init__("chaos")

    def victims(self, kind: str) -> list:
        pipe = self.pipe
        return {"engine": pipe.pool.engines, "scheduler": lambda: list(pipe.schedulers),
                "verifier": lambda: list(pipe.verifiers.verifiers), "learner": lambda: list(pipe.learner.ranks)}[kind]()

    def _run(self) -> None:
        turn = 0
        while not self._stop.wait(self.cfg.kill_every):
            kind = self.cfg.kill[turn % len(self.cfg.kill)]
            turn += 1  # the next kind next time, even if this one is found dead already (being replaced)
            victims = self.victims(kind)
            if not victims:
                continue
            done_so_far = sum(self.kills.values())
            how = self.cfg.how if self.cfg.how != "alternate" else ("ray", "signal")[done_so_far % 2]
            victim = victims[int(self._rng.integers(len(victims)))]
            try:
                done = kill_actor(victim, how)
            except Exception as err:  # noqa: BLE001 - it died some other way meanwhile
                report(f"chaos: could not kill a {kind}: {brief(err)}")
                continue
            self.kills[kind] += 1
            self.pipe.pool.registry.record.remote(f"chaos_kills_{kind}", f"chaos killed a {kind} ({done})")
