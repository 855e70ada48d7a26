"""A verl user's job, unchanged: a verl-layout dataset (two parquet files whose extra_info.index collide, gsm8k `####`
and boxed-math rows), a custom reward function given by path, verl's key names, through `treepo-ray train` and
`treepo-ray eval` on the tiny model; and correct answers score 1 by every route a reward takes."""

import json
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

from treepo_ray.cli import main
from treepo_ray.data.evaluate import score_answers
from treepo_ray.data.prompts import Prompt
from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.rewards import BatchScorer, default_compute_score
from treepo_ray.runtime.registry import RuntimeRegistry
from treepo_ray.runtime.verifier import VerifierPool
from runtime_testlib import CACHE

pytestmark = pytest.mark.slow

GSM8K = [("Natalia sold 48 clips in April and half as many in May. How many in all?", "72"),
         ("Weng earns $12 an hour. How much for 50 minutes of babysitting?", "10")]
MATH = [(r"What is $\frac{1}{2} + \frac{1}{4}$?", r"\frac{3}{4}"), ("Solve $2x = 10$.", "5")]

REWARD = textwrap.dedent('''
    import json
    from treepo_ray.rewards import default_compute_score

    def my_score(data_source, solution_str, ground_truth, extra_info=None, log=""):
        with open(log, "a") as f:
            f.write(json.dumps({"data_source": data_source, "ground_truth": ground_truth,
                                "extra_info": extra_info}) + "\\n")
        result = default_compute_score(data_source, solution_str, ground_truth, extra_info)
        return {"score": result["score"], "acc": result["acc"], "pred": result["pred"]}
''')


def verl_rows(problems, source, split):
    """Rows as verl's examples/data_preprocess write them: chat prompt, reward_model, extra_info.index from 0."""
    return [{"data_source": source, "prompt": [{"role": "user", "content": q}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a}, "extra_info": {"split": split, "index": i}}
            for i, (q, a) in enumerate(problems)]


@pytest.fixture(scope="module")
def verl_job(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("verl")
    files = {}
    for split in ("train", "test"):
        for name, problems, source in (("gsm8k", GSM8K, "openai/gsm8k"), ("math", MATH, "lighteval/MATH")):
            files[split, name] = root / split / f"{name}.parquet"
            files[split, name].parent.mkdir(exist_ok=True)
            pq.write_table(pa.Table.from_pylist(verl_rows(problems, source, split)), files[split, name])
    (root / "my_reward.py").write_text(REWARD)
    log = root / "calls.jsonl"
    keys = [f"data.train_files=[{files['train', 'gsm8k']},{files['train', 'math']}]",
            f"data.val_files=[{files['test', 'gsm8k']},{files['test', 'math']}]",
            "data.prompt_key=prompt", "data.reward_fn_key=data_source",
            f"custom_reward_function.path={root / 'my_reward.py'}", "custom_reward_function.name=my_score",
            f"custom_reward_function.reward_kwargs={{log: {log}}}",
            f"model.path={tiny}", f"model.cache_dir={CACHE}",
            "rollout.treepo.width=4", "rollout.treepo.init_divergence_min=2", "rollout.treepo.init_divergence_max=4", "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8",
            "rollout.treepo.max_response_len=0", "rollout.treepo.max_total_len=0",  # limits of these sizes
            "rollout.sequential.max_response_len=0", "rollout.sequential.max_total_len=0",
            "algo.dynamic_sampling=false", "trainer.prompts_per_step=4", "log.wandb=false"]
    return root, keys, log


def test_train_and_eval_run_a_verl_job_with_verls_keys(verl_job, ray_local, capsys):
    root, keys, log = verl_job
    run = root / "run"
    assert main(["train", *keys, f"trainer.run_dir={run}", "trainer.steps=2", "trainer.eval_every=0",
                 "trainer.eval_samples=3"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["eval_problems"] == 4
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"val-core/openai/gsm8k/acc/mean@3", "val-core/lighteval/MATH/acc/mean@3"} <= set().union(*rows)
    # The run's rewards came from the custom function, called with both files' rows and their extra_info.
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert {(c["data_source"], c["extra_info"]["split"], c["extra_info"]["index"]) for c in calls} == {
        (s, split, i) for s in ("openai/gsm8k", "lighteval/MATH") for split in ("train", "test") for i in (0, 1)}
    assert "resolved config:" in capsys.readouterr().out

    out = root / "eval"
    assert main(["eval", *keys, "trainer.eval_samples=2", "eval.k=[1,2]", f"eval.out={out}"]) == 0
    metrics = json.loads((out / "eval.json").read_text())["metrics"]
    assert metrics["overall/problems"] == 4 and {"openai/gsm8k/pass@1", "lighteval/MATH/pass@2"} <= set(metrics)


def test_a_reward_function_that_always_fails_stops_the_run_naming_its_error(verl_job, ray_local, capsys):
    root, keys, _ = verl_job
    broken = root / "broken_reward.py"
    broken.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None, log=''):\n"
                      "    return 1 / 0\n")
    keys = [k for k in keys if not k.startswith("custom_reward_function.path=")]
    run = root / "broken-run"
    assert main(["train", *keys, f"custom_reward_function.path={broken}", f"trainer.run_dir={run}",
                 "trainer.steps=2", "trainer.eval_every=0", "trainer.eval_size=0"]) == 1
    err = capsys.readouterr().err
    stopped = [line for line in err.splitlines() if line.startswith("treepo-ray train: stopped:")]
    assert len(stopped) == 1 and "have no reward" in stopped[0] and "max_verify_failed_share" in stopped[0]
    assert "the first: error: ZeroDivisionError: division by zero (broken_reward.py:2)" in stopped[0]
    trained = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    assert not any("actor/pg_loss" in row for row in trained)  # nothing was trained on it


