"""Per-group gradient norms (CATPO's H1 check): each group's own loss gradient, no step, no leakage between groups."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.algo.losses import LossConfig
from treepo_ray.learner import Learner, LearnerConfig, TrainSample

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                      max_positions=64)


def learner(model_path):
    # Pure policy gradient: no KL, no entropy term, so a zero-advantage group has a zero gradient.
    return Learner(model_path, LearnerConfig(micro_batch_size=2, loss=LossConfig(kl_coef=0.0, entropy_coef=0.0)))


MIXED = [TrainSample([5, 6], [7, 8, 9], advantages=1.0), TrainSample([5, 6], [10, 11], advantages=-1.0),
         TrainSample([5, 6], [12], advantages=[0.5])]
DEAD = [TrainSample([20, 21], [22, 23], advantages=0.0), TrainSample([20, 21], [24], advantages=0.0)]


def hand_norm(model_path, samples):
    """token-mean of -A * log p over the group's response tokens, differentiated by autograd on the HF model."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    total, tokens = 0.0, sum(len(s.response_ids) for s in samples)
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        log_p = model(input_ids=ids).logits[0].log_softmax(-1)
        adv = s.advantages if isinstance(s.advantages, list) else [s.advantages] * len(s.response_ids)
        p = len(s.prompt_ids)
        for j, tok in enumerate(s.response_ids):
            total = total - adv[j] * s.weight * log_p[p - 1 + j, tok]
    (total / tokens).backward()
    return float(torch.sqrt(sum((q.grad ** 2).sum() for q in model.parameters() if q.grad is not None)))


def test_group_norms_match_autograd_by_hand_and_leave_the_model_untouched(model_path):
    lrn = learner(model_path)
    before = {k: v.detach().clone() for k, v in lrn.model.named_parameters()}
    norms = lrn.per_group_grad_norms([MIXED, DEAD])
    assert norms[0] == pytest.approx(hand_norm(model_path, MIXED), rel=1e-4) and norms[0] > 0
    assert norms[1] == 0.0  # all advantages zero: nothing to learn from this tree
    assert lrn.optimizer_steps == 0 and all(p.grad is None for p in lrn.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in lrn.model.named_parameters())
    # Groups do not leak into each other: order does not matter.
    assert lrn.per_group_grad_norms([DEAD, MIXED]) == pytest.approx([norms[1], norms[0]], rel=1e-6)


def test_norm_scales_with_the_tree_weight(model_path):
    lrn = learner(model_path)
    weighted = [TrainSample(s.prompt_ids, s.response_ids, s.advantages, weight=3.0) for s in MIXED]
    base, tripled = lrn.per_group_grad_norms([MIXED, weighted])
    assert tripled == pytest.approx(3 * base, rel=1e-5)


def test_empty_group_is_refused(model_path):
    with pytest.raises(ValueError, match=r"groups\[1\] is empty"):
        learner(model_path).per_group_grad_norms([MIXED, []])
