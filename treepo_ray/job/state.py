"""The trainer's own state: where the run stands, saved with every checkpoint and restored on resume."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class TrainerState:
    """What a resumed run needs besides the learner's weights and optimizer (saved as JSON in the checkpoint)."""

    step: int = 0
    """Training steps done (the learner's weights version)."""
    data_position: int = 0
    """Prompts of the training stream consumed by those steps."""
    elapsed_s: float = 0.0
    """Wall time of the training loop so far, over every invocation."""
    trajectories: int = 0
    """Trajectories trained on so far."""
    base_eval: dict | None = None
    """The base model's held-out evaluation (None until it has run; {} when there is no held-out set)."""
    seed: int = 0
    """trainer.seed of the run."""
    pending: str | None = None
    """The file (in the run directory) of the batches that waited in the staleness queue at this checkpoint: a
    resumed run trains them first (job/rundir.py); None when none waited."""

    def to_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict) -> "TrainerState":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
