"""Reward routing: each row to its scorer, as verl's `default_compute_score` picks one by `data_source`.

    openai/gsm8k                                    `#### <number>`, exact (rewards/gsm8k.py), in-process
    MATH, DAPO-17k (math_dapo), AIME, NuminaMath…   last `\\boxed{}`, math-verify in bounded workers (rewards/math.py)
    the synthetic tasks                             exact boxed integer (rewards/synthetic.py), in-process
    anything else                                   no built-in scorer: an error when the data loads

With `custom_reward_function.path` set, the user's function scores every row instead (rewards/custom.py). Built-in
scores share one scale: `correct_score` for a right answer, `wrong_score` otherwise. A ground truth may be a list of
acceptable answers (any one matching is right). A boxed-math row whose ground truth is a letter A-E is multiple choice:
`extra_info["options"]` (a dict by letter, or a list in letter order) lets the option's text count as the letter.
"""

from __future__ import annotations


import treepo_ray.rewards.gsm8k as gsm8k
import treepo_ray.rewards.synthetic as synthetic
from treepo_ray.rewards.custom import FunctionScorer, RewardFunctionConfig
from treepo_ray.rewards.forms import options_of
from treepo_ray.rewards.math import MathVerifier, MathVerifyConfig, compute_score

EXACT_SOURCES = {**{source: synthetic.score for source in synthetic.DATA_SOURCES}, "openai/gsm8k": gsm8k.score}
"""data_source -> an in-process exact scorer (solution, ground truth) -> {"score", "acc", "pred"} with score 1/0."""
MATH_SOURCES = frozenset({
    "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
    "math_dapo", "math_dapo_reasoning", "BytedTsinghua-SIA/DAPO-Math-17k",
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads",
})
"""data_sources scored by the boxed-answer math verifier (verl's MATH, math_dapo and prime_math sources)."""
MATH_PREFIXES = ("aime",)
"""Any data_source starting with one of these is boxed math too (aime24, aime_2025, ...)."""

Item = tuple  # (data_source, solution, ground_truth) or (data_source, solution, ground_truth, extra_info)


def scorer_of(data_source: str) -> str | None:
    """'exact', 'math' or None (no built-in scorer) for a data source."""
    if data_source in EXACT_SOURCES:
        return "exact"
    if data_source in MATH_SOURCES or data_source.startswith(MATH_PREFIXES):
        return "math"
    return None


def check_row(data_source: str, ground_truth) -> None:
    """ValueError when the built-in scorers cannot score a row: an unknown data source, or a ground truth that is
    not a string, a number or a list of them (a dict needs custom_reward_function)."""
    if scorer_of(data_source) is None:
        raise ValueError(f"data_source {data_source!r} has no built-in scorer (built in: "
                         f"{', '.join(sorted(EXACT_SOURCES))}, boxed math such as 'lighteval/MATH', 'math_dapo', "
                         f"'aime*'); set custom_reward_function.path to score it")
    for gt in _answers(ground_truth):
        if isinstance(gt, bool) or not isinstance(gt, (str, int, float)):
            raise ValueError(f"a ground truth of type {type(gt).__name__} needs custom_reward_function (the "
                             f"built-in scorers take a string, a number or a list of them)")


def _answers(ground_truth) -> list:
    return list(ground_truth) if isinstance(ground_truth, (list, tuple)) else [ground_truth]


def _rescale(result: dict, cfg: MathVerifyConfig) -> dict:
    ok = result["acc"] == 1.0
    return {**result, "score": float(cfg.correct_score if ok else cfg.wrong_score)}


def _best(results: list[dict]) -> dict:
    """Of the results of one solution against each acceptable answer: the first right one, else the first without a
    verdict (a right answer may hide behind it), else the first."""
    return next((r for r in results if r["acc"] == 1.0), next((r for r in results if "failed" in r), results[0]))


def score(data_source: str, solution: str, ground_truth, cfg: MathVerifyConfig | None = None,
          extra_info: dict | None = None) -> dict:
    """{"score", "acc", "pred"} of one solution, judged by the built-in scorer of its data source."""
    cfg = cfg or MathVerifyConfig()
    check_row(data_source, ground_truth)
    exact = EXACT_SOURCES.get(data_source)
    if exact is not None:
        return _rescale(_best([exact(solution, gt) for gt in _answers(ground_truth)]), cfg)
    options = options_of(extra_info) or None
    return _best([compute_score(solution, gt, cfg, options) for gt in _answers(ground_truth)])


