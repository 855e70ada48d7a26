"""The asynchronous loop (runtime/pipeline.py) on a real local Ray with a real (random) tiny model: rollout and
learning overlap within the staleness bound, and DAPO refills a batch until it holds mixed groups only."""

import pytest

from treepo_ray.data.prompts import PromptStream
from treepo_ray.runtime.pipeline import Pipeline
from runtime_testlib import job, small

pytestmark = pytest.mark.slow


def test_pipeline_overlaps_within_the_staleness_bound_and_dapo_refills(ray_local, tiny):
    run = job(small(tiny, "runtime.max_staleness=1"))
    pipe = Pipeline(run.cfg, run.model_path, run.tokenizer)
    rows = []
    try:
        done = pipe.train(0, 4, PromptStream(run.train_set, 0), lambda batch, m: rows.append((batch, m)) or True)
        assert done == 4
        # Batch 0 is grown with the initial weights, batch 1 while the learner trains on batch 0 (so one version
        # behind), and no batch is ever more than max_staleness = 1 versions behind the learner.
        versions = [b.version for b, _ in rows]
        assert versions[:2] == [0, 0] and versions == sorted(versions)
        assert [m["perf/staleness"] for _, m in rows][:2] == [0, 1]
        assert all(0 <= m["perf/staleness"] <= 1 for _, m in rows)
        assert all(m["actor/samples"] == 16 and m["actor/skipped"] == 0 for _, m in rows)
        assert all(m["tree/forward_tokens"] > 0 and 0 < m["tree/forward_per_unique"] for _, m in rows)
        assert [b.data_position for b, _ in rows] == [4, 8, 12, 16]
        # The weights that grew the last batch, which the pool owns and every engine runs.
        assert pipe.pool.weights_version == versions[-1]
        assert {s["weights_version"] for s in pipe.pool.stats()} == {versions[-1]}
        assert pipe.learner.published[0] == 4  # published after the last step, for the next sync
    finally:
        pipe.shutdown()

    # DAPO: sequential sampling, synchronous, over-sample 2x and refill until the batch holds mixed groups only.
    run = job(small(tiny, "algo.name=dapo", "algo.dynamic_sampling=true", "algo.oversample=2",
                    "algo.max_extra_rounds=1", "runtime.max_staleness=0"))
    pipe = Pipeline(run.cfg, run.model_path, run.tokenizer)
    try:
        stream = PromptStream(run.train_set, 0)
        batch = pipe.make_batch(0, stream, num_trees_logged=2)
        m = batch.metrics
        assert m["rollout/kept_prompts"] <= 4 and batch.num_samples == 4 * m["rollout/kept_prompts"]
        rounds = int(m["rollout/rounds"])
        assert stream.position == batch.data_position and 8 <= stream.position <= 8 + 8 * (rounds - 1)
        assert all(len(set(t["reward"][n] for n in t["trajectories"])) == 2 for t in batch.trees)
    finally:
        pipe.shutdown()
