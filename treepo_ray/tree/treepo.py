"""TreePO segment-tree growth (TreePO paper, Algorithm 1; the issue text pins down the numbers).

One prompt's tree grows in depth rounds. The root first branches into `init_divergence` children. When every
active path of the round has returned its segment, each new node is classified by the early-stop rules (boxed,
eos, max_length, max_depth, repetition, in that order); finished nodes become trajectories. The surviving
(active) paths then share the round's branching budget:

    remaining = max(w - finished, 0)
    total     = max(min(remaining, b * (finished_now + active)), active)

i.e. each path grown this round is worth b branches, the budget of the paths that just finished is transferred
to the survivors, the tree never widens past w, and every active path continues with at least one child.

Depth-first fallback: only when the prompt has no active path left and fewer than w trajectories, a finished
path that holds a boxed answer or ended on EOS is branched again from the end of the segment *before* its last
one (its last node's parent: "the segment before termination", so the new children are alternatives to the
terminal segment), asking for the missing number of children; from the prompt when no path qualifies. The new
paths then grow like any active path. The prompt ends with exactly w trajectories: no round asks past the budget
(log-prob allocation's rounding is capped), so no path is ever grown only to be dropped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from treepo_ray.tree.growth import Ask, Grower, PathLimits, check_positive
from treepo_ray.tree.tree import Tree

DIVERGENCE_POLICIES = ("uniform", "logprob_high", "logprob_low", "entropy")
BRANCH_POINTS = ("boundary", "entropy")
FALLBACK_POLICIES = ("finished_first", "random")


@dataclass
class TreePOConfig(PathLimits):
    """TreePO tree sampling."""

    width: int = 16
    """w: trajectories per prompt at the end (the group size)."""
    init_divergence: int = 2
    """Children of the root when init_divergence_min/max are unset."""
    init_divergence_min: int | None = None
    """With init_divergence_max: draw the root's children per prompt uniformly from [min, max]."""
    init_divergence_max: int | None = None
    """Upper end (inclusive) of the random initial divergence."""
    branch_factor: int = 2
    """b: branches each path of a round is worth in the budget."""
    divergence_policy: str = "uniform"
    """How the budget is spread over active paths: 'uniform', 'logprob_high' or 'logprob_low'."""
    logprob_temperature: float = 2.0
    """T of softmax(+-segment log-prob / T) (TreePO section 4.4: 2.0 in the static runs)."""
    logprob_temperature_end: float = 0.0
    """0 = T stays logprob_temperature; else T goes linearly from logprob_temperature to this over training (the
    paper's scheduled variant: 5.0 -> 1.0); see `scheduled`."""
    fallback_policy: str = "finished_first"
    """Which finished path fallback branches from: 'finished_first' (most recently finished) or 'random'."""
    branch_point: str = "boundary"
    """Where a segment ends: 'boundary' (after segment_len tokens) or 'entropy': before the first token, after
    min_segment_len, whose distribution's entropy reaches branch_entropy (at segment_len at the latest), so that the
    paths branch where the policy is unsure. Only segments of a tree still below its width end early (one at full
    width gets no new branch from its next round). The engines must report entropies (rollout.entropy)."""
    branch_entropy: float = 0.5
    """Entropy (nats) of the next-token distribution at which branch_point 'entropy' ends a segment. On the default
    task 2.9% of the base model's sampled tokens reach 0.5, mostly the digits of a column's sum (0.08 on average)."""
    min_segment_len: int = 16
    """Tokens a segment holds at least under branch_point 'entropy'."""
    entropy_temperature: float = 0.5
    """T of divergence_policy 'entropy': path k gets a share of the round's budget by softmax(H_k / T), H_k the
    entropy where its next token is drawn (its branch_entropy when its segment ended at an uncertain token, else the
    mean entropy of its segment's tokens)."""

    def __post_init__(self) -> None:
        check_positive("TreePOConfig", width=self.width, max_depth=self.max_depth, segment_len=self.segment_len,
                       init_divergence=self.init_divergence, branch_factor=self.branch_factor,
                       logprob_temperature=self.logprob_temperature)
        if self.logprob_temperature_end < 0:
            raise ValueError(f"TreePOConfig.logprob_temperature_end must be >= 0, got {self.logprob_temperature_end}")
        if (self.init_divergence_min is None) != (self.init_divergence_max is None):
            raise ValueError("TreePOConfig.init_divergence_min and init_divergence_max must be set together")
        if self.init_divergence_min is not None:
            if not 1 <= self.init_divergence_min <= self.init_divergence_max <= self.width:
                raise ValueError(
                    "TreePOConfig needs 1 <= init_divergence_min <= init_divergence_max <= width, got "
                    f"{self.init_divergence_min}, {self.init_divergence_max}, {self.width}"
                )
        elif self.init_divergence > self.width:
            raise ValueError(f"TreePOConfig.init_divergence {self.init_divergence} exceeds width {self.width}")
        if self.divergence_policy not in DIVERGENCE_POLICIES:
            raise ValueError(
                f"TreePOConfig.divergence_policy {self.divergence_policy!r} is not one of {DIVERGENCE_POLICIES}"
            )
        if self.branch_point not in BRANCH_POINTS:
            raise ValueError(f"TreePOConfig.branch_point {self.branch_point!r} is not one of {BRANCH_POINTS}")
        if not self.branch_entropy > 0 or not self.entropy_temperature > 0:
            raise ValueError("TreePOConfig.branch_entropy and entropy_temperature must be > 0")
        if self.branch_point == "entropy" and not 1 <= self.min_segment_len <= self.segment_len:
            raise ValueError(f"TreePOConfig.min_segment_len {self.min_segment_len} must lie in [1, segment_len "
                             f"{self.segment_len}]")
        if self.fallback_policy not in FALLBACK_POLICIES:
            raise ValueError(f"TreePOConfig.fallback_policy {self.fallback_policy!r} is not one of {FALLBACK_POLICIES}")
        self.check_limits()



