"""Log-probs and entropy chunk by chunk (learner/logprobs.py): equal to the full-vocabulary computation, gradients
included, and inside a model as its output layer (no model files)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from treepo_ray.learner.logprobs import LogprobHead, chunked_logprobs, install_logprob_head, logprobs_reference


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_equals_full_logits_with_gradients(chunk, temperature):
    torch.manual_seed(0)
    h = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    b = torch.randn(50, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (37,))
    got = chunked_logprobs(h, w, t, temperature, b, chunk=chunk)
    want = logprobs_reference(h, w, t, temperature, b)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-12, atol=1e-12)
    coef = torch.linspace(-1, 2, 37, dtype=torch.float64)
    g_got = torch.autograd.grad((got[0] * coef + 0.3 * got[1]).sum(), (h, w, b))
    g_want = torch.autograd.grad((want[0] * coef + 0.3 * want[1]).sum(), (h, w, b))
    for g, r in zip(g_got, g_want):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


def test_float32_values_within_1e_5_of_the_full_computation():
    torch.manual_seed(1)
    h, w = torch.randn(64, 32), torch.randn(3000, 32) * 0.2
    t = torch.randint(0, 3000, (64,))
    for got, want in zip(chunked_logprobs(h, w, t, chunk=16), logprobs_reference(h, w, t)):
        assert (got - want).abs().max() < 1e-5


def test_head_replaces_the_output_layer_keeping_the_tied_weight():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    names = set(model.state_dict())
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        want = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    head = install_logprob_head(model, chunk=2)
    assert isinstance(model.lm_head, LogprobHead) and model.lm_head.weight is model.model.embed_tokens.weight
    assert set(model.state_dict()) == names  # checkpoints and weight export see the same parameters
    with torch.no_grad(), head.targets(ids[:, 1:]):
        out = model(input_ids=ids, logits_to_keep=torch.arange(4)).logits
    torch.testing.assert_close(out[0, :, 0], want)
    assert (out[0, :, 1] > 0).all()  # entropies
    with torch.no_grad():  # outside targets(...) it is the plain output layer
        torch.testing.assert_close(model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(
            -1, ids[0, 1:, None])[:, 0], want)


def test_a_padded_embedding_scores_over_the_tokenizers_ids_only():
    """The engines sample from the tokenizer's ids (padding rows masked); the learner's log-probs match."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    ids = torch.tensor([[3, 5, 7, 9, 11]])
    with torch.no_grad():
        want = model(input_ids=ids).logits[0, :-1, :40].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    head = install_logprob_head(model, chunk=3, vocab_size=40)
    with torch.no_grad(), head.targets(ids[:, 1:]):
        out = model(input_ids=ids, logits_to_keep=torch.arange(4)).logits
    torch.testing.assert_close(out[0, :, 0], want)


def test_under_bf16_autocast_the_gradient_matches_the_forward():
    # The learner's forward runs under autocast (learner.dtype bfloat16), its backward outside it: the backward must
    # recompute the logits as the forward did, or its probabilities (from the forward's normaliser) do not sum to 1.
    torch.manual_seed(2)
    h = (torch.randn(48, 32) * 2).requires_grad_()
    w = torch.randn(500, 32).requires_grad_()
    b = torch.randn(500).requires_grad_()
    t = torch.randint(0, 500, (48,))
    grads = {}
    for name, fn in (("chunked", lambda: chunked_logprobs(h, w, t, 1.0, b, chunk=16)),
                     ("reference", lambda: logprobs_reference(h, w, t, 1.0, b))):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, entropy = fn()
        grads[name] = torch.autograd.grad((logp + 0.3 * entropy).sum(), (h, w, b))
    # d(log p_t + 0.3 H)/dz sums to 0 over the vocabulary in each row when the probabilities sum to 1.
    assert grads["chunked"][2].sum().abs() < 1e-3 * 48
    for got, want in zip(grads["chunked"], grads["reference"]):
        assert (got - want).abs().max() <= 2e-2 * want.abs().max()