def test_correct_answers_score_1_by_every_route(verl_job, ray_local):
    root, keys, _ = verl_job
    cfg = load_config(DEFAULT_CONFIG, keys)
    right = [("openai/gsm8k", "48 / 2 = 24 and 48 + 24 = 72.\n#### 72", "72", {"index": 0}),
             ("lighteval/MATH", r"The sum is $\boxed{\dfrac{3}{4}}$.", r"\frac{3}{4}", {"index": 0}),
             ("lighteval/MATH", r"So $x = \boxed{5.0}$", "5", {"index": 1}),
             ("lighteval/MATH", r"The area is $\boxed{14}$.", "E", {"options": ["(A) 6", "(B) 8", "(C) 10", "(D) 12",
                                                                                    "(E) 14"]})]
    wrong = [("openai/gsm8k", "#### 71", "72", {}), ("lighteval/MATH", r"\boxed{4}", "5", {}),
             ("lighteval/MATH", r"\boxed{12}", "E", {"options": {"D": "12", "E": "14"}})]
    scores = [1.0] * len(right) + [0.0] * len(wrong)
    # 1. the built-in scorers, as verl's default_compute_score is called (a multiple-choice row's options in extra_info)
    assert [default_compute_score(*item)["score"] for item in right + wrong] == scores
    # 2. the custom function in bounded worker processes (the eval command's scorer)
    with BatchScorer(timeout_s=cfg.runtime.verifier_timeout_s, reward_function=cfg.custom_reward_function) as s:
        assert s.score_batch(right + wrong) == scores
        records = [Prompt(f"p{i}", (1,), gt, source, extra_info=extra)
                   for i, (source, _, gt, extra) in enumerate(right)]
        scored = score_answers(records, [[text] for _, text, _, _ in right], s)
        assert [p["correct"] for p in scored] == [[1.0]] * len(right)
    # 3. the training job's verifier actors on Ray (what the schedulers and the held-out evaluation call)
    pool = VerifierPool.start(cfg.runtime, RuntimeRegistry.remote(), cfg.custom_reward_function)
    try:
        assert ray.get(pool.score(right + wrong)) == scores
    finally:
        for actor in pool.actors():
            ray.kill(actor)
