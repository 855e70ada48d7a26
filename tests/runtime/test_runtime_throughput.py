"""perf/traj_per_s (the training curve's "trajectories / s" panel) is a batch's trajectories over that batch's own
generation time, also when batches overlap: over the time since the previous batch was done it read 17,500 when a
batch finished right after the one before it."""

import pytest

from treepo_ray.data.prompts import PromptStream
from runtime_testlib import job, small, started, trained

pytestmark = pytest.mark.slow


def test_throughput_is_over_the_batch_generation_time(ray_local, tiny):
    run = job(small(tiny, "runtime.max_staleness=2"))  # batches grow ahead of the learner, side by side
    rt = started(run)
    try:
        rows = trained(rt, 0, 4, PromptStream(run.train_set, 0), trees_logged=0)
    finally:
        rt.supervisor.shutdown()
    for _, m in rows:
        assert m["perf/traj_per_s"] * m["timing_s/gen"] == pytest.approx(m["actor/samples"])
