"""How a run ends when something fails that it cannot recover from, and how faults are reported on the way."""

from __future__ import annotations

import sys


class RunStopped(RuntimeError):
    """The run cannot go on (an actor lost past its recovery, a deadline passed, the verifiers broken): the message
    is one line saying what and why, which `treepo-ray` prints instead of a traceback."""


class LearnerLost(RunStopped):
    """A learner rank was lost, or stopped answering within its deadline: the trainer rebuilds the learner from the
    newest checkpoint (runtime.faults.max_learner_restarts times), else the run stops with this line."""


def report(message: str) -> None:
    """A fault's reason, on the console of the process that saw it (Ray forwards actors' stderr to the driver)."""
    print(f"[treepo-ray fault] {message}", file=sys.stderr, flush=True)
