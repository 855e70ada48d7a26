"""The learning-rate warmup: the schedule itself, and the learner following it step by step."""

import pytest

from treepo_ray.learner.schedule import lr_at


def test_linear_warmup_then_constant():
    assert [lr_at(1e-3, 4, s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert [lr_at(1e-3, 0, s) for s in range(3)] == [1e-3] * 3  # no warmup


@pytest.mark.slow
def test_learner_warms_up_per_optimizer_step(tiny):
    from treepo_ray.learner import Learner, LearnerConfig, TrainSample

    learner = Learner(tiny, LearnerConfig(lr=1e-3, lr_warmup_steps=4, mini_batches=2, micro_batch_size=2,
                                          weight_decay=0.1))
    batch = [TrainSample([5, 6, 7], [8, 9, 10], advantages=1.0), TrainSample([40, 41], [50, 51], advantages=-1.0)]
    # Two mini-batches per train_step: optimizer steps 0 and 1, then 2 and 3, then 4 and 5.
    assert [learner.train_step(batch)["lr"] for _ in range(3)] == pytest.approx([5e-4, 1e-3, 1e-3])
    assert learner.optimizer.param_groups[0]["weight_decay"] == 0.1
