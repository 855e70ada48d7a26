"""Two runs started on one run directory at once (job/rundir.py's lock): real processes race for the lock, round
after round, from the same instant, on a fresh directory and on every kind of lock a directory can hold (a dead
holder's, a released one, a stale one from another host, the single run.lock of the version before generations, a
live holder on this host whose heartbeat is old). Exactly one wins each round (none where the holder lives), and the
loser gives up before it touches the winner's metrics.jsonl or trees.jsonl. The same race runs through an object
store (s3://, its conditional PUT) where an S3-compatible server is at hand, and `treepo-ray train` refuses a held
directory before it creates or empties anything. No Ray."""

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from treepo_ray import storage
from treepo_ray.job.rundir import LOCK, RunLock, _process_start

REPO = Path(__file__).resolve().parents[2]
# Responses that fit the tiny model's context (as tests/runtime/runtime_testlib.py's `small` runs).
TINY_RUN = ["trainer.eval_size=4", "log.wandb=false", "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8",
            "rollout.treepo.max_response_len=0", "rollout.treepo.max_total_len=0"]

# One contender: for each run directory in turn, both contenders say they are ready, wait for the same instant and
# try the lock. The winner starts its logs as a fresh run does (RunLogger empties metrics.jsonl and trees.jsonl),
# logs step 1, waits until the other contender has tried, logs step 2 and releases the lock.
CONTENDER = r'''
import json, os, sys, time
from pathlib import Path
from treepo_ray.job.logs import LogConfig, RunLogger
from treepo_ray.job.rundir import LogMirror, RunLock, RunLocked

results, me, other, *run_dirs = sys.argv[1:]
mine = open(Path(results) / f"{me}.jsonl", "a", buffering=1)

def said(k, key):
    path = Path(results) / f"{other}.jsonl"
    # complete lines only: the other process may be in the middle of writing its next one
    rows = [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []
    return next((row[key] for row in rows if row["round"] == k and key in row), None)

def wait_for(k, key):
    deadline = time.monotonic() + 120
    while (value := said(k, key)) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{other} said no {key} in round {k}")
        time.sleep(0.002)
    return value

for k, run_dir in enumerate(run_dirs):
    ready = time.time()
    mine.write(json.dumps({"round": k, "ready": ready}) + "\n")
    start = max(ready, wait_for(k, "ready")) + 0.05
    while time.time() < start:  # spin: both try within a fraction of a millisecond
        pass
    try:
        lock = RunLock(run_dir, me, stale_s=60).acquire()
    except RunLocked as err:
        mine.write(json.dumps({"round": k, "result": "refused", "why": str(err)}) + "\n")
        continue
    mine.write(json.dumps({"round": k, "result": "won"}) + "\n")
    logger = RunLogger(LogMirror(run_dir, str(Path(results) / me)).local, LogConfig(wandb=False), {}, name=me)
    logger.log(1, {"pid": os.getpid()})
    logger.save_trees(1, [{"by": me, "parent": [-1], "trajectories": [], "reward": [None], "finish": [""]}])
    wait_for(k, "result")
    logger.log(2, {"pid": os.getpid()})
    lock.release()
'''

SCENARIOS = ("fresh", "dead holder", "released", "stale on another host", "old run.lock, dead holder",
             "live holder, old heartbeat")


def exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def seed(run_dir: str, scenario: str, this_host: dict) -> None:
    """Leave in `run_dir` the lock `scenario` names (through run storage: a path or a URI)."""
    now = time.time()
    holder = {**this_host, "run": "earlier", "token": "t0", "started": "2026-11-30 10:00:00", "heartbeat": now}
    if scenario == "dead holder":
        name, holder = "run.lock.00000007", {**holder, "pid": exited_pid(), "pid_started": None}
    elif scenario == "released":
        name, holder = "run.lock.00000002", {**holder, "released": "2026-11-30 11:00:00"}
    elif scenario == "stale on another host":
        name, holder = "run.lock.00000003", {**holder, "host": "elsewhere", "machine": "elsewhere/boot/pid:[1]",
                                             "heartbeat": now - 3600}
    elif scenario == "old run.lock, dead holder":  # no machine nor start time: written before they were
        name = LOCK
        holder = {k: v for k, v in holder.items() if k not in ("machine", "pid_started")} | {"pid": exited_pid()}
    elif scenario == "live holder, old heartbeat":  # this test's own process, paused as far as its heartbeat says
        name, holder = "run.lock.00000005", {**holder, "pid": os.getpid(), "pid_started": _process_start(os.getpid()),
                                             "run": "paused", "heartbeat": now - 86400}
    else:
        return
    storage.write_text(storage.join(run_dir, name), json.dumps(holder))


def race(tmp_path: Path, run_dirs: list[str]) -> list[dict]:
    """Two contender processes over `run_dirs`; per round, {contender: its result row} and the contenders' pids."""
    results = tmp_path / "results"
    results.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline"}
    procs = {name: subprocess.Popen([sys.executable, "-c", CONTENDER, str(results), name, other, *run_dirs],
                                    env=env, stdout=(tmp_path / f"{name}.log").open("w"), stderr=subprocess.STDOUT)
             for name, other in (("a", "b"), ("b", "a"))}
    try:
        for name, proc in procs.items():
            assert proc.wait(timeout=600) == 0, (tmp_path / f"{name}.log").read_text()[-3000:]
    finally:
        for proc in procs.values():
            proc.kill()
    rows = {name: [json.loads(line) for line in (results / f"{name}.jsonl").read_text().splitlines()]
            for name in procs}
    return [{name: next(r for r in rows[name] if r["round"] == k and "result" in r) | {"pid": procs[name].pid}
             for name in procs} for k in range(len(run_dirs))]


def this_host_holder(tmp_path: Path) -> dict:
    info = RunLock(str(tmp_path / "probe"), "probe", 60).info
    return {k: info[k] for k in ("host", "machine", "pid", "pid_started")}


@pytest.mark.slow
def test_two_runs_started_on_one_run_directory_at_once(tmp_path):
    rounds = [(f"{tmp_path}/runs/round-{k:02d}", SCENARIOS[k % len(SCENARIOS)]) for k in range(10 * len(SCENARIOS))]
    this_host = this_host_holder(tmp_path)
    for run_dir, scenario in rounds:
        os.makedirs(run_dir)
        seed(run_dir, scenario, this_host)
    paused = {run_dir: Path(run_dir, "run.lock.00000005").read_text() for run_dir, scenario in rounds
              if scenario == "live holder, old heartbeat"}
    for (run_dir, scenario), outcome in zip(rounds, race(tmp_path, [run_dir for run_dir, _ in rounds])):
        results = {name: row["result"] for name, row in outcome.items()}
        files = sorted(os.listdir(run_dir))
        if scenario == "live holder, old heartbeat":  # never taken over: both refused, nothing touched
            assert results == {"a": "refused", "b": "refused"}, (scenario, outcome)
            assert files == ["run.lock.00000005"] and Path(run_dir, files[0]).read_text() == paused[run_dir]
            assert all("in use by run 'paused'" in row["why"] for row in outcome.values())
            continue
        assert sorted(results.values()) == ["refused", "won"], (scenario, outcome)
        winner = next(name for name, result in results.items() if result == "won")
        loser = outcome["b" if winner == "a" else "a"]
        assert f"in use by run '{winner}'" in loser["why"], (scenario, outcome)
        # The loser never reached its logs: the winner's lines, written before and after the loser's try, are whole.
        metrics = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
        assert metrics == [{"step": 1, "pid": outcome[winner]["pid"]}, {"step": 2, "pid": outcome[winner]["pid"]}]
        trees = [json.loads(line) for line in Path(run_dir, "trees.jsonl").read_text().splitlines()]
        assert [(t["step"], t["by"]) for t in trees] == [(1, winner)]
        (lock,) = [name for name in files if name.startswith("run.lock")]  # older generations deleted
        assert json.loads(Path(run_dir, lock).read_text())["run"] == winner


