"""Samples and helpers shared by the learner tests: uneven lengths, per-token and scalar advantages, tree weights and
one sample with given old log-probs, so every part of the loss scaling is exercised."""

from treepo_ray.learner import TrainSample

# Uneven shards: rank 0 runs two micro-batches, rank 1 one real and one zero-weighted dummy pass.
SHARDS = (slice(0, 3), slice(3, 5))


def samples() -> list[TrainSample]:
    return [
        TrainSample([5, 6, 7], [8, 9, 10, 11], advantages=1.0),
        TrainSample([12], [13, 14], advantages=-1.0, weight=0.5, old_logprobs=[-5.0, -6.5]),
        TrainSample([20, 21, 22, 23, 24], [25], advantages=0.5),
        TrainSample([30, 31], [32, 33, 34, 35, 36, 37], advantages=[1.0, -1.0, 0.5, 0.0, 2.0, -0.5]),
        TrainSample([40, 41, 42], [43, 44, 45], advantages=-0.75, weight=2.0),
    ]


def params(learner) -> dict:
    """A copy of the learner's trainable parameters by name."""
    return {k: v.detach().clone() for k, v in learner.model.named_parameters()}
