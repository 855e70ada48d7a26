"""DAPO's overlong reward buffer and the TreePO ablation keys, hand-computed (no Ray, no model)."""

import pytest

from treepo_ray.algo.overlong import OverlongConfig, overlong_penalty, with_overlong_penalty
from treepo_ray.algo import AlgoConfig
from treepo_ray.algo.treepo import TreePOCreditConfig
from treepo_ray.job.config import load_config
from treepo_ray.tree import Tree


def chains(rewards, lengths):
    t = Tree(prompt_ids=[1, 2], query_id="s")
    for n in lengths:
        t.trajectories.append(t.add_node(0, [5] * n, [-1.0] * n))
    t.set_trajectory_rewards(rewards)
    return t


def test_penalty_is_zero_then_linear_in_the_buffer():
    # limit 100, buffer 20: nothing up to 80 tokens, -1/20 per token after, -1.0 at the limit.
    assert [overlong_penalty(n, 100, 20, 1.0) for n in (10, 80, 90, 100)] == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(90, 100, 20, 0.5) == -0.25


def test_shaped_rewards_change_the_advantages_not_the_trees():
    t = chains([1.0, 1.0, 0.0, 0.0], [10, 100, 10, 100])
    (shaped,) = with_overlong_penalty([t], OverlongConfig(enable=True, buffer_len=20, max_len=100))
    assert [shaped.reward[n] for n in shaped.trajectories] == [1.0, 0.0, 0.0, -1.0]
    assert [t.reward[n] for n in t.trajectories] == [1.0, 1.0, 0.0, 0.0]  # the caller's tree is untouched
    plain = AlgoConfig(name="grpo").advantages([t])[0]
    algo = AlgoConfig(name="grpo", overlong=OverlongConfig(enable=True, buffer_len=20, max_len=100))
    # shaped rewards [1, 0, 0, -1]: mean 0, population std sqrt(1/2)
    assert algo.advantages([t])[0] == pytest.approx([2**0.5, 0, 0, -(2**0.5)], abs=1e-4)
    assert plain == pytest.approx([1, 1, -1, -1], abs=1e-5)
    with pytest.raises(ValueError, match="max_len"):
        with_overlong_penalty([t], OverlongConfig(enable=True))


def test_job_config_fills_the_buffer_end_from_the_sampler():
    cfg = load_config(None, ["algo.overlong.enable=true", "algo.overlong.buffer_len=16",
                             "rollout.treepo.max_depth=4", "rollout.treepo.segment_len=32"])
    assert cfg.algo.overlong.max_len == 128
    with pytest.raises(ValueError, match="buffer_len"):
        load_config(None, ["algo.overlong.enable=true", "rollout.treepo.max_depth=4",
                           "rollout.treepo.segment_len=32"])  # a 512-token buffer in a 128-token response


def two_level(rewards):
    """root -> A, B; A -> a1, a2; B -> b1, b2."""
    t = Tree(prompt_ids=[7, 8], query_id="q")
    for parent in (0, 0, 1, 1, 2, 2):
        t.add_node(parent, [parent + 10] * 2, [-0.5] * 2)
    t.trajectories = [3, 4, 5, 6]
    t.set_trajectory_rewards(rewards)
    return t


def test_treepo_ablation_keys():
    t = two_level([1.0, 0.0, 0.0, 0.0])
    scores = lambda **kw: AlgoConfig(name="treepo", treepo=TreePOCreditConfig(whiten_by_tokens=False, **kw)).advantages([t])[0]  # noqa: E731
    # Levels (root 0.25, A 0.5, B 0.0; leaves are alone): a1 = ((1 - .25) + (1 - .5)) / 2 = 0.625, a2 = -0.375,
    # b1 = b2 = ((0 - .25) + 0) / 2 = -0.125; without the root: 0.5, -0.5, 0, 0; with subgroup rejection B's
    # all-equal group is skipped: b1 = b2 = -0.25. Then whitening over the batch.
    def whitened(v):
        import numpy as np

        v = np.array(v)
        return list((v - v.mean()) / np.sqrt(v.var() + 1e-8))

    assert scores() == pytest.approx(whitened([0.625, -0.375, -0.125, -0.125]))
    assert scores(root_group=False) == pytest.approx(whitened([0.5, -0.5, 0.0, 0.0]))
    assert scores(subgroup_rejection=True) == pytest.approx(whitened([0.625, -0.375, -0.25, -0.25]))


def test_treepo_prompt_scale_divides_each_prompt_by_its_reward_std():
    # Each prompt's scores over its own reward std: [1, 0, 0, 0] (scores as above) over sqrt(3)/4, [1, 1, 0, 0]
    # (levels root .5, A 1, B 0: scores .25, .25, -.25, -.25) over 1/2; no whitening across the two.
    hard, easy = two_level([1.0, 0.0, 0.0, 0.0]), two_level([1.0, 0.0, 0.0, 0.0])
    easy.set_trajectory_rewards([1.0, 1.0, 0.0, 0.0])
    cfg = AlgoConfig(name="treepo", treepo=TreePOCreditConfig(scale="prompt"))
    a_hard, a_easy = cfg.advantages([hard, easy])
    std = 3 ** 0.5 / 4
    assert a_hard == pytest.approx([0.625 / std, -0.375 / std, -0.125 / std, -0.125 / std], rel=1e-5)
    assert a_easy == pytest.approx([0.5, 0.5, -0.5, -0.5], rel=1e-5)
    batch = AlgoConfig(name="treepo", treepo=TreePOCreditConfig(whiten_by_tokens=False)).advantages([hard, easy])
    assert batch[0] != pytest.approx(a_hard)  # the default whitens the two prompts together


def test_treepo_scale_is_checked():
    with pytest.raises(ValueError, match="algo.treepo.scale"):
        TreePOCreditConfig(scale="group")
    assert load_config(None, ["algo.treepo.scale=prompt"]).algo.treepo.scale == "prompt"
