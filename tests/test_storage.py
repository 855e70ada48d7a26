"""Run storage (treepo_ray/storage.py) on a local path and through pyarrow.fs (a file:// URI takes the object-store
code path: no rename, one PUT per file, a marker written last)."""

import concurrent.futures
import os
import threading

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


def test_of_callers_racing_to_create_one_name_exactly_one_wins(root):
    """create_exclusive, the run lock's primitive: 8 threads race for each of 30 names; exactly one creates each, and
    the file holds the winner's whole text."""
    names = [storage.join(root, "race", f"run.lock.{k:08d}") for k in range(30)]
    barrier = threading.Barrier(8)

    def contender(i: int) -> list[str]:
        won = []
        for name in names:
            barrier.wait()
            if storage.create_exclusive(name, f"holder {i} " + "x" * 4096):
                won.append(name)
        return won

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        winners = [(i, name) for i, won in enumerate(pool.map(contender, range(8))) for name in won]
    assert sorted(name for _, name in winners) == names
    for i, name in winners:
        assert storage.read_text(name) == f"holder {i} " + "x" * 4096
    assert storage.list_names(storage.join(root, "race")) == [storage.name_of(n) for n in names]  # no temporaries


def test_a_store_without_an_atomic_create_is_refused():
    with pytest.raises(storage.UnsupportedStorage, match="mock:// storage has no atomic create-if-absent"):
        storage.create_exclusive("mock://bucket/run/run.lock.00000001", "holder")
