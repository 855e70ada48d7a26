"""What every growth state machine shares: the request/result types, the early-stop checks, the Grower base.

A grower owns one prompt's Tree. It emits `Ask`s (sample `n` children continuing one node) and consumes the
`Segment`s an engine returned for them (engines return this same type); a driver in the engines layer turns asks
into engine requests. Growers never call an engine themselves, so they are pure bookkeeping and can be tested with
a scripted engine.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable

import numpy as np

from treepo_ray.tree.tree import FINISH_REASONS, Tree

BOXED = "\\boxed{"
SEGMENT_ENDS = ("eos", "length", "branch")


@dataclass
class Ask:
    """A request for children of one node."""

    request_id: str
    """Unique within the grower: f"{tree.query_id}/{counter}"."""
    node: int
    """Children continue tree.prefix_ids(node) (node 0 = the prompt)."""
    n: int
    """How many children to sample from that node."""
    max_new_tokens: int
    """Length cap of each child segment (the segment length, or less near the response limit)."""
    seed: int
    """Seed of the request's random stream, derived from the grower's seed and the ask counter."""
    stop_entropy: float = 0.0
    """End each child before a token whose entropy reaches this, once it holds min_new_tokens (0 = at the length
    cap only): SegmentRequest.stop_entropy."""
    min_new_tokens: int = 0
    """Tokens each child holds at least before stop_entropy may end it."""


@dataclass
class Segment:
    """One sampled child of a node: what an engine returns and a grower adds to its tree."""

    token_ids: list[int]
    """Generated token ids (an EOS, if any, is the last one)."""
    logprobs: list[float]
    """Log-prob of each token under the sampling model at the sampling temperature (before top-p/top-k; 1 when
    greedy): the behaviour log-probs the learner's off-policy correction uses."""
    finish_reason: str
    """'eos' (ended with the EOS token), 'length' (reached max_new_tokens) or 'branch' (stopped before a token whose
    entropy reached the request's stop_entropy)."""
    cache_key: str | None = None
    """Key under which the engine keeps this segment's KV cache for a later continuation (None = not cached)."""
    entropies: list[float] | None = None
    """Entropy (nats) of the distribution each token was drawn from, where the request asked for it (else None)."""
    branch_entropy: float | None = None
    """For finish_reason 'branch': the entropy of the next token's distribution, where the children will diverge."""


def has_complete_boxed(text: str) -> bool:
    r"""True if `text` holds a `\boxed{...}` whose braces close (nested braces balanced)."""
    start = text.find(BOXED)
    while start >= 0:
        depth = 1
        for ch in text[start + len(BOXED) :]:
            depth += (ch == "{") - (ch == "}")
            if depth == 0:
                return True
        start = text.find(BOXED, start + 1)
    return False


def has_repetition(text: str, substr_len: int, min_count: int) -> bool:
    """True if some substring of `substr_len` characters occurs `min_count` or more times (overlaps count)."""
    if substr_len <= 0 or min_count <= 0 or len(text) < substr_len:
        return False
    counts = Counter(text[i : i + substr_len] for i in range(len(text) - substr_len + 1))
    return max(counts.values()) >= min_count


