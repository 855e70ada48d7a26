"""DeepSpeed ZeRO-2 over gloo: two ranks train like one process; NaN steps skip; checkpoints resume exactly.
Skipped where deepspeed is not installed (it is an optional extra); its first run JIT-compiles a CPU op (~1-2 min)."""

import dataclasses

import pytest
import torch

pytest.importorskip("deepspeed")

from treepo_ray.algo.losses import LossConfig  # noqa: E402
from treepo_ray.learner import Learner, LearnerConfig  # noqa: E402
from treepo_ray.learner.strategy import DeepSpeedZeRO, Strategy  # noqa: E402
from learner_testlib import SHARDS, run_two_ranks, samples  # noqa: E402

pytestmark = pytest.mark.slow


def _config() -> LearnerConfig:
    # eps = 1e-5: see test_learner_fsdp.py (keeps summation-order noise in tiny gradients out of Adam's first steps).
    return LearnerConfig(lr=1e-3, eps=1e-5, micro_batch_size=2, strategy="deepspeed", zero_stage=2,
                         loss=LossConfig(kl_coef=0.05, entropy_coef=0.01))


def _worker(rank: int, port: int, model_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    learner = Learner(model_path, _config(), rank=rank, world_size=2, master_port=port)
    assert type(learner.strategy) is DeepSpeedZeRO
    shard = samples()[SHARDS[rank]]
    metrics = [learner.train_step(shard) for _ in range(2)]
    ckpt = learner.save_checkpoint(f"{out_dir}/checkpoint-00000002", {"step": 2})
    w2 = learner.export_weights()
    # A NaN advantage on one rank only: every rank skips the step.
    bad = [dataclasses.replace(shard[0], advantages=float("nan"))] + shard[1:] if rank == 1 else shard
    nan_metrics = learner.train_step(bad)
    w_nan = learner.export_weights()
    m3 = learner.train_step(shard)
    w3 = learner.export_weights()
    assert learner.load_checkpoint(ckpt) == {"step": 2} and learner.optimizer_steps == 2
    m3_again = learner.train_step(shard)
    w3_again = learner.export_weights()
    if rank == 0:
        torch.save(dict(metrics=metrics, w2=w2, nan=nan_metrics, w_nan=w_nan, m3=m3, w3=w3, m3_again=m3_again,
                        w3_again=w3_again), f"{out_dir}/results.pt")
    learner.close()


def test_deepspeed_zero2_two_ranks(tiny, tmp_path):
    run_two_ranks(_worker, tiny, str(tmp_path))
    r = torch.load(tmp_path / "results.pt", weights_only=False)

    single = Learner(tiny, _config())  # world_size 1: the plain model, whatever the strategy
    assert type(single.strategy) is Strategy
    want = [single.train_step(samples()) for _ in range(2)]
    for g, w in zip(r["metrics"], want):
        for key in ("loss", "pg_loss", "kl_loss", "entropy", "grad_norm", "tokens"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), key
    for k, v in single.export_weights().items():
        torch.testing.assert_close(r["w2"][k], v, atol=1e-5, rtol=0)

    assert r["nan"]["skipped"] == 1 and r["nan"]["optimizer_steps"] == 2
    assert all(torch.equal(r["w_nan"][k], v) for k, v in r["w2"].items())
    assert r["m3"]["skipped"] == 0 and r["m3"]["optimizer_steps"] == 3
    # Resuming from the checkpoint replays step 3 exactly.
    assert r["m3_again"]["loss"] == r["m3"]["loss"] and r["m3_again"]["grad_norm"] == r["m3"]["grad_norm"]
    assert all(torch.equal(r["w3_again"][k], v) for k, v in r["w3"].items())
    # Its optimizer state is DeepSpeed's per-rank partitions: a single process refuses it with a clear error.
    with pytest.raises(ValueError, match="'deepspeed' optimizer state from world size 2"):
        single.load_checkpoint(tmp_path / "checkpoint-00000002")