def scheduled(cfg, progress: float):
    """The sampler config for trees grown at `progress` (0 at the first training step, 1 at the last): a TreePO
    config with a log-prob temperature schedule gets that point's temperature; anything else comes back as is."""
    if not isinstance(cfg, TreePOConfig) or not cfg.logprob_temperature_end:
        return cfg
    p = min(max(float(progress), 0.0), 1.0)
    t = cfg.logprob_temperature + (cfg.logprob_temperature_end - cfg.logprob_temperature) * p
    return dataclasses.replace(cfg, logprob_temperature=t, logprob_temperature_end=0.0)


def branch_budget(width: int, branch_factor: int, finished: int, finished_now: int, active: int) -> int:
    """Children to ask for this round (issue 2's budget transfer).

    `finished`: trajectories of the prompt so far (this round's included); `finished_now`: paths that finished in
    this round; `active`: paths of this round that go on.
    """
    remaining = max(width - finished, 0)
    return max(min(remaining, branch_factor * (finished_now + active)), active)


def allocate_uniform(total: int, active: int, rng: np.random.Generator) -> list[int]:
    """Spread `total` evenly over `active` paths; the remainder goes, one each, to randomly chosen paths."""
    base, extra = divmod(total, active)
    shares = [base] * active
    for i in rng.choice(active, size=extra, replace=False):
        shares[int(i)] += 1
    return shares


