"""The Grafana dashboard of the project's metrics (cluster/grafana/): a dashboard Grafana can import, whose every query
selects the Ray gauges by run and algorithm. That its metric names are the ones a run exports is checked against a
real run in tests/runtime/test_runtime_train.py."""

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parents[2] / "cluster" / "grafana" / "treepo_ray_dashboard.json"


def test_dashboard_is_importable_and_filters_by_run_and_algorithm():
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] and d["title"] and d["schemaVersion"] >= 27
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert {"run", "algorithm"} <= set(variables)
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"]) and len(panels) >= 20
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert 'run=~"$run"' in t["expr"] and 'algorithm=~"$algorithm"' in t["expr"], t["expr"]
            assert re.search(r"ray_treepo_\w+", t["expr"]), t["expr"]
    titles = " ".join(p["title"] for p in panels)
    for key in ("critic/score/mean", "val-core/<source>/acc/mean@k", "actor/pg_loss", "tree/shared_prefix_share",
                "timing_s/*", "perf/traj_per_s"):
        assert key in titles, key