def default_compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None) -> dict:
    """verl's `default_compute_score` for treepo-ray's built-in scorers: {"score", "acc", "pred"}, score 1.0 for a
    right answer and 0.0 otherwise. Raises ValueError for a data source without a built-in scorer. A custom reward
    function can call it for the sources it does not handle itself; `extra_info` gives a multiple-choice row's
    options."""
    return score(data_source, solution_str, ground_truth, extra_info=extra_info)


class BatchScorer:
    """Scores batches of (data_source, solution, ground_truth[, extra_info]) items: with the custom reward function
    when one is configured, else by data source (one math verifier pool); close() when done."""

    def __init__(self, timeout_s: float | None = None, cfg: MathVerifyConfig | None = None,
                 reward_function: RewardFunctionConfig | None = None):
        """`timeout_s` overrides cfg.timeout_s (the per-solution limit of the math verifier and of the custom
        function, which also runs under cfg.memory_mb)."""
        cfg = cfg or MathVerifyConfig()
        if timeout_s is not None:
            cfg = MathVerifyConfig(**{**cfg.__dict__, "timeout_s": float(timeout_s)})
        self.cfg = cfg
        self.reward_function = reward_function if reward_function is not None and reward_function.enabled else None
        self._math: MathVerifier | None = None  # started on the first math item: synthetic-only runs need none
        self._function: FunctionScorer | None = None

    def score_details(self, items: list[Item]) -> list[dict]:
        """{"score", "acc", "pred"} of each item, in order, plus "failed" ("error", "timeout" or "nonfinite") and
        "error" (why) where no reward could be computed: such an item is not a wrong answer (its acc is 0 for
        accuracy counts, and the training run leaves it out of the loss)."""
        for i, item in enumerate(items):
            if len(item) not in (3, 4):
                raise ValueError(f"item {i} must be (data_source, solution, ground_truth[, extra_info]), "
                                 f"got {len(item)} fields")
        if self.reward_function is not None:
            return self._custom(items)
        out: list[dict | None] = [None] * len(items)
        math_jobs: list[tuple[int, str, object, dict | None]] = []  # (item, solution, one acceptable answer, options)
        for i, (source, solution, gt, *extra) in enumerate(items):
            check_row(source, gt)
            exact = EXACT_SOURCES.get(source)
            if exact is not None:
                out[i] = _rescale(_best([exact(solution, g) for g in _answers(gt)]), self.cfg)
            else:
                options = options_of(extra[0] if extra else None) or None
                math_jobs += [(i, solution, g, options) for g in _answers(gt)]
        if math_jobs:
            if self._math is None:
                self._math = MathVerifier(self.cfg)
            results = self._math.score_batch([job[1] for job in math_jobs], [job[2] for job in math_jobs],
                                             [job[3] for job in math_jobs])
            per_item: dict[int, list[dict]] = {}
            for (i, *_), r in zip(math_jobs, results):
                per_item.setdefault(i, []).append(r)
            for i, rs in per_item.items():
                out[i] = _best(rs)
        return out  # type: ignore[return-value]

    def _custom(self, items: list[Item]) -> list[dict]:
        if self._function is None:
            self._function = FunctionScorer(self.reward_function, self.cfg.num_workers, self.cfg.memory_mb,
                                            self.cfg.timeout_s)
        calls = [(it[0], it[1], it[2], dict(it[3]) if len(it) == 4 and it[3] else {}) for it in items]
        out = []
        for got in self._function.score(calls):
            if "failed" in got:
                out.append({"score": float(self.cfg.wrong_score), "acc": 0.0, "pred": "", **got})
                continue
            acc = got.get("acc", 1.0 if got["score"] >= self.cfg.correct_score else 0.0)
            out.append({"score": got["score"], "acc": float(acc), "pred": got.get("pred", "")})
        return out

    def score_batch(self, items: list[Item]) -> list[float | None]:
        """The score of each item, in order; None where no reward could be computed."""
        return [None if "failed" in r else r["score"] for r in self.score_details(items)]

    @property
    def function_errors(self) -> int:
        """Items the custom reward function failed on so far (no reward)."""
        return self._function.errors if self._function is not None else 0

    def close(self) -> None:
        for scorer in (self._math, self._function):
            if scorer is not None:
                scorer.close()
        self._math = self._function = None

    def __enter__(self) -> "BatchScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
