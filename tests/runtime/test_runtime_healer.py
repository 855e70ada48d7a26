"""The healer (runtime/healer.py) in a real small CATPO run on local Ray with a real (random) tiny model: every tree
is verified, scored, found dead-wrong (a random model never answers right) and healed by the healer actor on the
engines; grafted branches carry their tokens' log-probs given the tree's own prefix, are verified, and train like
sampled ones. A heal the engine refuses is recorded and the tree kept. A lost healer, and one that stops answering,
is replaced by the supervisor and the trees that waited on it grown again into the same trees."""

import asyncio
import os
import signal
import threading
import time

import pytest
import ray
from transformers import AutoModelForCausalLM, AutoTokenizer

from treepo_ray.data.prompts import PromptStream
from treepo_ray.engines.hf.logprobs import teacher_forced_logprobs
from treepo_ray.job.config import CONFIG_DIR, load_config
from treepo_ray.runtime.chaos import kill_actor
from treepo_ray.runtime.healer import make_healer, verified_phases
from treepo_ray.tree.tree import Tree
from runtime_testlib import CACHE, faults, job, started

pytestmark = pytest.mark.slow

# 4 prompts x a binary tree of depth 2 with 8-token steps; 2 grafts of a critique of at most 8 tokens.
SMALL_CATPO = ["rollout.treerpo.n_children=2", "rollout.treerpo.max_depth=2", "rollout.treerpo.step_len=8",
               "trainer.prompts_per_step=4", "algo.catpo.healing.num_refinements=2",
               "algo.catpo.healing.critique_max_tokens=8", "algo.catpo.healing.step_len=0", "runtime.max_staleness=0",
               "learner.micro_batch_size=8"]


@pytest.fixture(scope="module")
def catpo_run(ray_local, tiny):
    run = job([f"model.path={tiny}", f"model.cache_dir={CACHE}", "runtime.deadlines.heartbeat_s=3", *SMALL_CATPO],
              CONFIG_DIR / "catpo_cpu.yaml")
    rt = started(run)
    yield rt, run
    rt.supervisor.shutdown()


def test_dead_wrong_trees_are_healed_on_the_engines_and_trained(catpo_run, tiny):
    rt, run = catpo_run
    stream = PromptStream(run.train_set, 0)
    batch = rt.loop.builder.make(0, stream, 0.0, 4, threading.Event())
    m = batch.metrics
    assert m["catpo/dead_wrong"] == 4 and m["catpo/heal_attempts"] == 4 and m["catpo/heal_errors"] == 0
    assert m["catpo/grafted"] == 8 and 0.0 <= m["catpo/healed_share"] <= 1.0
    assert m["catpo/heal_generated_tokens"] > 0 and m["catpo/heal_prompt_tokens"] > 0

    hf, vocab = AutoModelForCausalLM.from_pretrained(tiny).eval(), len(AutoTokenizer.from_pretrained(tiny))
    sampled = 0
    for rec in batch.trees:
        tree = Tree.from_dict(rec)
        info, grafted = tree.meta["catpo"], tree.meta["grafted"]
        assert info["regime0"] == "dead_wrong" and info["F0"] == 0.0 and info["heal"]["failure_node"] == 0
        assert len(grafted) == 2 and tree.trajectories[-2:] == grafted and len(tree.trajectories) == 4 + 2
        for node in grafted:
            assert tree.parent[node] == 0 and 1 <= len(tree.tokens[node]) <= 8  # cut to the step length
            assert tree.reward[node] in (0.0, 1.0)  # verified
            # log-probs of the grafted tokens given the tree's prompt, not the critique prompt (base weights), at
            # the tree's sampling temperature (the learner's behaviour log-probs)
            want = teacher_forced_logprobs(hf, tree.prompt_ids, tree.tokens[node], vocab_size=vocab,
                                           temperature=run.cfg.rollout.temperature)
            assert tree.logprobs[node] == pytest.approx(want, abs=1e-4)
        # the root's reward is re-propagated over all of its children, grafts included
        kids = tree.children(0)
        assert tree.reward[0] == pytest.approx(sum(tree.reward[k] for k in kids) / len(kids))
        sampled += sum(len(tree.tokens[n]) for n in range(1, len(tree)) if n not in grafted)
        sampled += info["heal"]["generated_tokens"]
    assert m["rollout/sampled_tokens"] == sampled
    assert batch.num_samples == 4 * (4 + 2)  # grafted trajectories train like sampled ones

    rows = [m for _, m in rt.loop.steps(0, 1, PromptStream(run.train_set, 0, position=4))]
    assert rt.loop.version == 1 and rows[0]["actor/samples"] == 24 and rows[0]["catpo/heal_attempts"] == 4


