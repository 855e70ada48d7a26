"""model.path as a local directory (`~` expanded) or a hub id read from a local Hugging Face cache, offline."""

import json

import pytest

from treepo_ray.config import UserError
from treepo_ray.engines.hub import model_context_length, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root, repo_id="acme/tiny-math"):
    """huggingface_hub's cache layout: models--{org}--{name}/refs/main naming a snapshot folder of the files."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 2048}))
    return snapshot


def test_hub_id_resolves_to_the_cached_snapshot_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # any network call would fail
    snapshot = fake_hub_cache(tmp_path / "hub")
    path = resolve_model_path("acme/tiny-math", cache_dir=tmp_path / "hub")
    assert path == str(snapshot) and model_context_length(path) == 2048


def test_a_hub_id_not_in_the_cache_is_one_clear_line(tmp_path):
    with pytest.raises(UserError) as err:
        resolve_model_path("Qwen/Qwen3-0.6B", cache_dir=tmp_path / "hub")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model.path = 'Qwen/Qwen3-0.6B': no such directory, and no such model "
                                              "in the Hugging Face cache")
    assert "hf download Qwen/Qwen3-0.6B" in msg


def test_local_paths(tmp_path, monkeypatch):
    model = tmp_path / "models" / "m"
    model.mkdir(parents=True)
    with pytest.raises(UserError, match="holds no config.json"):
        resolve_model_path(str(model))
    (model / "config.json").write_text("{}")
    assert model_context_length(model) is None
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model_path("~/models/m") == str(model)
    with pytest.raises(UserError, match="'./nope': no such directory$"):
        resolve_model_path("./nope")
    with pytest.raises(UserError, match="is a file"):
        resolve_model_path(str(model / "config.json"))