@dataclass
class PathLimits:
    """Segment length and early-stop rules shared by the segment-wise samplers (TreePO, sequential)."""

    segment_len: int = 512
    """l: most tokens generated per segment."""
    max_depth: int = 14
    """d: most segments on one path; a node at this depth ends its path."""
    max_response_len: int | None = None
    """Response token limit ('max_length'); 0 or None = max_depth * segment_len."""
    max_total_len: int = 0
    """Prompt + response token limit, the model's context ('max_length' too; 0 = none). Paths of longer prompts
    reach it at a smaller depth; segments are cut to fit it."""
    require_eos_after_boxed: bool = False
    """A boxed answer ends a path only if the path also ended with EOS."""
    repetition_substr_len: int = 32
    """Characters of the repeated substring looked for in each new segment's text (0 = no repetition check)."""
    repetition_min_count: int = 8
    """Occurrences (overlaps counted) of that substring that end the path as 'repetition' (0 = no check)."""
    segment_align: int = 0
    """Put segment ends on an engine's KV-cache block boundaries (vLLM: its block_size; 0 = off): the first segment
    is cut or extended, by at most half of this, so that the prefix after it is 1 past a multiple of this, and the
    last segment (at max_depth) gives or takes the difference. With segment_len a multiple of it, every child's
    prefix then lies in whole cached blocks but for the parent's last sampled token, so vLLM recomputes none of it."""

    def check_limits(self) -> None:
        name = type(self).__name__
        if self.segment_align < 0 or (self.segment_align and self.segment_len % self.segment_align):
            raise ValueError(f"{name}.segment_align {self.segment_align} must be 0 or divide segment_len "
                             f"{self.segment_len}")
        if self.max_response_len is not None and self.max_response_len < 0:
            raise ValueError(f"{name}.max_response_len must be >= 0, got {self.max_response_len}")
        if self.max_total_len < 0:
            raise ValueError(f"{name}.max_total_len must be >= 0, got {self.max_total_len}")
        if self.repetition_substr_len < 0 or self.repetition_min_count < 0:
            raise ValueError(f"{name}.repetition_substr_len and repetition_min_count must be >= 0")

    def response_limit(self) -> int:
        return self.max_response_len or self.max_depth * self.segment_len

    def stop_rules(self) -> "StopRules":
        return StopRules(
            max_depth=self.max_depth,
            max_response_len=self.response_limit(),
            max_total_len=self.max_total_len,
            require_eos_after_boxed=self.require_eos_after_boxed,
            repetition_substr_len=self.repetition_substr_len,
            repetition_min_count=self.repetition_min_count,
        )


@dataclass(frozen=True)
class StopRules:
    """The early-stop checks of a grower, applied in this order: boxed, eos, max_length, max_depth, repetition."""

    max_depth: int
    """A node at this depth ends its path ('max_depth')."""
    max_response_len: int
    """A path whose response holds this many tokens or more ends ('max_length')."""
    max_total_len: int = 0
    """A path whose prompt + response holds this many tokens or more ends ('max_length'; 0 = no such limit)."""
    check_boxed: bool = True
    r"""A complete \boxed{...} in the response so far ends the path ('boxed')."""
    require_eos_after_boxed: bool = False
    """Count a boxed answer only when the path also ended with EOS."""
    repetition_substr_len: int = 0
    """Length in characters of the repeated substring looked for in the new segment's text (0 = no check)."""
    repetition_min_count: int = 0
    """How often that substring must occur, overlaps counted, to end the path ('repetition'; 0 = no check)."""

    def classify(
        self, tree: Tree, node: int, ended_with_eos: bool, decode: Callable[[list[int]], str]
    ) -> tuple[str, bool]:
        """Finish reason of a freshly added node ('none' = it continues) and whether its response holds a box."""
        boxed = self.check_boxed and has_complete_boxed(decode(tree.response_ids(node)))
        if boxed and (ended_with_eos or not self.require_eos_after_boxed):
            return "boxed", boxed
        if ended_with_eos:
            return "eos", boxed
        if self.tokens_left(tree, node) <= 0:
            return "max_length", boxed
        if tree.depth[node] >= self.max_depth:
            return "max_depth", boxed
        if (self.repetition_substr_len and self.repetition_min_count  # off: no need to decode the segment
                and has_repetition(decode(tree.tokens[node]), self.repetition_substr_len, self.repetition_min_count)):
            return "repetition", boxed
        return "none", boxed

    def tokens_left(self, tree: Tree, node: int) -> int:
        """How many more tokens a path ending at `node` may generate under the length limits."""
        response = len(tree.response_ids(node))
        left = self.max_response_len - response
        if self.max_total_len:
            left = min(left, self.max_total_len - len(tree.prompt_ids) - response)
        return left


# Per-batch totals of what the growers did (growth_counters): name -> the grower statistic it sums.
COUNTERS = {
    "branches": "branches", "budget_transfers": "budget_transfers", "fallbacks": "fallbacks",
    "random_divergence": "random_divergence", "logprob_branchings": "logprob_branchings",
    "entropy_stops": "entropy_stops", "entropy_branchings": "entropy_branchings",
    **{f"stop_{r}": f"finish/{r}" for r in FINISH_REASONS[1:]},
}


def growth_counters(trees: list[Tree]) -> dict[str, float]:
    """`growth/<name>`: each growth mechanism's count summed over `trees` (from tree.meta["growth"]): asks that
    branched, rounds whose finished paths' budget went to the survivors, fallbacks, trees whose initial divergence
    was drawn at random, rounds whose budget was spread by segment log-probs, segments ended before an uncertain token,
    rounds whose budget was spread by entropy, and finished paths per stop reason."""
    stats = [t.meta.get("growth", {}) for t in trees]
    return {f"growth/{name}": float(sum(g.get(key, 0) for g in stats)) for name, key in COUNTERS.items()}


