"""A learner rank or an engine that Ray gives a GPU torch cannot use stops with one line naming the GPU it was given,
torch's CUDA and the driver, instead of running on the CPU while the weight path still picks NCCL. Here (no GPU) a
local Ray that advertises one GPU hands out GPU 0, which torch cannot use."""

from __future__ import annotations

import pytest
import ray

from treepo_ray.job.config import RuntimeConfig
from treepo_ray.learner import LearnerConfig
from treepo_ray.runtime.engine import EngineActor
from treepo_ray.runtime.learner import LearnerGroup
from treepo_ray.runtime.liveness import ping
from treepo_ray.runtime.weights import WeightSync

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_with_a_gpu():
    ray.init(address="local", num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _one_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if "cannot use CUDA" in line]
    assert lines, str(err)
    return lines[-1]


def test_a_learner_rank_given_a_gpu_it_cannot_use_stops_with_one_line(ray_with_a_gpu, tiny):
    sync = WeightSync(path="broadcast", dtype="float32", backend="nccl", bucket_bytes=1 << 20, timeout_s=5.0)
    with pytest.raises(Exception) as caught:
        LearnerGroup(tiny, LearnerConfig(), RuntimeConfig(learner_gpus=1, learner_cpus=0), sync)
    line = _one_line(caught.value)
    assert "learner rank 0 was given GPU(s) CUDA_VISIBLE_DEVICES=0" in line and "driver:" in line


def test_an_engine_given_a_gpu_it_cannot_use_stops_with_one_line(ray_with_a_gpu, tiny):
    engine = EngineActor.options(num_cpus=0, num_gpus=1).remote("hf", tiny, {}, 1)
    with pytest.raises(ray.exceptions.RayActorError) as caught:
        ray.get(ping(engine), timeout=120)
    assert "engine hf was given GPU(s) CUDA_VISIBLE_DEVICES=0" in _one_line(caught.value)
