"""`treepo-ray bench` (the engine benchmark) end to end, on a very small model it builds itself."""

from __future__ import annotations

import json

import pytest

from treepo_ray.benchmarks.engine import main
from treepo_ray.cli import main as cli

pytestmark = pytest.mark.slow

TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--prompts", "2", "--width", "4",
        "--repeats", "1", "--no-progress"]
MODE_KEYS = {"trajectories", "generated_tokens", "forward_tokens", "unique_tree_tokens", "wall_s", "traj_per_s",
             "tok_per_s", "forward_tok_per_s", "traj_tok_per_s", "time_s"}


def test_bench_writes_both_modes_and_their_ratios(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli(["bench"] + TINY + ["--depth", "2", "--segment-len", "4", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["engines"]["hf"]
    seq, tree = report["sequential"], report["tree"]
    assert MODE_KEYS <= set(seq) and MODE_KEYS <= set(tree)
    assert seq["trajectories"] == tree["trajectories"] == 8
    assert seq["generated_tokens"] == 2 * 4 * 8  # every path uses its whole budget (EOS ignored)
    # Tree with w=4, binary divergence, depth 2: 2 + 4 segments of 4 tokens per prompt.
    assert tree["generated_tokens"] == 2 * 6 * 4
    assert tree["forward_tokens"] <= tree["unique_tree_tokens"]
    ratios = report["ratios"]
    assert ratios["token_bound"] == seq["forward_tokens"] / tree["forward_tokens"]
    assert abs(ratios["speedup_over_bound"] - ratios["speedup"] / ratios["token_bound"]) < 1e-9
    assert set(tree["time_s"]) >= {"prefill", "decode", "sample", "branch", "driver"}
    # One decode forward timed at rows 1 and 8 (all paths), at 32 positions and at the longest path's length.
    assert {k.split("_")[0] for k in report["decode_step_ms"]} == {"rows1", "rows8"}
    assert len(report["decode_step_ms"]) == 4 and all(v > 0 for v in report["decode_step_ms"].values())
    # The reference mode: Hugging Face generate, i.i.d., the same prompts and budget.
    ref = report["hf_generate"]
    assert ref["trajectories"] == 8 and ref["generated_tokens"] == 2 * 4 * 8
    assert ratios["tree_over_hf_generate"] == pytest.approx(tree["traj_per_s"] / ref["traj_per_s"])
    assert ratios["sequential_over_hf_generate"] == pytest.approx(seq["traj_per_s"] / ref["traj_per_s"])
    assert "token_bound" in capsys.readouterr().out


def test_bench_sweep_saves_plots(tmp_path):
    out = tmp_path / "sweep.json"
    assert main(TINY + ["--sweep", "--budget", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())["engines"]["hf"]
    assert [(r["depth"], r["segment_len"]) for r in report["results"]] == [(2, 4), (4, 2), (8, 1)]
    assert len(report["plots"]) == 2
    for path in report["plots"]:
        assert (tmp_path / path.split("/")[-1]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["best"]["speedup"] == max(r["ratios"]["speedup"] for r in report["results"])
    # Every config has the same budget: the reference runs with the first and every config compares with it.
    assert all(r["hf_generate"] == report["results"][0]["hf_generate"] for r in report["results"])
    assert all("tree_over_hf_generate" in r["ratios"] for r in report["results"])
