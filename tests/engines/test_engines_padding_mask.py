"""The vLLM engine's padding mask as plain data (no vLLM needed): only the padded rows, within vLLM's limit."""

import pytest

from treepo_ray.engines.vllm import MAX_MASKED_IDS, padding_mask


def test_real_checkpoints_mask_only_their_padded_rows():
    qwen25 = padding_mask(151665, 152064)  # Qwen2.5-7B / -Math: 399 padded rows
    assert sorted(qwen25) == list(range(151665, 152064)) and set(qwen25.values()) == {float("-inf")}
    assert len(padding_mask(151669, 151936)) == 267  # Qwen3
    assert padding_mask(128256, 128256) is None  # Llama 3: nothing padded, no bias at all


def test_more_padded_rows_than_vllm_masks_is_a_clear_error():
    assert len(padding_mask(100, 100 + MAX_MASKED_IDS)) == MAX_MASKED_IDS
    with pytest.raises(ValueError, match="1025 rows past the tokenizer's 100 ids"):
        padding_mask(100, 100 + MAX_MASKED_IDS + 1)
