import pytest
import ray

from treepo_ray.engines.tiny import TinyModelConfig, build_tiny_model


@pytest.fixture(scope="module")
def ray_local():
    """One real local Ray per test module (starting one takes seconds)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random one-layer tiny Qwen2 (fast to train and sample); a module may override it."""
    cfg = TinyModelConfig(hidden_size=64, intermediate_size=128, num_layers=1, max_positions=256)
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", cfg))
