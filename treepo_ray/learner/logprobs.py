"""Token log-probs and entropy from the last hidden states, without a full-vocabulary float32 copy per token.

The plain way (logits = lm_head(h) for every position, .float(), log_softmax, entropy) keeps three or four
[tokens, vocabulary] float32 tensors alive for backward: at 4k tokens and a 150k vocabulary, 2.4 GB each. Here
rows are processed in chunks of `chunk` rows; forward keeps only each row's log-normaliser, and backward recomputes
one chunk's logits at a time (ChunkedLogprobs), under the autocast forward ran in (as torch.amp.custom_bwd does),
so the saved normaliser belongs to the same logits. Peak memory beyond the hidden states: one chunk's [chunk, V]
logits and probabilities, and one [V, hidden] gradient buffer for the head.

`LogprobHead` puts this inside the model's own forward: it replaces the model's `lm_head` (same weight tensor,
same parameter name, so checkpoints and FSDP2/DeepSpeed see no difference) and, while `targets(...)` is active,
returns per row (log-prob of the target, entropy) instead of logits. Inside the forward matters for FSDP2: the
root module's parameters (embeddings, tied head) are gathered and their gradients reduced by its hooks.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

DEFAULT_CHUNK = 1024
"""Rows per chunk: at a 150k vocabulary one float32 chunk of logits is 0.6 GB."""


def logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                       bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain computation (full float32 logits, log_softmax, entropy): what ChunkedLogprobs must equal."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = logits.log_softmax(dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(dim=-1)


class ChunkedLogprobs(torch.autograd.Function):
    """(log p(target), entropy) per row of `hidden` [N, H] under softmax((hidden @ weight.T + bias) / temperature),
    chunk by chunk; backward recomputes each chunk's logits (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int, with_entropy: bool = True):
        n = hidden.shape[0]
        device = hidden.device.type
        # Backward recomputes the logits under this same autocast (torch.amp.custom_fwd/custom_bwd, but for the
        # tensors' own device): with bfloat16 logits here and float32 ones there, the probabilities backward takes
        # from the saved normaliser would not sum to one.
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        dtype = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 when given float64
        logp_t, entropy, lse = (hidden.new_empty(n, dtype=dtype) for _ in range(3))
        with torch.no_grad():
            for s in range(0, n, chunk):
                z = _logits(hidden[s:s + chunk], weight, bias, temperature)
                lse[s:s + chunk] = l = torch.logsumexp(z, dim=-1)
                logp_t[s:s + chunk] = z.gather(-1, targets[s:s + chunk, None])[:, 0] - l
                if with_entropy:
                    # H = -sum_v p_v log p_v, with log p = z - lse (in place: one more [chunk, V] buffer, p)
                    logp = z.sub_(l[:, None])
                    entropy[s:s + chunk] = -(logp.exp() * logp).sum(dim=-1)
        if not with_entropy:
            entropy.zero_()
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        return logp_t, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        T, chunk = ctx.temperature, ctx.chunk
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight, dtype=lse.dtype) if need_w else None
        grad_b = torch.zeros_like(bias, dtype=lse.dtype) if need_b and bias is not None else None
        if grad_logp is None:
            grad_logp = torch.zeros_like(lse)
        if grad_entropy is None or not ctx.with_entropy:
            grad_entropy = torch.zeros_like(lse)
        device, autocast_dtype, autocast = ctx.autocast
        with torch.autocast(device, dtype=autocast_dtype, enabled=autocast):  # as in forward (see there)
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s:s + chunk]
                gl, ge = grad_logp[s:s + chunk, None], grad_entropy[s:s + chunk, None]
                # d logp_t / dz = onehot - p;  d H / dz_v = -p_v (log p_v + H). In place: two [chunk, V] buffers.
                g = _logits(h, weight, bias, T).sub_(lse[s:s + chunk, None])  # log p
                p = g.exp()
                g.add_(entropy[s:s + chunk, None]).mul_(ge).add_(gl).mul_(p).neg_()
                del p
                g.scatter_add_(-1, targets[s:s + chunk, None], gl)
                if T != 1.0:
                    g.div_(T)  # z = logits / T
                if need_h:
                    grad_h[s:s + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
                if need_w:
                    grad_w.addmm_(g.t(), h.to(g.dtype))
                if grad_b is not None:
                    grad_b += g.sum(dim=0)
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w, grad_b, None, None, None, None


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float) -> torch.Tensor:
    z = torch.nn.functional.linear(h, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z / temperature if temperature != 1.0 else z


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                     bias: torch.Tensor | None = None, chunk: int = DEFAULT_CHUNK,
                     entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each row's target, entropy of each row), float32, [N] each, for `hidden` [N, H]; with
    `entropy` False the entropy is not computed (zeros, no gradient)."""
    if chunk < 1:
        raise ValueError(f"chunk = {chunk}; it must be >= 1")
    return ChunkedLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk), bool(entropy))


@dataclass
class _Request:
    targets: torch.Tensor
    temperature: float
    entropy: bool


class LogprobHead(torch.nn.Linear):
    """The model's output layer, able to return (log-prob of a target, entropy) per position instead of logits.

    Built from the model's own lm_head (`from_linear`), sharing its weight; outside `targets(...)` it is that
    Linear layer. Inside, the model's forward returns `.logits` of shape [..., 2]: [..., 0] the log-prob of each
    position's target, [..., 1] the entropy, both float32 (see ChunkedLogprobs)."""

    chunk: int = DEFAULT_CHUNK
    vocab_size: int | None = None
    """Log-probs over the first vocab_size ids only (the tokenizer's, as the engines sample them: rows of a padded
    embedding take no part); None = every row."""
    _request: _Request | None = None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, chunk: int = DEFAULT_CHUNK,
                    vocab_size: int | None = None) -> LogprobHead:
        head = cls.__new__(cls)
        torch.nn.Module.__init__(head)
        head.in_features, head.out_features = linear.in_features, linear.out_features
        head.weight = linear.weight  # the same Parameter: ties to the embedding are kept
        head.bias = linear.bias
        head.chunk, head.vocab_size = chunk, vocab_size
        return head

    @contextlib.contextmanager
    def targets(self, targets: torch.Tensor, temperature: float = 1.0, entropy: bool = True):
        """Within this block the model returns per-position (log-prob of `targets`, entropy); `targets` has the
        shape of the positions the head sees (the kept positions' leading dimensions). `entropy` False skips the
        entropy (zeros)."""
        self._request = _Request(targets, temperature, entropy)
        try:
            yield
        finally:
            self._request = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self._request
        if request is None:
            return super().forward(hidden)
        lead = hidden.shape[:-1]
        if request.targets.shape != lead:
            raise ValueError(f"the head got positions of shape {tuple(lead)} but targets of shape "
                             f"{tuple(request.targets.shape)}")
        rows = slice(None, self.vocab_size)
        logp, ent = chunked_logprobs(hidden.reshape(-1, hidden.shape[-1]), self.weight[rows],
                                     request.targets.reshape(-1), request.temperature,
                                     None if self.bias is None else self.bias[rows], self.chunk, request.entropy)
        return torch.stack([logp, ent], dim=-1).reshape(*lead, 2)


def install_logprob_head(model: torch.nn.Module, chunk: int = DEFAULT_CHUNK,
                         vocab_size: int | None = None) -> LogprobHead:
    """Replace `model`'s output embedding (an HF causal LM's lm_head) with a LogprobHead sharing its weight, its
    log-probs over the first `vocab_size` ids (None: all)."""
    linear = model.get_output_embeddings()
    if isinstance(linear, LogprobHead):
        return linear
    if type(linear) is not torch.nn.Linear:
        raise ValueError(f"the model's output layer is a {type(linear).__name__}, not a plain Linear; the learner "
                         "computes log-probs from it chunk by chunk")
    head = LogprobHead.from_linear(linear, chunk, vocab_size)
    model.set_output_embeddings(head)
    return head