def allocate_logprob(total: int, segment_logprobs: list[float], temperature: float, sign: float) -> list[int]:
    """Path k gets max(1, round(p_k * total)) with p = softmax(sign * logprob / T) (TreePO section 4.4), capped
    at the budget.

    Rounding is half-up. The shares may sum to a little less than `total` (made up by fallback), never to more:
    what the rounding and the one-child floor give past `total` comes off the largest shares, one child at a time
    (each path keeps one at least; `total` >= the number of paths, see branch_budget). A path asked for past the
    budget would be grown to its end and then dropped, since a prompt keeps w trajectories: with a peaked softmax
    (T = 5 over 32-token segments) that was 2.3 paths per 8-path tree, 17% of the tree's sampled tokens.
    """
    if not temperature > 0:
        raise ValueError(f"logprob_temperature must be > 0, got {temperature}")
    z = sign * np.asarray(segment_logprobs, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    shares = [max(1, math.floor(float(pk) * total + 0.5)) for pk in p]
    for _ in range(sum(shares) - max(total, len(shares))):
        shares[int(np.argmax(shares))] -= 1
    return shares


@dataclass
class BudgetStep:
    """What one depth round decided (kept for inspection and tests)."""

    depth: int
    """Depth of the round's new nodes."""
    finished: int
    """Trajectories of the prompt after this round."""
    finished_now: int
    """Paths that finished in this round."""
    active: int
    """Paths of this round that go on."""
    total: int
    """Budget from branch_budget (0 when no path is active)."""
    shares: list[int]
    """Children asked of each active path, in node order (empty when no path is active)."""


class TreePOGrower(Grower):
    """Grows one prompt's TreePO tree; see the module docstring for the rules."""

    def __init__(
        self, tree: Tree, cfg: TreePOConfig, *, eos_token_id: int, decode: Callable[[list[int]], str], seed: int
    ):
        super().__init__(tree, cfg.stop_rules(), eos_token_id=eos_token_id, decode=decode, seed=seed)
        self.cfg = cfg
        self.align = cfg.segment_align
        self._round: list[int] = []
        self.history: list[BudgetStep] = []
        if cfg.init_divergence_min is not None:
            self.init_divergence = int(self.rng.integers(cfg.init_divergence_min, cfg.init_divergence_max + 1))
            self._stats["random_divergence"] = 1
        else:
            self.init_divergence = cfg.init_divergence
        self._stats["init_divergence"] = self.init_divergence
        self._stats["rounds"] = 0
        stop = cfg.branch_entropy if cfg.branch_point == "entropy" and self.init_divergence < cfg.width else 0.0
        self._ask(0, self.init_divergence, cfg.segment_len, stop, cfg.min_segment_len)

    def _next_entropy(self, node: int) -> float:
        """Entropy where a child of `node` draws its first token: what stopped its segment there, else its segment's
        mean (see TreePOConfig.entropy_temperature)."""
        if node in self._branch_entropy:
            return self._branch_entropy[node]
        ent = self.tree.entropy[node]
        if not ent:
            raise ValueError("divergence_policy 'entropy' needs the engines' entropies (rollout.entropy: true)")
        return float(np.mean(ent))

    def _grow(self, ask: Ask, nodes: list[int]) -> None:
        self._round.extend(nodes)
        # The round ends when every active path of the prompt has returned its segment.
        if self._idle():
            self._end_round()

    def _end_round(self) -> None:
        cfg = self.cfg
        nodes, self._round = self._sorted(self._round), []
        self._stats["rounds"] += 1
        active = [n for n in nodes if self.tree.finish[n] == "none"]
        finished_now = [n for n in nodes if self.tree.finish[n] != "none"]
        for n in finished_now:
            self._finish(n)
        finished = len(self._finished)
        depth = self.tree.depth[nodes[0]]
        if active:
            total = branch_budget(cfg.width, cfg.branch_factor, finished, len(finished_now), len(active))
            # The paths that just finished gave their budget to the survivors (more than their own b each).
            if total > branch_budget(cfg.width, cfg.branch_factor, finished, 0, len(active)):
                self._stats["budget_transfers"] += 1
            if cfg.divergence_policy == "uniform":
                shares = allocate_uniform(total, len(active), self.rng)
            elif cfg.divergence_policy == "entropy":
                shares = allocate_logprob(total, [self._next_entropy(n) for n in active], cfg.entropy_temperature, 1.0)
                self._stats["entropy_branchings"] += int(len(active) > 1)
            else:
                sign = 1.0 if cfg.divergence_policy == "logprob_high" else -1.0
                seg_lp = [sum(self.tree.logprobs[n]) for n in active]  # log-prob of the whole segment
                shares = allocate_logprob(total, seg_lp, cfg.logprob_temperature, sign)
                self._stats["logprob_branchings"] += int(len(active) > 1)
            self.history.append(BudgetStep(depth, finished, len(finished_now), len(active), total, shares))
            # A tree at its width after this round branches no more, but where paths finish (fallback, a transfer).
            stop = cfg.branch_entropy if cfg.branch_point == "entropy" and total + finished < cfg.width else 0.0
            for n, k in zip(active, shares):
                self._ask(n, k, cfg.segment_len, stop, cfg.min_segment_len)
            return
        self.history.append(BudgetStep(depth, finished, len(finished_now), 0, 0, []))
        if finished < cfg.width:
            self._fallback(cfg.width - finished)
        else:
            self._close()

    def fallback_candidates(self) -> list[int]:
        """Finished trajectory ends that fallback may branch from (boxed answer or EOS), oldest first."""
        return [n for n in self._finished if self._holds_box[n] or self.tree.finish[n] in ("boxed", "eos")]

    def _fallback(self, missing: int) -> None:
        candidates = self.fallback_candidates()
        if not candidates:
            point = 0
        elif self.cfg.fallback_policy == "finished_first":
            point = self.tree.parent[candidates[-1]]
        else:
            point = self.tree.parent[candidates[int(self.rng.integers(len(candidates)))]]
        self._stats["fallbacks"] += 1
        self._ask(point, missing, self.cfg.segment_len)
