"""CATPO phase 3: critique-guided healing of dead-wrong trees (CATPO section 3.3 and Algorithm 1, lines 5-10).

For a tree whose leaves (almost) all fail: find by breadth-first search the shallowest node whose children all have
propagated reward below epsilon, ask the policy itself for a critique of the partial solution up to that node, ask
it for k corrected continuations given problem, partial solution and critique, and graft them as new children of
that node. The grafted segments are then scored, rewards re-propagated and F(T) recomputed by the caller's scorer.

Log-probs of grafted nodes: the tokens were sampled under the critique prompt, but they are trained as a
continuation of the ORIGINAL prefix (the critique is not part of the tree), so the log-probs stored on a grafted
node are those of its tokens given the original prefix under the current policy, computed by `logprob_fn`. This
keeps F(T)'s log-prob/reward correlation and the PPO ratio about the same conditional distribution as every other
node. (The learner recomputes old log-probs for the PPO ratio in any case.)
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from treepo_ray.algo.catpo import HealingConfig
from treepo_ray.engines.base import SamplingParams, SegmentRequest, SegmentResult
from treepo_ray.engines.decode import safe_decode
from treepo_ray.tree.tree import Tree

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.yaml")


@dataclass
class HealResult:
    """What one healing attempt did and cost."""

    failure_node: int | None
    """The node the continuations were grafted under (None: no failure point, nothing done)."""
    grafted: list[int] = field(default_factory=list)
    """Node ids of the grafted segments (each ends a new trajectory)."""
    critique: str = ""
    prompt_tokens: int = 0
    """Tokens of the critique and refinement prompts (prefill cost)."""
    generated_tokens: int = 0
    """Tokens sampled for the critique and the continuations (before truncation)."""
    rewards: list[float] = field(default_factory=list)
    """Verifier reward of each grafted trajectory, in the order of `grafted`."""


def find_failure_node(tree: Tree, epsilon: float = 0.05) -> int | None:
    """Breadth-first from the root: the first node with children whose children all have reward < epsilon.

    Children whose subtree carries no reward (NaN: no trajectory below them) do not count; a node needs at least
    one rewarded child. Returns None when no node qualifies.
    """
    children: dict[int, list[int]] = {}
    for node in range(1, len(tree)):
        children.setdefault(tree.parent[node], []).append(node)
    queue = deque([0])
    while queue:
        node = queue.popleft()
        kids = [c for c in children.get(node, []) if tree.reward[c] == tree.reward[c]]  # skip NaN
        if kids and all(tree.reward[c] < epsilon for c in kids):
            return node
        queue.extend(children.get(node, []))
    return None


def load_prompts(path: str = "") -> dict[str, dict[str, str]]:
    """data_source -> its templates {critique, refine[, critique_stop]}; `default` serves every other source. A file
    holding one set at its top level serves every source with it."""
    where = path or DEFAULT_PROMPTS
    prompts = yaml.safe_load(Path(where).read_text()) or {}
    sets = {"default": prompts} if "critique" in prompts or "refine" in prompts else prompts
    for source, templates in sets.items():
        missing = {"critique", "refine"} - set(templates or {})
        if missing:
            raise ValueError(f"healing prompts file {where}: {source!r} lacks {sorted(missing)}")
    return sets


class CritiqueHealer:
    """Heals dead-wrong trees with the policy's own critique; generation goes through `generate`.

    generate: runs segment requests to completion (an engine locally, the generator pool in the runtime).
    logprob_fn(prefix_ids, token_ids) -> log-probs of token_ids given prefix_ids under the current policy.
    score_fn(tree, node) -> reward of the trajectory ending at node.
    """

    def __init__(
        self,
        tokenizer,
        generate: Callable[[list[SegmentRequest]], list[SegmentResult]],
        logprob_fn: Callable[[list[int], list[int]], list[float]],
        score_fn: Callable[[Tree, int], float],
        cfg: HealingConfig,
    ):
        self.tokenizer, self.generate, self.logprob_fn, self.score_fn, self.cfg = (
            tokenizer, generate, logprob_fn, score_fn, cfg,
        )
        if cfg.step_len < 1:
            raise ValueError(f"HealingConfig.step_len = {cfg.step_len}; set it to the tree's step length (>= 1)")
        if cfg.num_refinements < 1:
            raise ValueError(f"HealingConfig.num_refinements = {cfg.num_refinements}; it must be >= 1")
        self.prompts = load_prompts(cfg.prompts_path)

    def _sample(self, text: str, n: int, temperature: float, max_tokens: int, seed: int, tag: str) -> SegmentResult:
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(temperature=temperature, seed=seed)
        (result,) = self.generate([SegmentRequest(tag, ids, max_tokens, n=n, params=params)])
        return result

    def templates(self, tree: Tree) -> dict[str, str]:
        """The prompt set of the tree's data source (its task's own critique format), else `default`."""
        source = tree.meta.get("data_source", "")
        if source not in self.prompts and "default" not in self.prompts:
            raise ValueError(f"healing prompts have no set for data source {source!r} and no 'default'")
        return self.prompts.get(source, self.prompts.get("default"))

    def heal(self, tree: Tree, seed: int = 0) -> HealResult:
        """Graft k critique-guided continuations under the tree's failure node; rewards re-propagated in place."""
        cfg, tok = self.cfg, self.tokenizer
        node = find_failure_node(tree, cfg.epsilon)
        out = HealResult(failure_node=node)
        if node is None:
            return out
        templates = self.templates(tree)
        problem = safe_decode(tok, tree.prompt_ids, skip_special_tokens=True)
        partial = safe_decode(tok, tree.response_ids(node), skip_special_tokens=True)
        critique_prompt = templates["critique"].format(problem=problem, partial=partial)
        crit = self._sample(critique_prompt, 1, cfg.critique_temperature, cfg.critique_max_tokens, seed,
                            f"{tree.query_id}/critique")
        out.critique = safe_decode(tok, crit.children[0].token_ids, skip_special_tokens=True)
        if templates.get("critique_stop"):  # a one-line critique format: what follows is not the critique
            out.critique = out.critique.split(templates["critique_stop"])[0]
        out.critique = out.critique.strip()
        refine_prompt = templates["refine"].format(problem=problem, partial=partial, critique=out.critique)
        refined = self._sample(refine_prompt, cfg.num_refinements, cfg.refine_temperature, cfg.step_len, seed + 1,
                               f"{tree.query_id}/refine")
        out.prompt_tokens = len(tok.encode(critique_prompt, add_special_tokens=False)) + len(
            tok.encode(refine_prompt, add_special_tokens=False))
        out.generated_tokens = len(crit.children[0].token_ids) + sum(len(c.token_ids) for c in refined.children)

        prefix = tree.prefix_ids(node)
        for child in refined.children:
            ids = child.token_ids[: cfg.step_len]
            if not ids:
                continue
            finish = "eos" if ids[-1] == tok.eos_token_id else "max_length"
            grafted = tree.add_node(node, ids, self.logprob_fn(prefix, ids), finish)
            tree.trajectories.append(grafted)
            out.grafted.append(grafted)
        for grafted in out.grafted:
            tree.reward[grafted] = float(self.score_fn(tree, grafted))
            out.rewards.append(tree.reward[grafted])
        tree.meta.setdefault("grafted", []).extend(out.grafted)
        tree.propagate_rewards()
        return out
