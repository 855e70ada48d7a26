"""A run whose every step trains on nothing (a reward function that always returns 0: every group's rewards are
equal, dynamic sampling drops them all) still leaves what the model wrote: trees.jsonl, samples.jsonl and a
`treepo-ray viz` page (issue 45, item 5). Real local Ray, the tiny model."""

import json
import textwrap

import pytest

from treepo_ray.job.viz import main as viz_main
from treepo_ray.runtime.train import main as train_main
from treepo_ray.tree.tree import FINISH_REASONS
from runtime_testlib import small

pytestmark = pytest.mark.slow

ZERO = textwrap.dedent('''
    def zero(data_source, solution_str, ground_truth, extra_info=None):
        return 0.0
''')


def test_a_run_whose_every_step_is_skipped_still_writes_its_trees_and_answers(ray_local, tiny, tmp_path):
    (tmp_path / "zero.py").write_text(ZERO)
    run = tmp_path / "run"
    assert train_main(small(tiny, f"trainer.run_dir={run}", "trainer.steps=2", "trainer.eval_size=2",
                            "algo.dynamic_sampling=true", "algo.max_extra_rounds=0", "log.trees_per_step=2",
                            f"custom_reward_function.path={tmp_path / 'zero.py'}",
                            "custom_reward_function.name=zero")) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("actor/skipped") == 1.0] == [1, 2]  # every step trained on nothing
    trees = [json.loads(line) for line in (run / "trees.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trees] == [1, 1, 2, 2]
    assert all(t["trained"] is False and t["texts"] and t["prompt_text"] for t in trees)
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["query_id"]) for s in samples] == [(t["step"], t["query_id"]) for t in trees]
    for s, t in zip(samples, trees):
        assert s["prompt"] == t["prompt_text"] and s["trained"] is False
        assert 1 <= len(s["answers"]) <= 4
        assert all(a["reward"] == 0.0 and a["finish"] in FINISH_REASONS for a in s["answers"])
        assert any(a["text"] for a in s["answers"])  # what the model wrote, decoded
    assert viz_main([str(run)]) == 0
    assert "not trained" in (run / "trees.html").read_text()
