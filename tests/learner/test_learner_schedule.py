"""The learning-rate warmup: the schedule itself, and the learner following it step by step."""

import pytest

from treepo_ray.learner.schedule import lr_at


def test_linear_warmup_then_constant():
    assert [lr_at(1e-3, 4, s) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
    assert [lr_at(1e-3, 0, s) for s in range(3)] == [1e-3] * 3  # no warmup


@pytest.mark.slow
def test_learner_warms_up_per_training_step(tiny):
    from treepo_ray.learner import Learner, LearnerConfig, TrainSample

    learner = Learner(tiny, LearnerConfig(lr=1e-3, lr_warmup_steps=4, mini_batches=2, micro_batch_size=2,
                                          weight_decay=0.1))
    batch = [TrainSample([5, 6, 7], [8, 9, 10], advantages=1.0), TrainSample([40, 41], [50, 51], advantages=-1.0)]
    # Two optimizer steps per train_step, both at that training step's rate (verl steps its scheduler per step).
    assert [learner.train_step(batch)["lr"] for _ in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert learner.optimizer_steps == 10
    assert learner.optimizer.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.slow
def test_sixteen_optimizer_steps_per_training_step_do_not_end_the_warmup(tiny):
    from treepo_ray.learner import Learner, LearnerConfig, TrainSample

    # The paper configs: mini_batches 16, lr_warmup_steps 10 (here 4): counted per optimizer step, the warmup ended
    # inside the first training step.
    learner = Learner(tiny, LearnerConfig(lr=1e-3, lr_warmup_steps=4, mini_batches=16, micro_batch_size=1))
    batch = [TrainSample([5 + k, 6], [8, 9 + k], advantages=1.0 if k % 2 else -1.0) for k in range(16)]
    learner.train_step(batch)
    second = learner.train_step(batch)
    assert learner.optimizer_steps == 32
    assert second["lr"] == pytest.approx(5e-4) and learner.optimizer.param_groups[0]["lr"] < 1e-3
