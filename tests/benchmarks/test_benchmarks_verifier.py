"""`treepo-ray bench verifier`: accuracy per category of a labelled pairs file, the time per verification and the kill
of pathological inputs, as JSON; a missing pairs file is one line and exit status 2."""

import json
from pathlib import Path

import pytest

from treepo_ray.cli import main as cli

PAIRS = Path(__file__).parents[1] / "rewards" / "answer_pairs.jsonl"


@pytest.mark.slow
def test_bench_verifier_reports_categories_time_and_kills(tmp_path, capsys):
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()[:40]]
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "bench.json"
    assert cli(["bench", "verifier", "--pairs", str(pairs), "--timeout-s", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["pairs"] == 40 and set(result["categories"]) == {r["category"] for r in rows}
    assert result["pathological"]["all_wrong"] and result["pathological"]["workers_killed"] >= 2
    # Killed at the 1 s limit, not left to run (the LaTeX input backtracks for minutes); the bound is loose since
    # the wall time of kills and restarts stretches on a loaded machine (4.6 s seen beside other jobs).
    assert result["pathological"]["seconds"] < 30.0
    assert 0 < result["seconds_per_pair_batched"] < 1.0
    assert cli(["bench", "verifier", "--pairs", str(tmp_path / "missing.jsonl")]) == 2
    assert "no pairs file" in capsys.readouterr().err