@pytest.fixture(scope="module")
def s3_bucket():
    """A fresh bucket on an S3-compatible server: TREEPO_TEST_S3_ENDPOINT (its AWS_* credentials in the
    environment), else a moto server started here from this interpreter's moto (`pip install 'moto[server]'`; 5.2.6
    or later: 5.2.1 answers pyarrow's multipart uploads with an error)."""
    endpoint, server = os.environ.get("TREEPO_TEST_S3_ENDPOINT"), None
    with pytest.MonkeyPatch.context() as env:
        if not endpoint:
            pytest.importorskip("moto", minversion="5.2.6", reason="no S3-compatible server: set "
                                "TREEPO_TEST_S3_ENDPOINT, or pip install 'moto[server]>=5.2.6'")
            server, endpoint = start_moto()
        env.setenv("AWS_ENDPOINT_URL", endpoint)
        for key, value in (("AWS_ACCESS_KEY_ID", "test"), ("AWS_SECRET_ACCESS_KEY", "test"),
                           ("AWS_DEFAULT_REGION", "us-east-1")):
            env.setenv(key, os.environ.get(key, value))
        storage._s3_client.cache_clear()  # a client for this endpoint
        bucket = f"treepo-test-{uuid.uuid4().hex[:12]}"
        storage._s3_client().create_bucket(Bucket=bucket)
        try:
            yield bucket
        finally:
            storage._s3_client.cache_clear()
            if server is not None:
                server.terminate()
                server.wait(timeout=30)


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.1)


@pytest.mark.slow
def test_two_runs_race_for_a_run_directory_in_an_object_store(s3_bucket, tmp_path):
    # The primitive: one conditional PUT, refused when the object exists.
    where = f"s3://{s3_bucket}/probe/run.lock.00000001"
    assert storage.create_exclusive(where, "first") and not storage.create_exclusive(where, "second")
    assert storage.read_text(where) == "first"
    rounds = [(f"s3://{s3_bucket}/runs/round-{k:02d}", SCENARIOS[k % 4]) for k in range(12)]
    this_host = this_host_holder(tmp_path)
    for run_dir, scenario in rounds:
        seed(run_dir, scenario, this_host)
    for (run_dir, scenario), outcome in zip(rounds, race(tmp_path, [run_dir for run_dir, _ in rounds])):
        results = {name: row["result"] for name, row in outcome.items()}
        assert sorted(results.values()) == ["refused", "won"], (scenario, outcome)
        winner = next(name for name, result in results.items() if result == "won")
        locks = [name for name in storage.list_names(run_dir) if name.startswith("run.lock")]
        assert len(locks) == 1 and json.loads(storage.read_text(storage.join(run_dir, locks[0])))["run"] == winner


@pytest.mark.slow
def test_train_refuses_a_held_run_directory_before_it_creates_or_empties_anything(tiny, tmp_path):
    run = tmp_path / "run"
    lock = RunLock(str(run), "the-holder", 300).acquire()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "trees.jsonl").write_text('{"step": 1, "query_id": "q"}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    try:
        done = subprocess.run([sys.executable, "-m", "treepo_ray.cli", "train", f"model.path={tiny}",
                               f"model.cache_dir={REPO / '.cache' / 'treepo-ray'}", f"trainer.run_dir={run}",
                               *TINY_RUN], capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    finally:
        lock.release()
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"treepo-ray train: {run} is in use by run 'the-holder'")
    after = {p.name: p.read_bytes() for p in run.iterdir()}
    assert after.keys() == before.keys()  # nothing created (no run.json, config.yaml, checkpoint, wandb/)
    assert {k: after[k] for k in ("metrics.jsonl", "trees.jsonl")} == {k: before[k] for k in
                                                                        ("metrics.jsonl", "trees.jsonl")}
