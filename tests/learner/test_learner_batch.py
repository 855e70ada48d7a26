"""Collation layout and sample validation (no model)."""

import pytest

from treepo_ray.learner import TrainSample, collate


def test_collate_right_pads_and_aligns_response_with_targets():
    a = TrainSample([10, 11], [12, 13, 14], advantages=2.0, weight=0.5, old_logprobs=[-1.0, -2.0, -3.0])
    b = TrainSample([20], [21], advantages=[-1.0], old_logprobs=[-4.0])
    batch = collate([a, b], pad_id=7)
    assert batch.input_ids.tolist() == [[10, 11, 12, 13, 14], [20, 21, 7, 7, 7]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    # Target column t is input_ids[:, t + 1]: a's response tokens 12, 13, 14 sit in columns 1..3.
    assert batch.response_mask.tolist() == [[0, 1, 1, 1], [1, 0, 0, 0]]
    # weight multiplies the advantage: 2.0 * 0.5 on each of a's response tokens.
    assert batch.advantages.tolist() == [[0, 1.0, 1.0, 1.0], [-1.0, 0, 0, 0]]
    assert batch.old_logprobs.tolist() == [[0, -1.0, -2.0, -3.0], [-4.0, 0, 0, 0]]
    assert batch.num_tokens == 4
    assert batch.responses(batch.old_logprobs) == [[-1.0, -2.0, -3.0], [-4.0]]


def test_collate_per_token_advantages_and_missing_old_logprobs():
    s = TrainSample([1, 2, 3], [4, 5], advantages=[0.5, -0.25], weight=2.0)
    batch = collate([s, TrainSample([1], [2], 1.0, old_logprobs=[-1.0])])
    assert batch.advantages[0].tolist() == [0, 0, 1.0, -0.5]
    assert batch.old_logprobs is None  # only when every sample carries them


@pytest.mark.parametrize(
    "sample, message",
    [
        (TrainSample([], [1], 1.0), r"samples\[3\]\.prompt_ids is empty"),
        (TrainSample([1], [], 1.0), r"samples\[3\]\.response_ids is empty"),
        (TrainSample([1], [2, 999], 1.0), r"samples\[3\]\.response_ids\[1\] = 999 is outside the vocabulary"),
        (TrainSample([-1], [2], 1.0), r"samples\[3\]\.prompt_ids\[0\] = -1"),
        (TrainSample([1], [2, 3], [1.0]), r"samples\[3\]\.advantages has 1 values for 2"),
        (TrainSample([1], [2], "high"), r"samples\[3\]\.advantages = 'high'"),
        (TrainSample([1], [2], 1.0, old_logprobs=[0.0, 0.0]), r"samples\[3\]\.old_logprobs has 2 values for 1"),
    ],
)
def test_bad_samples_are_named(sample, message):
    with pytest.raises(ValueError, match=message):
        sample.validate("samples[3]", vocab_size=100)
