"""The learner benchmark (benchmarks/learner.py): its trees have the papers' shapes, and one small run end to end
writes the JSON the issue names (slow: each measurement is its own process with the tiny model)."""

import json

import numpy as np
import pytest
import torch

from treepo_ray.benchmarks.learner import _logits_child, grad_rel_diff, main, treepo_paper_tree, treerpo_tree


def test_paper_shaped_trees():
    rng = np.random.default_rng(0)
    t = treepo_paper_tree(rng, prompt_len=32, seg=32, vocab=200)
    assert len(t.trajectories) == 16 and max(t.depth) == 8
    assert [sum(d == k for d in t.depth) for k in range(1, 9)] == [2, 4, 8, 16, 16, 16, 16, 16]
    assert t.unique_tokens() == 32 + 94 * 32
    r = treerpo_tree(rng, prompt_len=8, seg=4, vocab=200)
    assert len(r.trajectories) == 512 and len(r) == 1 + 8 + 64 + 512
    assert all(len(r.children(n)) == 8 for n in range(len(r)) if r.depth[n] < 3)


def test_grad_rel_diff_is_relative_to_each_parameters_largest_gradient():
    f64 = dict(dtype=torch.float64)
    want = {"a": torch.tensor([1.0, -2.0], **f64), "b": torch.tensor([1e-3, 0.0], **f64), "z": torch.zeros(2)}
    got = {"a": torch.tensor([1.0, -2.002], **f64), "b": torch.tensor([1e-3, 1e-6], **f64), "z": torch.ones(2)}
    assert grad_rel_diff(got, want) == pytest.approx(1e-3)  # a: 0.002 / 2 and b: 1e-6 / 1e-3; z skipped


def test_output_layer_before_and_after_agree(tmp_path):
    got = {}
    for kind in ("full", "chunked"):
        _logits_child(kind, 64, 500, 16, 16, 1, str(tmp_path / kind))
        got[kind] = torch.load(tmp_path / kind)
    assert (got["full"]["logp"] - got["chunked"]["logp"]).abs().max() <= 1e-5
    assert (got["full"]["entropy"] - got["chunked"]["entropy"]).abs().max() <= 1e-5
    torch.testing.assert_close(got["chunked"]["grad_w"], got["full"]["grad_w"], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_small_run_writes_every_figure(tiny, tmp_path):
    out = tmp_path / "learner.json"
    assert main(["--configs", "c", "--rounds", "1", "--steps", "1", "--prompt-len", "4", "--step-len", "2",
                 "--no-memory", "--json", str(out), f"model.path={tiny}", "learner.micro_batch_tokens=400"]) == 0
    result = json.loads(out.read_text())
    c = result["configs"]["c"]
    for mode in ("packed", "unpacked"):
        assert set(c[mode]) >= {"forward_tokens", "unique_tokens", "step_s", "peak_mem_mb", "grad_rel_diff"}
        assert c[mode]["grad_rel_diff"] <= 1e-4  # both against the direct per-node gradient
    assert c["unpacked"]["forward_tokens"] == 512 * (4 + 3 * 2)
    assert c["packed"]["unique_tokens"] == 4 + 584 * 2 and c["packed_forward_per_unique"] <= 1.02
    assert set(result["targets"]) >= {"c/grad_rel_diff<=1e-4", "c/speedup>=0.8*token_ratio"}


def test_paper_plan_alone_packs_within_ten_percent_of_unique_tokens(tmp_path):
    out = tmp_path / "learner.json"
    assert main(["--configs", "paper", "--no-memory", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    paper = result["configs"]["paper"]
    assert paper["unique_tokens"] == 1024 + (2 + 4 + 8 + 16 * 11) * 512
    assert paper["forward_per_unique"] <= 1.10 and result["targets"]["paper/forward_per_unique<=1.10"]
    # Under budgets that hold one path or less, never more than one row per path.
    assert all(b["forward_tokens"] <= paper["unpacked_tokens"] for b in paper["other_budgets"])


@pytest.mark.slow
def test_lora_rank_adds_the_lora_step_against_full_fine_tuning(tiny, tmp_path):
    out = tmp_path / "learner.json"
    assert main(["--configs", "c", "--rounds", "1", "--steps", "1", "--prompt-len", "4", "--step-len", "2",
                 "--lora-rank", "4", "--no-memory", "--json", str(out), f"model.path={tiny}",
                 "learner.micro_batch_tokens=400"]) == 0
    result = json.loads(out.read_text())
    c = result["configs"]["c"]
    lora, full = c["lora"]["lora"], c["lora"]["full"]
    assert c["lora"]["lora_rank"] == 4 and c["lora"]["target_modules"] == ["all-linear"]
    assert 0 < lora["trainable_params"] < full["trainable_params"] / 10
    assert lora["step_s"] > 0 and lora["peak_mem_mb"] >= 0 and np.isfinite(lora["loss"])
    assert c["lora"]["lora_step_ratio"] == pytest.approx(lora["step_s"] / full["step_s"])
    assert full["loss"] == pytest.approx(lora["loss"], rel=1e-4)  # B = 0 at the start: the same first loss
    assert {"c/lora_step<full", "c/lora_peak_mem<full"} <= set(result["targets"])


@pytest.mark.slow
def test_model_flag_measures_that_model(tiny, tmp_path):
    out = tmp_path / "learner.json"
    assert main(["--model", str(tiny), "--configs", "b", "--rounds", "1", "--steps", "1", "--prompt-len", "4",
                 "--segment-len", "2", "--no-memory", "--json", str(out), "learner.micro_batch_tokens=400"]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == str(tiny) and result["model_arg"] == str(tiny)
    assert f"model.path={tiny}" in result["overrides"]
    b = result["configs"]["b"]
    assert b["packed"]["unique_tokens"] == 4 + 94 * 2 and b["unpacked"]["forward_tokens"] == 16 * (4 + 8 * 2)
    assert b["packed"]["step_s"] > 0 and b["packed"]["grad_rel_diff"] <= 1e-4  # packed = unpacked gradient


def test_model_flag_refuses_a_missing_model_before_measuring(tmp_path):
    from treepo_ray.config import UserError

    with pytest.raises(UserError, match="--model"):
        main(["--model", str(tmp_path / "nowhere"), "--configs", "b", "--no-memory"])
