"""What the runtime tests share: small runs of the default job, set up exactly as `treepo-ray train` sets them up
(job.config.load_config, runtime.cluster.set_up, runtime.train.start_runtime)."""

import struct
from pathlib import Path

from treepo_ray.job.config import DEFAULT_CONFIG, load_config
from treepo_ray.job.inputs import Job
from treepo_ray.runtime.cluster import set_up
from treepo_ray.runtime.train import Runtime, start_runtime

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "treepo-ray"  # synthetic task files, written once


def small(tiny: str, *extra: str) -> list[str]:
    """A seconds-long run: 4 prompts x 4 paths of at most 2 x 8 tokens, one optimizer step per training step."""
    return ["model.path=" + tiny, f"model.cache_dir={CACHE}", "trainer.eval_size=8",
            "rollout.treepo.width=4", "rollout.treepo.init_divergence_min=2", "rollout.treepo.init_divergence_max=4", "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8",
            "rollout.treepo.max_response_len=0", "rollout.treepo.max_total_len=0",  # limits of these sizes
            "rollout.sequential.max_response_len=0", "rollout.sequential.max_total_len=0",
            "rollout.sequential.group_size=4", "rollout.sequential.max_depth=2", "rollout.sequential.segment_len=8",
            "algo.dynamic_sampling=false",
            "trainer.prompts_per_step=4", "learner.lr=1e-3", "log.trees_per_step=1", "log.wandb=false", *extra]


def two_engines(tiny: str, *extra: str) -> list[str]:
    """4 prompts x 4 paths of at most 2 x 8 tokens per step; two engines of half a CPU each (room for one
    replacement as soon as one dies), the learner on the other CPU."""
    return ["model.path=" + tiny, f"model.cache_dir={CACHE}", "trainer.eval_size=4",
            "rollout.treepo.width=4", "rollout.treepo.init_divergence_min=2", "rollout.treepo.init_divergence_max=4", "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8",
            "rollout.treepo.max_response_len=0", "rollout.treepo.max_total_len=0",  # limits of these sizes
            "rollout.sequential.max_response_len=0", "rollout.sequential.max_total_len=0",
            "trainer.prompts_per_step=4", "learner.lr=1e-3", "log.wandb=false", "runtime.num_engines=2",
            "runtime.engine_cpus=0.5", "runtime.elastic.poll_s=0.2", "algo.dynamic_sampling=false", *extra]


def job(overrides: list[str], config: Path = DEFAULT_CONFIG) -> Job:
    """The config, tokenizer and prompts of a run (Ray is already up: set_up joins it)."""
    return set_up(load_config(config, overrides))


def started(run: Job) -> Runtime:
    """The run's actors and loop, as the job starts them (shut them down with `.supervisor.shutdown()`)."""
    return start_runtime(run.cfg, run)


def trained(rt: Runtime, start: int, end: int, stream, **kwargs) -> list:
    """Every (batch, metrics) of steps [start, end) on `rt`'s loop."""
    return list(rt.loop.steps(start, end, stream, **kwargs))


def faults(rt: Runtime, rows: list = ()) -> dict:
    """fault/* totals of the steps `rows` ((batch, metrics) pairs) and of what was journaled since."""
    out: dict = {}
    for metrics in [m for _, m in rows] + [rt.supervisor.fault_metrics()]:
        for key, value in metrics.items():
            if key.startswith("fault/"):
                out[key] = out.get(key, 0.0) + value
    return out


def wandb_logged_keys(run_dir: Path) -> set[str]:
    """The metric keys of every history record in the offline W&B runs under `run_dir` (read from the .wandb files:
    W&B's record log, 32 KiB blocks of chunks with a 7-byte header: CRC, length, kind)."""
    from wandb.proto import wandb_internal_pb2 as pb

    keys: set[str] = set()
    for path in Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"):
        data, pos, block, record = path.read_bytes(), 7, 32768, b""
        assert data[:4] == b":W&B", path
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            record += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4) and record:  # a full record, or the last chunk of one
                r = pb.Record()
                r.ParseFromString(record)
                record = b""
                if r.WhichOneof("record_type") == "history":
                    keys |= {item.key or "/".join(item.nested_key) for item in r.history.item}
    return keys
