"""HFEngine's own forward against the transformers forward, per model family, on tiny random configs built in memory
(weights spread out, norms away from 1, so a missing or misplaced norm, bias or head split changes the log-probs)."""

from __future__ import annotations

import pytest
import torch

from treepo_ray.engines.base import SamplingParams, SegmentRequest, generate
from treepo_ray.engines.hf import HFEngine

pytestmark = pytest.mark.slow

PROMPT = [5, 9, 33, 70, 100, 41, 7, 12, 80, 64, 3]


def _family(name: str):
    import transformers as tf

    shape = dict(vocab_size=128, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128, eos_token_id=0, tie_word_embeddings=False)
    if name == "qwen3":  # head_dim set apart from hidden / heads, as Qwen3 checkpoints do (128 heads of 128 at 4096)
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**shape, head_dim=16))
    if name == "llama":  # biases on every projection: the fused q|k|v and o with bias, the MLP's too
        return tf.LlamaForCausalLM(tf.LlamaConfig(**shape, attention_bias=True, mlp_bias=True))
    raise ValueError(name)


def _spread(model: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if "norm" in name else 0.15 * noise)
    return model.float().eval()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_engine_log_probs_and_greedy_tokens_match_transformers(family):
    hf = _spread(_family(family))
    if family == "qwen3":
        assert hf.model.layers[0].self_attn.q_norm.weight.std() > 0.1  # the per-head norms are not identity
    engine = HFEngine(hf, num_threads=1)
    params = SamplingParams(temperature=1.0, seed=3)
    # Two children, then a cached continuation of one of them: prefill, decode and the cache path all checked.
    (a,) = generate(engine, [SegmentRequest("a", PROMPT, 6, n=2, params=params, stop_at_eos=False)])
    child = a.children[1]
    prefix_b = PROMPT + child.token_ids
    (b,) = generate(engine, [SegmentRequest("b", prefix_b, 5, params=params, parent_key=child.cache_key,
                                            stop_at_eos=False)])
    assert engine.stats()["cache_hits"] == 1
    for prefix, seg in ((PROMPT, a.children[0]), (PROMPT, child), (prefix_b, b.children[0])):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prefix + seg.token_ids])).logits[0].float(), dim=-1)
        expect = [ref[len(prefix) - 1 + i, t].item() for i, t in enumerate(seg.token_ids)]
        assert seg.logprobs == pytest.approx(expect, abs=1e-4)
    greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    (g,) = generate(engine, [SegmentRequest("g", PROMPT, 12, params=SamplingParams(temperature=0.0),
                                            stop_at_eos=False)])
    assert g.children[0].token_ids == greedy[0, len(PROMPT):].tolist()
