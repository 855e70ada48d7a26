"""The learner's learning-rate schedule: linear warmup over the first training steps, then constant (verl's
`lr_warmup_steps` with its default constant schedule, which the official TreePO and DAPO scripts use: 10 warmup
steps). verl steps its scheduler once per training step, so every optimizer step of one training step (ppo_epochs x
mini_batches, 16 in the paper configs) shares that step's rate (learner.py: train_step)."""

from __future__ import annotations


def lr_at(lr: float, warmup_steps: int, step: int) -> float:
    """Learning rate of training step `step` (0-based): lr * (step + 1) / warmup_steps during the warmup, then lr.

    The first step already moves (verl's LambdaLR starts at 0, which wastes one step)."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
