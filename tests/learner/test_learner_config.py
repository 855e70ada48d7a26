"""LearnerConfig's checks and defaults (no model)."""

import pytest

from treepo_ray.algo.losses import LossConfig
from treepo_ray.learner import LearnerConfig


def test_config_checks_and_ref_model_default():
    assert not LearnerConfig().needs_ref_model
    assert LearnerConfig(loss=LossConfig(kl_coef=0.1)).needs_ref_model
    assert LearnerConfig(use_ref_model=True).needs_ref_model
    with pytest.raises(ValueError, match="use_ref_model = False"):
        LearnerConfig(use_ref_model=False, loss=LossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="strategy"):
        LearnerConfig(strategy="ddp")
    with pytest.raises(ValueError, match="micro_batch_size"):
        LearnerConfig(micro_batch_size=0)
    with pytest.raises(ValueError, match="betas"):
        LearnerConfig(betas=[0.9])
