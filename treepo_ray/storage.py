"""Run storage: the one place run directories and checkpoints live (trainer.storage_path), reachable from every node.

A location is a string: a local path (a directory of this machine, or a shared mount every node sees at the same
path), or a URI that pyarrow.fs opens (s3://bucket/prefix, gs://bucket/prefix, file:///abs/path, ...). A relative
local path is made absolute once, on the driver (`absolute`), before any other process sees it: each node would
resolve it in its own working directory.

What a write guarantees:
- local paths: a file is written under a temporary name, fsynced and renamed into place, and its folder fsynced
  (`write_bytes`); a folder is built in a staging folder beside its final name, fsynced file by file, and renamed
  into place whole (`staging_dir` / `push` / `commit`).
- URIs (object stores): there is no rename, but one object PUT is atomic. A folder is uploaded file by file, and the
  marker file written last by `commit` is what makes it exist for readers (who look for the marker).
- `create_exclusive` (the run lock's one primitive): of callers racing to create one name, exactly one wins, on
  every kind of storage (a hard link locally, a conditional PUT on object stores); no check-then-write anywhere.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import tempfile
from pathlib import Path


def is_uri(location: str | os.PathLike) -> bool:
    return "://" in str(location)


def absolute(location: str | os.PathLike) -> str:
    """`location` with a local path made absolute (in this process's working directory); URIs unchanged."""
    location = str(location)
    return location if is_uri(location) else os.path.abspath(location)


def join(location: str | os.PathLike, *parts: str) -> str:
    location = str(location)
    if is_uri(location):
        return "/".join([location.rstrip("/"), *parts])
    return os.path.join(location, *parts)


def name_of(location: str | os.PathLike) -> str:
    """The last component of `location` (a run's or a checkpoint's name)."""
    return str(location).rstrip("/").rsplit("/", 1)[-1]


def parent_of(location: str | os.PathLike) -> str:
    location = str(location).rstrip("/")
    return location.rsplit("/", 1)[0] if is_uri(location) else os.path.dirname(location)


def _arrow(uri: str):
    from pyarrow import fs

    return fs.FileSystem.from_uri(uri)  # (filesystem, path inside it)


# ---------------------------------------------------------------------------------------------- files


def exists(location: str) -> bool:
    if not is_uri(location):
        return os.path.exists(location)
    from pyarrow import fs

    filesystem, path = _arrow(location)
    return filesystem.get_file_info(path).type != fs.FileType.NotFound


def is_dir(location: str) -> bool:
    if not is_uri(location):
        return os.path.isdir(location)
    from pyarrow import fs

    filesystem, path = _arrow(location)
    return filesystem.get_file_info(path).type == fs.FileType.Directory


def list_names(location: str) -> list[str]:
    """Names of the entries directly inside `location` (empty when it does not exist)."""
    if not is_uri(location):
        return sorted(os.listdir(location)) if os.path.isdir(location) else []
    from pyarrow import fs

    filesystem, path = _arrow(location)
    if filesystem.get_file_info(path).type != fs.FileType.Directory:
        return []
    infos = filesystem.get_file_info(fs.FileSelector(path, allow_not_found=True))
    return sorted(name_of(info.path) for info in infos)


def read_bytes(location: str) -> bytes:
    if not is_uri(location):
        return Path(location).read_bytes()
    filesystem, path = _arrow(location)
    with filesystem.open_input_stream(path) as f:
        return f.read()


def read_text(location: str) -> str:
    return read_bytes(location).decode()


def write_bytes(location: str, data: bytes) -> None:
    """Write a whole file durably and atomically: a reader sees the old content or the new, never a mix."""
    if is_uri(location):
        filesystem, path = _arrow(location)
        filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
        with filesystem.open_output_stream(path) as f:  # one PUT: atomic on object stores
            f.write(data)
        return
    tmp = _synced_temp(location, data)
    try:
        os.replace(tmp, location)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(os.path.dirname(location) or ".")


def write_text(location: str, text: str) -> None:
    write_bytes(location, text.encode())


class UnsupportedStorage(ValueError):
    """The storage cannot do what the run needs (an atomic create-if-absent, for the run lock)."""


def create_exclusive(location: str, text: str) -> bool:
    """Create the file `location` holding `text` unless it exists; True if this call created it. Of racing callers
    exactly one wins, and no reader sees the name before its whole text. Local paths (and file:// URIs): a
    temporary file fsynced, then hard-linked to the name (link fails when the name exists). Object stores: one
    conditional PUT, which the store refuses when the object exists (s3://: If-None-Match: *, through botocore;
    gs://: ifGenerationMatch=0, through google-auth). Other stores raise UnsupportedStorage."""
    scheme = location.split("://", 1)[0] if is_uri(location) else ""
    if scheme in ("", "file"):
        return _link_exclusive(_arrow(location)[1] if scheme else location, text.encode())
    if scheme == "s3":
        return _s3_create(location, text.encode())
    if scheme == "gs":
        return _gcs_create(location, text.encode())
    raise UnsupportedStorage(f"{location}: {scheme}:// storage has no atomic create-if-absent here (the run "
                             "directory's lock needs one); use a local or shared path, s3:// or gs://")


def _synced_temp(path: str, data: bytes) -> str:
    """A temporary file beside `path` (its folder made if missing) holding `data`, fsynced: what goes into place."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def _link_exclusive(path: str, data: bytes) -> bool:
    folder = os.path.dirname(path) or "."
    tmp = _synced_temp(path, data)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as err:  # a file system without hard links (some FUSE mounts): O_EXCL, then the text
            if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            return _excl_create(path, data)
    finally:
        Path(tmp).unlink(missing_ok=True)
    fsync_dir(folder)
    return True


def _excl_create(path: str, data: bytes) -> bool:
    """O_CREAT|O_EXCL: one racing caller wins, but a reader may see the name empty for a moment."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(os.path.dirname(path) or ".")
    return True


def _bucket_and_key(location: str) -> tuple[str, str]:
    bucket, _, key = location.split("://", 1)[1].partition("/")
    return bucket, key


@functools.lru_cache(maxsize=1)
def _s3_client():
    """botocore's S3 client, configured as pyarrow's is: the AWS_* environment and config files (AWS_ENDPOINT_URL
    for an S3-compatible store)."""
    try:
        import botocore.session
    except ImportError as err:
        raise UnsupportedStorage("s3:// run storage needs botocore for the run lock's conditional write: "
                                 "pip install botocore") from err
    return botocore.session.get_session().create_client("s3")


def _s3_create(location: str, data: bytes) -> bool:
    client = _s3_client()  # first: it says what to install when botocore is missing
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, key = _bucket_and_key(location)
    try:
        client.put_object(Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except ClientError as err:
        status = err.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status in (412, 409):  # exists; or 409: another conditional write of the key was under way (it wins)
            return False
        raise OSError(f"{location}: {err}") from err
    except BotoCoreError as err:
        raise OSError(f"{location}: {err}") from err
    return True


@functools.lru_cache(maxsize=1)
def _gcs_session():
    """An authorized HTTP session for GCS's JSON API (application default credentials), or a plain one for the
    emulator named by STORAGE_EMULATOR_HOST."""
    import requests

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return requests.Session()
    try:
        import google.auth
        from google.auth.transport.requests import AuthorizedSession
    except ImportError as err:
        raise UnsupportedStorage("gs:// run storage needs google-auth for the run lock's conditional write: "
                                 "pip install google-auth") from err
    credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
    return AuthorizedSession(credentials)


def _gcs_create(location: str, data: bytes) -> bool:
    import requests

    bucket, name = _bucket_and_key(location)
    host = os.environ.get("STORAGE_EMULATOR_HOST", "https://storage.googleapis.com").rstrip("/")
    try:
        answer = _gcs_session().post(f"{host}/upload/storage/v1/b/{bucket}/o", data=data, timeout=60,
                                     params={"uploadType": "media", "name": name, "ifGenerationMatch": "0"},
                                     headers={"Content-Type": "application/octet-stream"})
    except requests.RequestException as err:
        raise OSError(f"{location}: {err}") from err
    if answer.status_code == 412:  # the object exists
        return False
    if not answer.ok:
        raise OSError(f"{location}: GCS answered {answer.status_code}: {answer.text[:300]}")
    return True


def delete(location: str) -> None:
    """Delete a file if it exists."""
    if not is_uri(location):
        Path(location).unlink(missing_ok=True)
        return
    filesystem, path = _arrow(location)
    if exists(location):
        filesystem.delete_file(path)


def delete_dir(location: str) -> None:
    """Delete a folder and everything in it, if it exists."""
    if not is_uri(location):
        shutil.rmtree(location, ignore_errors=True)
        return
    filesystem, path = _arrow(location)
    if exists(location):
        filesystem.delete_dir(path)


def makedirs(location: str) -> None:
    if is_uri(location):
        filesystem, path = _arrow(location)
        filesystem.create_dir(path, recursive=True)
    else:
        os.makedirs(location, exist_ok=True)


# ---------------------------------------------------------------------------------------------- durability


def fsync_dir(folder: str | os.PathLike) -> None:
    """fsync a folder, so that the names created or renamed in it survive a crash."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> None:
    """fsync every file and folder under `folder` (the folder included)."""
    for root, _, files in os.walk(folder):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


# ---------------------------------------------------------------------------------------------- folders


def staging_dir(final: str) -> Path:
    """The local folder a folder bound for `final` is written into. Local paths: the hidden sibling
    `.<name>.tmp`, shared by every process writing to `final` (ranks on other nodes see it through the shared
    mount). URIs: a fresh temporary folder of this process; each writer uploads its own files (`push`)."""
    if is_uri(final):
        return Path(tempfile.mkdtemp(prefix=f"treepo-{name_of(final)}-"))
    return Path(parent_of(final)) / f".{name_of(final)}.tmp"


def push(staging: Path, final: str) -> None:
    """Make what this process wrote into `staging` durable at `final` (before `commit`): fsync (local) or
    upload every file (URI)."""
    if not is_uri(final):
        fsync_tree(staging)
        return
    from pyarrow import fs

    filesystem, path = _arrow(final)
    filesystem.create_dir(path, recursive=True)
    fs.copy_files(str(staging), path, destination_filesystem=filesystem)


def commit(staging: Path, final: str, marker: str, text: str) -> None:
    """Write the marker file last, which makes the folder complete. Local paths: into the staging folder, then
    the folder is renamed to `final` (an older `final` is replaced only once the new one is whole). URIs: the
    marker is uploaded to `final` (one atomic PUT)."""
    if is_uri(final):
        write_text(join(final, marker), text)
        return
    (staging / marker).write_text(text)
    fsync_tree(staging)
    final_path = Path(final)
    old = final_path.parent / f".{final_path.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if final_path.exists():
        os.rename(final_path, old)
    os.rename(staging, final_path)
    fsync_dir(final_path.parent)
    shutil.rmtree(old, ignore_errors=True)


def local_copy(location: str, names: list[str] | None = None) -> tuple[Path, bool]:
    """A local folder holding `location`'s files (only `names`, relative paths, when given): (path, temporary).
    Local paths are used in place (temporary False); URIs are downloaded into a temporary folder that the caller
    deletes when done."""
    if not is_uri(location):
        return Path(location), False
    from pyarrow import fs

    filesystem, path = _arrow(location)
    dest = Path(tempfile.mkdtemp(prefix=f"treepo-{name_of(location)}-"))
    if names is None:
        fs.copy_files(path, str(dest), source_filesystem=filesystem)
    else:
        for rel in names:
            src = f"{path}/{rel}"
            info = filesystem.get_file_info(src)
            if info.type == fs.FileType.NotFound:
                continue
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.copy_files(src, str(target), source_filesystem=filesystem)  # a file or a whole folder
    return dest, True
