"""Teacher-forced log-probs of grafted tokens agree with what the engine reports for tokens it sampled itself."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from treepo_ray.engines.base import SamplingParams, SegmentRequest, generate
from treepo_ray.engines.hf import HFEngine
from treepo_ray.engines.tiny import TinyModelConfig, build_tiny_model
from treepo_ray.engines.hf.logprobs import teacher_forced_logprobs

pytestmark = pytest.mark.slow  # builds and runs a model


@pytest.fixture(scope="module")
def padded_model(tmp_path_factory):
    """A random tiny Qwen2 with spread-out weights (so samples vary) and an embedding padded beyond the tokenizer."""
    path = build_tiny_model(tmp_path_factory.mktemp("lp") / "m", TinyModelConfig(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=64, seed=2))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(270, mean_resizing=False)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    model.save_pretrained(path)
    return path


def test_grafted_logprobs_match_the_engines_sampled_logprobs(padded_model):
    engine = HFEngine(padded_model)  # reads the tokenizer's size (258) and drops the padded logits
    assert engine.vocab_size == 258
    prefix = [5, 6, 7, 8]
    (res,) = generate(engine, [SegmentRequest("r", prefix, 12, n=2, params=SamplingParams(1.0, seed=4))])
    for child in res.children:
        got = engine.score(prefix, child.token_ids, 1.0)
        assert got == pytest.approx(child.logprobs, abs=1e-4)
    # Over the full padded softmax they would differ: the cut to the tokenizer's vocabulary matters.
    full = teacher_forced_logprobs(engine.model, prefix, res.children[0].token_ids, vocab_size=None)
    assert max(abs(a - b) for a, b in zip(full, res.children[0].logprobs)) > 1e-3


def test_logprobs_of_a_single_token_by_hand(padded_model):
    model = AutoModelForCausalLM.from_pretrained(padded_model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[3, 9]])).logits[0, -1, :258]
    expected = float(logits[11] - torch.logsumexp(logits, dim=0))
    assert teacher_forced_logprobs(model, [3, 9], [11], vocab_size=258) == pytest.approx([expected], abs=1e-5)
    assert teacher_forced_logprobs(model, [3], [], vocab_size=258) == []


def test_bad_inputs_are_refused(padded_model):
    model = AutoModelForCausalLM.from_pretrained(padded_model, dtype=torch.float32).eval()
    with pytest.raises(ValueError, match="prefix_ids is empty"):
        teacher_forced_logprobs(model, [], [1])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        teacher_forced_logprobs(model, [1], [300], vocab_size=258)
