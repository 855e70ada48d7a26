"""Two FSDP2 ranks over gloo, each with a share of the batch, train exactly like one process on all of it: packed
trees (token-mean, and the per-node loss with tree weights) and unpadded rows (seq-mean); and they start from rank 0's
weights, built on the meta device and filled by broadcast, without any other rank reading the whole model."""

import dataclasses

import numpy as np
import pytest
import torch

from treepo_ray.algo.losses import LossConfig
from treepo_ray.learner import Learner, LearnerConfig, TrainSample, shard_trees
from treepo_ray.learner.strategy import FSDP2
from learner_testlib import SHARDS, random_train_trees, run_two_ranks, samples

pytestmark = pytest.mark.slow

AGGREGATIONS = ("token-mean", "node-mean", "seq-mean")
PACKING = {"token-mean": "tree", "node-mean": "tree", "seq-mean": "none"}


def _batch(aggregation: str, rank: int | None = None) -> list:
    """The whole batch (rank None) or a rank's share: random trees (packed; split under a 20-token budget), or
    the samples of learner_testlib (unpacked rows)."""
    if PACKING[aggregation] == "none":
        return samples() if rank is None else samples()[SHARDS[rank]]
    algorithm = "catpo" if aggregation == "node-mean" else "treepo"
    trees = random_train_trees(np.random.default_rng(11), algorithm, n=5, vocab=200)
    return trees if rank is None else shard_trees(trees, rank, 2)


def _config(aggregation: str) -> LearnerConfig:
    # KL (so a sharded reference model) and an entropy bonus are on, to cover every term of the loss. Adam's first
    # steps are about lr * sign(g); eps = 1e-5 keeps summation-order noise in near-zero gradients (~1e-10) from
    # being blown up to lr-sized weight differences.
    return LearnerConfig(lr=1e-3, eps=1e-5, micro_batch_size=2, micro_batch_tokens=20, packing=PACKING[aggregation],
                         loss=LossConfig(aggregation=aggregation, kl_coef=0.05, entropy_coef=0.01))


STEPS = 2


def _worker(rank: int, port: int, model_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks share the cores
    results, learners = {}, []
    for aggregation in AGGREGATIONS:
        learner = Learner(model_path, _config(aggregation), rank=rank, world_size=2, master_port=port)
        learners.append(learner)
        assert type(learner.strategy) is FSDP2
        metrics = [learner.train_step(_batch(aggregation, rank)) for _ in range(STEPS)]
        weights = learner.export_weights()
        if aggregation == "token-mean":
            learner.save_checkpoint(f"{out_dir}/checkpoint-00000002", {"step": STEPS})
        results[aggregation] = (metrics, weights)
    if rank == 0:
        torch.save(results, f"{out_dir}/results.pt")
    else:
        assert weights == {}  # only rank 0 receives the gathered weights
    # The first Learner created the process group (the others joined it): closing it destroys the group.
    for learner in learners:
        learner.close()


def test_two_fsdp2_ranks_match_one_process(tiny, tmp_path):
    run_two_ranks(_worker, tiny, str(tmp_path))
    results = torch.load(tmp_path / "results.pt", weights_only=False)

    for aggregation in AGGREGATIONS:
        single = Learner(tiny, _config(aggregation))
        want = [single.train_step(_batch(aggregation)) for _ in range(STEPS)]
        got_metrics, got_weights = results[aggregation]
        for g, w in zip(got_metrics, want):
            for key in ("loss", "pg_loss", "kl_loss", "entropy", "pg_clipfrac", "grad_norm", "tokens", "samples"):
                assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-6), (aggregation, key)
        assert got_metrics[1]["kl_loss"] > 0 and got_metrics[1]["optimizer_steps"] == STEPS
        reference = single.export_weights()
        assert got_weights.keys() == reference.keys()
        for k, v in reference.items():
            torch.testing.assert_close(got_weights[k], v, atol=1e-5, rtol=0)

        if aggregation == "token-mean":
            # A checkpoint written by 2 ranks resumes in 1 process: same weights, optimizer state, next step.
            resumed = Learner(tiny, _config(aggregation))
            assert resumed.load_checkpoint(tmp_path / "checkpoint-00000002") == {"step": STEPS}
            assert resumed.optimizer_steps == STEPS
            state = {k: v for k, v in resumed.optimizer.state_dict()["state"].items()}
            ref_state = single.optimizer.state_dict()["state"]
            for idx, s in ref_state.items():
                torch.testing.assert_close(state[idx]["exp_avg_sq"], s["exp_avg_sq"], atol=1e-7, rtol=1e-4)
            nxt = [TrainSample(s.prompt_ids, s.response_ids, s.advantages, s.weight) for s in samples()]
            a, b = resumed.train_step(nxt), single.train_step([dataclasses.replace(s) for s in nxt])
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6)
            for k, v in single.export_weights().items():
                torch.testing.assert_close(resumed.export_weights()[k], v, atol=1e-5, rtol=0)


def _sharded_start_worker(rank: int, port: int, model_path: str, weightless_path: str, out_dir: str) -> None:
    # Rank 1 is given a copy of the model without its weights file: it must build its shards without reading (or
    # allocating) the whole model, from what rank 0 read and broadcast.
    torch.set_num_threads(1)
    learner = Learner(model_path if rank == 0 else weightless_path, _config("token-mean"), rank=rank, world_size=2,
                      master_port=port)
    metrics = learner.train_step(_batch("token-mean", rank))
    weights = learner.export_weights()
    if rank == 0:
        torch.save((metrics, weights), f"{out_dir}/start.pt")
    learner.close()


def test_fsdp2_ranks_start_from_rank_0s_weights_without_loading_the_whole_model(tiny, tmp_path):
    import shutil
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    weightless = tmp_path / "weightless"
    shutil.copytree(tiny, weightless, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    run_two_ranks(_sharded_start_worker, tiny, str(weightless), str(tmp_path))
    metrics, weights = torch.load(tmp_path / "start.pt", weights_only=False)

    single = Learner(tiny, _config("token-mean"))
    assert metrics["loss"] == pytest.approx(single.train_step(_batch("token-mean"))["loss"], rel=1e-5, abs=1e-6)
    loaded = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).state_dict()
    before = {k: v for k, v in single.export_weights().items()}
    assert weights.keys() == before.keys()
    for k, v in before.items():  # both trained one step from the same start
        torch.testing.assert_close(weights[k], v, atol=1e-5, rtol=0)
    assert any(not torch.equal(weights[k], loaded[k]) for k in loaded if k in weights)  # it did train
    assert not list(Path(weightless).glob("*.safetensors"))