def check_positive(owner: str, **fields: int | float) -> None:
    """Raise ValueError naming the first field that is not > 0."""
    for name, value in fields.items():
        if not value > 0:
            raise ValueError(f"{owner}.{name} must be > 0, got {value!r}")


class Grower:
    """Base of the growth state machines: ask bookkeeping, result validation, early stops, statistics.

    Subclasses queue their first asks in their constructor and implement `_grow(ask, nodes)`, which reacts to the
    children of one ask (finish them, ask for more, or close the tree).
    """

    def __init__(
        self, tree: Tree, rules: StopRules, *, eos_token_id: int, decode: Callable[[list[int]], str], seed: int
    ):
        if len(tree) != 1:
            raise ValueError(f"a grower needs a tree holding only the prompt, got {len(tree)} nodes")
        if not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        if rules.tokens_left(tree, 0) < 1:
            raise ValueError(f"tree {tree.query_id!r}: a prompt of {len(tree.prompt_ids)} tokens leaves no room for "
                             f"a response under max_total_len {rules.max_total_len}")
        self.tree = tree
        self.rules = rules
        self.eos_token_id = eos_token_id
        self.decode = decode
        self.seed = int(seed)
        # Every random choice of the grower comes from this generator; ask seeds come from SeedSequence
        # ([seed, counter]) instead, so they do not depend on how many choices were drawn before.
        self.rng = np.random.default_rng(self.seed)
        self._counter = 0
        self._ready: list[Ask] = []
        self._outstanding: dict[str, Ask] = {}
        self._issued: set[str] = set()
        self._seq: dict[str, int] = {}  # request id -> ask counter
        self._order: dict[int, tuple[int, int]] = {}  # node -> (ask counter, child index): arrival-independent order
        self._holds_box: dict[int, bool] = {}
        self._finished: list[int] = []  # trajectory ends in the order they were registered
        self._done = False
        self.align = 0
        """Segment alignment (PathLimits.segment_align); subclasses set it before their first ask."""
        self._stats: dict[str, int] = {"asks": 0, "segments": 0, "branches": 0, "fallbacks": 0, "budget_transfers": 0,
                                       "logprob_branchings": 0, "random_divergence": 0, "entropy_stops": 0,
                                       "entropy_branchings": 0}
        self._branch_entropy: dict[int, float] = {}  # node -> entropy of the token its segment stopped before
        for reason in FINISH_REASONS[1:]:
            self._stats[f"finish/{reason}"] = 0

    # ---- interface used by the driver -------------------------------------------------------------------------

    def asks(self) -> list[Ask]:
        """Every request that is ready now; each is returned exactly once."""
        out, self._ready = self._ready, []
        for ask in out:
            self._outstanding[ask.request_id] = ask
        return out

    def receive(self, request_id: str, children: list[Segment]) -> list[int]:
        """Add the children of one ask as nodes (classified by the early-stop rules); return their ids in order."""
        ask = self._outstanding.get(request_id)
        if ask is None:
            if request_id not in self._issued:
                raise ValueError(f"request {request_id!r} was never issued by this grower")
            if any(a.request_id == request_id for a in self._ready):
                raise ValueError(f"request {request_id!r} was not yet returned by asks()")
            raise ValueError(f"request {request_id!r} was already received")
        if len(children) != ask.n:
            raise ValueError(f"request {request_id!r} asked for {ask.n} children, got {len(children)}")
        for j, c in enumerate(children):
            where = f"request {request_id!r} child {j}"
            if c.finish_reason not in SEGMENT_ENDS:
                raise ValueError(f"{where}: finish_reason {c.finish_reason!r} is not one of {SEGMENT_ENDS}")
            if len(c.token_ids) != len(c.logprobs) or (c.entropies is not None and len(c.entropies) != len(c.logprobs)):
                raise ValueError(f"{where}: {len(c.token_ids)} tokens but {len(c.logprobs)} log-probs and "
                                 f"{len(c.entropies or [])} entropies")
            if len(c.token_ids) > ask.max_new_tokens:
                raise ValueError(f"{where}: {len(c.token_ids)} tokens > max_new_tokens {ask.max_new_tokens}")
        del self._outstanding[request_id]
        seq = self._seq[request_id]
        nodes = []
        for j, c in enumerate(children):
            node = self.tree.add_node(ask.node, c.token_ids, c.logprobs, entropy=c.entropies)
            eos = c.finish_reason == "eos" or (len(c.token_ids) > 0 and c.token_ids[-1] == self.eos_token_id)
            reason, box = self.rules.classify(self.tree, node, eos, self.decode)
            self.tree.finish[node] = reason
            self._holds_box[node] = box
            self._order[node] = (seq, j)
            if c.finish_reason == "branch":
                self._branch_entropy[node] = float(c.branch_entropy)
                self._stats["entropy_stops"] += 1
            nodes.append(node)
        self._stats["segments"] += len(nodes)
        self._grow(ask, nodes)
        return nodes

    def done(self) -> bool:
        """No ask outstanding and none will come; tree.trajectories is final."""
        return self._done

    def stats(self) -> dict:
        """Counters: asks, segments (nodes received), branches (asks with n >= 2), fallbacks, finish/<reason> (one
        per finished node), max_depth_reached, trajectories, entropy_stops (segments ended before an uncertain
        token); TreePO's budget_transfers, logprob_branchings, entropy_branchings and random_divergence (0 for the
        other growers), rounds and init_divergence."""
        out = dict(self._stats)
        out["max_depth_reached"] = max(self.tree.depth)
        out["trajectories"] = len(self.tree.trajectories)
        return out

    # ---- helpers for subclasses -------------------------------------------------------------------------------

    def _grow(self, ask: Ask, nodes: list[int]) -> None:
        raise NotImplementedError

    def _ask(self, node: int, n: int, segment_len: int, stop_entropy: float = 0.0, min_len: int = 0) -> Ask:
        """Queue a request for `n` children of `node`, each at most `segment_len` tokens and within the limit (and,
        with `stop_entropy`, ending before an uncertain token once it holds `min_len`)."""
        left = self.rules.tokens_left(self.tree, node)
        if n < 1 or left < 1:
            raise AssertionError(f"bug: ask for {n} children of node {node} with {left} tokens left")
        if self.align:  # see PathLimits.segment_align; the children's depth decides
            past = (len(self.tree.prompt_ids) + segment_len - 1) % self.align
            extend = -past if 2 * past <= self.align else self.align - past  # to the nearest boundary
            depth = self.tree.depth[node] + 1
            segment_len += extend * ((depth == 1) - (depth == self.rules.max_depth))
        seed = int(np.random.SeedSequence([self.seed, self._counter]).generate_state(1)[0] & 0x7FFFFFFF)
        length = int(min(segment_len, left))
        stop = float(stop_entropy) if stop_entropy and min_len < length else 0.0  # no room to stop earlier: off
        ask = Ask(f"{self.tree.query_id}/{self._counter}", int(node), int(n), length, seed, stop,
                  int(min_len) if stop else 0)
        self._counter += 1
        self._ready.append(ask)
        self._issued.add(ask.request_id)
        self._seq[ask.request_id] = self._counter - 1
        self._stats["asks"] += 1
        self._stats["branches"] += int(n >= 2)
        return ask

    def _sorted(self, nodes: list[int]) -> list[int]:
        """Nodes in ask order then child order, whatever order the results arrived in."""
        return sorted(nodes, key=self._order.__getitem__)

    def _address(self, node: int) -> list[int]:
        """Child index at each step from the root to `node`: sorts paths depth-first, whatever the arrival order."""
        return [self._order[m][1] for m in self.tree.path(node)]

    def _finish(self, node: int) -> None:
        """Register a finished node as a trajectory end."""
        self._finished.append(node)
        self.tree.trajectories.append(node)
        self._stats[f"finish/{self.tree.finish[node]}"] += 1

    def _idle(self) -> bool:
        return not self._ready and not self._outstanding

    def depth_first_order(self) -> list[int]:
        """The root, then every node depth-first by child index: an order of the nodes that does not depend on the
        order the engine returned segments in (Tree.renumber takes it)."""
        return [0] + sorted(range(1, len(self.tree)), key=self._address)

    def _close(self) -> None:
        """Final trajectories: every finished node."""
        self.tree.trajectories = list(self._finished)
        self._done = True
        self.tree.meta["growth"] = self.stats()
