"""`treepo-ray bench stream` end to end on a very small model it builds itself."""

from __future__ import annotations

import json

import pytest

from treepo_ray.cli import main as cli

pytestmark = pytest.mark.slow

TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--width", "4", "--depth", "3",
        "--segment-len", "4", "--warmup-prompts", "1", "--no-progress"]


def test_stream_reports_both_modes_through_a_capped_batch(tmp_path, capsys):
    out = tmp_path / "stream.json"
    assert cli(["bench", "stream", *TINY, "--prompts", "6", "--max-batch-size", "8", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"][:3] == ["treepo-ray", "bench", "stream"]
    hf = report["engines"]["hf"]
    seq, tree = hf["sequential"], hf["tree"]
    for m in (seq, tree):
        assert m["trajectories"] == 6 * 4 and m["traj_per_s"] > 0
        assert 1 <= m["mean_batch"] <= 8 and 0 <= m["at_cap"] <= 1 and m["steps"] > 0
    assert seq["generated_tokens"] == 6 * 4 * 12  # every path runs its whole budget
    # Width 4 from 2 root children: 2 + 4 + 4 segments of 4 tokens per prompt.
    assert tree["generated_tokens"] == 6 * 10 * 4
    assert seq["at_cap"] > 0.5  # two prompts of 4 paths fill the 8 rows while the stream lasts
    r = hf["ratios"]
    assert r["token_bound"] == seq["forward_tokens"] / tree["forward_tokens"]
    assert r["speedup"] == pytest.approx(tree["traj_per_s"] / seq["traj_per_s"])
    assert r["speedup_over_bound"] == pytest.approx(r["speedup"] / r["token_bound"])
    assert "speedup/bound" in capsys.readouterr().out


def test_stream_rejects_a_width_over_the_cap():
    assert cli(["bench", "stream", *TINY, "--width", "16", "--max-batch-size", "8"]) == 2


def test_stream_runs_each_engine_spec_with_its_own_arguments(tmp_path):
    out = tmp_path / "stream.json"
    assert cli(["bench", "stream", *TINY, "--prompts", "4", "--max-batch-size", "8", "--engine",
                "hf,hf:attention_blocks=1", "--json", str(out)]) == 0
    engines = json.loads(out.read_text())["engines"]
    assert sorted(engines) == ["hf", "hf:attention_blocks=1"]
    assert engines["hf"]["tree"]["generated_tokens"] == engines["hf:attention_blocks=1"]["tree"]["generated_tokens"]
    assert cli(["bench", "stream", *TINY, "--engine", "hf:attention_blocks"]) == 2  # not key=value
    with pytest.raises(ValueError, match="attention_blocks must be >= 1"):  # the arguments reach the engine
        cli(["bench", "stream", *TINY, "--prompts", "1", "--engine", "hf:attention_blocks=0"])


def test_stream_entropy_cost_runs_the_tree_stream_with_entropy_off_and_on(tmp_path, capsys):
    out = tmp_path / "stream.json"
    assert cli(["bench", "stream", *TINY, "--prompts", "4", "--max-batch-size", "8", "--entropy-cost",
                "--json", str(out)]) == 0
    hf = json.loads(out.read_text())["engines"]["hf"]
    off, on = hf["entropy_off"], hf["entropy_on"]
    for m in (off, on):
        assert m["generated_tokens"] == 4 * 10 * 4  # the tree stream of the test above
        assert 0 < m["engine_s"] <= m["wall_s"]
        assert m["decode_tok_per_s"] == pytest.approx(m["generated_tokens"] / m["engine_s"])
    assert (off["entropy_tokens"], on["entropy_tokens"]) == (0, on["generated_tokens"])
    r = hf["ratios"]
    assert r["decode_tok_per_s"] == pytest.approx(on["decode_tok_per_s"] / off["decode_tok_per_s"])
    assert r["tok_per_s"] == pytest.approx(on["tok_per_s"] / off["tok_per_s"]) and r["cpu_tok_per_s"] > 0
    assert r["same_tokens"]  # the same seeds and trees: reporting the entropy changes no token
    assert "entropy on/off" in capsys.readouterr().out
