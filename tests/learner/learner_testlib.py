"""Samples and helpers shared by the learner tests: uneven lengths, per-token and scalar advantages, tree weights and
one sample with given old log-probs, so every part of the loss scaling is exercised."""

import os
import socket
import sys

import torch.multiprocessing as mp

from treepo_ray.learner import TrainSample

# Uneven shards: rank 0 runs two micro-batches, rank 1 one real and one zero-weighted dummy pass.
SHARDS = (slice(0, 3), slice(3, 5))


def samples() -> list[TrainSample]:
    return [
        TrainSample([5, 6, 7], [8, 9, 10, 11], advantages=1.0),
        TrainSample([12], [13, 14], advantages=-1.0, weight=0.5, old_logprobs=[-5.0, -6.5]),
        TrainSample([20, 21, 22, 23, 24], [25], advantages=0.5),
        TrainSample([30, 31], [32, 33, 34, 35, 36, 37], advantages=[1.0, -1.0, 0.5, 0.0, 2.0, -0.5]),
        TrainSample([40, 41, 42], [43, 44, 45], advantages=-0.75, weight=2.0),
    ]


def params(learner) -> dict:
    """A copy of the learner's trainable parameters by name."""
    return {k: v.detach().clone() for k, v in learner.model.named_parameters()}


def random_tree(rng, prompt_len=(2, 5), depth=(1, 4), branch=(1, 3), seg=(1, 4), vocab=40, query_id="t"):
    """A scored rollout tree (tree.Tree) of random shape, tokens, sampled log-probs and 0/1 rewards; every leaf
    ends a trajectory, and at least one reward differs when there are two or more leaves."""
    from treepo_ray.tree import Tree

    t = Tree(prompt_ids=rng.integers(2, vocab, rng.integers(*prompt_len)).tolist(), query_id=query_id)
    frontier = [0]
    for _ in range(int(rng.integers(*depth))):
        nxt = []
        for node in frontier:
            for _ in range(int(rng.integers(*branch))):
                n = int(rng.integers(*seg))
                nxt.append(t.add_node(node, rng.integers(2, vocab, n).tolist(), (-rng.random(n) * 2).tolist()))
        frontier = nxt
    t.trajectories = t.leaves()
    rewards = rng.integers(0, 2, len(t.trajectories)).astype(float)
    if len(rewards) > 1 and rewards.min() == rewards.max():
        rewards[0] = 1.0 - rewards[0]
    t.set_trajectory_rewards(rewards.tolist())
    return t


def random_train_trees(rng, algorithm: str, n: int = 3, **shape):
    """`n` random trees with `algorithm`'s credit (CATPO: random tree weights, one of them 0) as TrainTrees."""
    from treepo_ray.job.config import AlgoConfig
    from treepo_ray.learner import train_trees

    if algorithm in ("grpo", "dapo"):  # sequential sampling: a root with chains of one segment
        shape = {"depth": (1, 2), "branch": (3, 6), **shape}
    trees = [random_tree(rng, query_id=f"q{i}", **shape) for i in range(n)]
    weights = None
    if algorithm == "catpo":
        weights = [0.0] + [float(w) for w in rng.uniform(0.5, 2.0, n - 1)]
    return train_trees(trees, AlgoConfig(name=algorithm).credit(trees), weights)


def run_two_ranks(worker, *args) -> None:
    """Run `worker(rank, port, *args)` in two spawned processes that meet on a free local port; raises if either
    fails."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(worker, port, args), nprocs=2, join=True)


def _rank_main(rank: int, worker, port: int, args: tuple) -> None:
    worker(rank, port, *args)
    # Leave without interpreter finalization. torch keeps the gloo group alive after destroy_process_group while
    # DTensor state still refers to its mesh, and a process that finalizes with a live gloo group can abort in
    # gloo's threads ("terminate called without an active exception": 25 of 60 runs of a minimal two-rank
    # all_gather script, none with os._exit). Learner ranks in the product are Ray actors, ended by ray.kill.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
