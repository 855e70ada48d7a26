"""Shared test set-up.

Markers: a test that starts Ray or loads a model (the tiny one included) is `slow`; `pytest -m "not slow"` runs
everything else (pure Python, numpy and torch tensors without a model) in well under a minute.

Fixtures: `tiny_model(**shape)` builds the tiny Qwen2 of engines/tiny.py offline, once per shape per session;
`model_dir` is a model folder with only its tokenizer and config (what is read before anything slow); `ray_local` is
one real local Ray per test module (starting one takes seconds).
"""

import os

# Local Ray for tests as for every command (runtime/cluster.py init_ray): on 127.0.0.1 only (set before anything
# imports Ray: Ray reads it then) and with Ray's token authentication; no usage reporting, no W&B network.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

# The shape most tests use: one layer, fast to sample and to train.
ONE_LAYER = dict(hidden_size=64, intermediate_size=128, num_layers=1, max_positions=256)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(**shape) -> str`: the path of a tiny Qwen2 with TinyModelConfig(**shape) (default: ONE_LAYER),
    built once per distinct shape in this session."""
    from treepo_ray.engines.tiny import TinyModelConfig, build_tiny_model

    built: dict[tuple, str] = {}

    def make(**shape) -> str:
        shape = shape or ONE_LAYER
        key = tuple(sorted(shape.items()))
        if key not in built:
            built[key] = str(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", TinyModelConfig(**shape)))
        return built[key]

    return make


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """The one-layer tiny model's path."""
    return tiny_model()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A model folder with the tiny tokenizer and a config.json only: all a command reads of a model before anything
    slow (so a bad input is refused without loading weights)."""
    import json

    from treepo_ray.engines.tiny import build_tokenizer

    model = tmp_path_factory.mktemp("model")
    build_tokenizer().save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 1024}))
    return model


@pytest.fixture(scope="module")
def ray_local():
    """One real local Ray per test module."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # never a cluster left running
    yield
    ray.shutdown()