def test_a_heal_the_engine_refuses_is_recorded_and_the_tree_kept(catpo_run, tiny):
    rt, _ = catpo_run
    # A critique of 300 tokens cannot fit the model's 256 positions: the engine refuses the request.
    cfg = load_config(CONFIG_DIR / "catpo_cpu.yaml", [*SMALL_CATPO, "algo.catpo.healing.critique_max_tokens=300"])
    healer = make_healer(rt.supervisor.router, rt.supervisor.verifiers, tiny, cfg)
    tree = Tree(prompt_ids=[40, 41, 42], query_id="refused")
    for _ in range(2):
        tree.add_node(0, [50, 51], [-1.0, -1.0], "eos")
    tree.trajectories = [1, 2]
    tree.set_trajectory_rewards([0.0, 0.0])
    tree.meta.update(ground_truth="7", data_source="synthetic_addition")
    try:
        out = asyncio.run(verified_phases(tree, cfg.algo, healer, seed=1, wait_s=60))
    finally:
        ray.kill(healer)
    assert out is tree and len(tree) == 3 and tree.trajectories == [1, 2]
    assert "prefix + max_new_tokens" in tree.meta["catpo"]["heal"]["error"]
    assert tree.meta["catpo"]["regime"] == "dead_wrong"


def test_a_lost_healer_is_replaced_and_its_trees_grown_again(catpo_run):
    rt, run = catpo_run
    sup = rt.supervisor
    prompts = PromptStream(run.train_set, 0, position=8).take(4)
    clean = sup.grow(prompts, 0.0)
    faults(rt)  # drain what earlier tests left
    lost = sup.healer
    kill_actor(lost, "signal")  # every tree of the batch is dead-wrong: all of them wait on the healer
    again = sup.grow(prompts, 0.0)
    totals = faults(rt)
    assert sup.healer is not lost and totals["fault/healers_lost"] == 1 and totals["fault/regrown_prompts"] == 4
    # Every tree healed again, none refused: a tree of a failed shard no longer heals on beside its regrown copy (it
    # is stopped with its shard, and heal calls' request ids are their own), which the engine refused as a duplicate.
    assert [t.meta["catpo"]["heal"].get("error") for t in again] == [None] * 4
    assert [t.tokens for t in again] == [t.tokens for t in clean]  # healed again with the same seeds: same grafts
    assert [t.reward for t in again] == [t.reward for t in clean]
    assert all(len(t.meta["grafted"]) == 2 for t in again)


def test_a_healer_that_stops_answering_is_replaced_within_the_heartbeat_and_its_trees_grown_again(catpo_run):
    rt, run = catpo_run
    sup = rt.supervisor
    prompts = PromptStream(run.train_set, 0, position=12).take(4)
    clean = sup.grow(prompts, 0.0)
    faults(rt)
    stuck = sup.healer
    pid = ray.get(stuck.__ray_call__.remote(lambda _: os.getpid()), timeout=30)
    os.kill(pid, signal.SIGSTOP)  # alive, answering nothing: the trees' heal calls wait on it
    start = time.monotonic()
    again = sup.grow(prompts, 0.0)
    took = time.monotonic() - start
    totals = faults(rt)
    # The heartbeat (3 s here) killed it, the shard's calls failed, a new healer took over and healed the same trees.
    assert sup.healer is not stuck and totals["fault/healers_stuck"] == 1 and totals["fault/healers_lost"] == 1
    assert totals["fault/regrown_prompts"] == 4 and took < 3 + 60, (totals, took)
    assert [t.tokens for t in again] == [t.tokens for t in clean]
    assert [t.reward for t in again] == [t.reward for t in clean]
