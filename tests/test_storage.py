"""Run storage (treepo_ray/storage.py) on a local path and through pyarrow.fs (a file:// URI takes the object-store
code path: no rename, one PUT per file, a marker written last)."""

import os

import pytest

from treepo_ray import storage


@pytest.fixture(params=["path", "uri"])
def root(request, tmp_path):
    return str(tmp_path) if request.param == "path" else f"file://{tmp_path}"


def test_relative_paths_become_absolute_once_and_uris_stay(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert storage.absolute("runs") == str(tmp_path / "runs")
    assert storage.absolute("s3://bucket/runs") == "s3://bucket/runs"
    assert storage.join("s3://bucket/runs/", "a", "b") == "s3://bucket/runs/a/b"
    assert storage.name_of("gs://b/runs/treepo-1/") == "treepo-1" and storage.parent_of("gs://b/runs/x") == "gs://b/runs"


def test_files_folders_and_exclusive_creation(root):
    f = storage.join(root, "run", "run.json")
    assert not storage.exists(f) and storage.list_names(storage.join(root, "run")) == []
    storage.write_text(f, "one")
    storage.write_text(f, "two")  # replaced whole
    assert storage.read_text(f) == "two" and storage.list_names(storage.join(root, "run")) == ["run.json"]
    lock = storage.join(root, "run", "run.lock")
    assert storage.create_exclusive(lock, "holder a")
    assert not storage.create_exclusive(lock, "holder b") and storage.read_text(lock) == "holder a"
    storage.delete(lock)
    assert not storage.exists(lock) and storage.is_dir(storage.join(root, "run"))
    storage.delete_dir(storage.join(root, "run"))
    assert not storage.exists(storage.join(root, "run"))


def test_a_folder_counts_once_its_marker_is_committed(root):
    final = storage.join(root, "run", "checkpoint-00000001")
    staging = storage.staging_dir(final)
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "weights.bin").write_bytes(b"\0" * 10)
    (staging / "sub").mkdir()
    (staging / "sub" / "part").write_text("p")
    storage.push(staging, final)
    assert not storage.exists(storage.join(final, "marker"))
    storage.commit(staging, final, "marker", "{}")
    assert storage.list_names(final) == ["marker", "sub", "weights.bin"]
    assert storage.read_text(storage.join(final, "sub", "part")) == "p"
    local, temporary = storage.local_copy(final, ["sub/part", "missing"])
    assert (local / "sub" / "part").read_text() == "p" and temporary == storage.is_uri(final)
    if not temporary:
        assert not os.path.exists(staging)  # renamed into place
