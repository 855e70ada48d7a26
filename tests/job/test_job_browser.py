"""What a user opens, opened in a real headless browser (Chromium): the tree page of `treepo-ray viz` parses into
one SVG box per node and draws them in their reward colours, and the training curve draws a line in every panel.
scripts/setup.sh installs chromium where apt-get can; without it these tests skip, saying so."""

import json
import shutil
import subprocess

import numpy as np
import pytest

from treepo_ray.job.logs import CURVE_PANELS, plot_curves
from treepo_ray.job.viz import main as viz_main
from test_job_viz import saved_tree

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/setup.sh installs it "
                                                          "with apt-get: apt-get install -y chromium)")


def chromium(tmp_path, *args: str) -> str:
    result = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             f"--user-data-dir={tmp_path / 'profile'}", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def screenshot(tmp_path, url: str, size: str = "1200,900") -> np.ndarray:
    from PIL import Image

    out = tmp_path / "shot.png"
    chromium(tmp_path, f"--screenshot={out}", f"--window-size={size}", url)
    return np.asarray(Image.open(out).convert("RGB")).astype(int)


def has_colour(pixels: np.ndarray, hex_colour: str, tol: int = 8) -> int:
    """How many pixels are within `tol` of `hex_colour` in every channel."""
    rgb = np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(pixels - rgb).max(axis=-1) <= tol).sum())


def test_tree_page_renders_every_node_in_its_reward_colour(tmp_path):
    with (tmp_path / "trees.jsonl").open("w") as f:
        for step in (1, 2):
            f.write(json.dumps(saved_tree(step)) + "\n")
    assert viz_main([str(tmp_path)]) == 0
    page = (tmp_path / "trees.html").resolve().as_uri()
    dom = chromium(tmp_path, "--dump-dom", page)
    # The browser's DOM: two trees of five nodes, each node a box with its hover text.
    assert dom.count("<svg") == 2 and dom.count("<rect") == 10, dom[:2000]
    assert "c&lt;&amp;&gt;" in dom
    pixels = screenshot(tmp_path, page)
    # Drawn: the reward-1 leaves green, the reward-0 leaf red (whole boxes of 90 x 14 pixels, less the borders).
    assert has_colour(pixels, "#00ff60") > 2 * 800 and has_colour(pixels, "#ff0060") > 800


def test_training_curve_draws_a_line_in_every_panel(tmp_path):
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for step in range(1, 11):
            f.write(json.dumps({"step": step, "critic/score/mean": step / 10, "eval/accuracy": step / 20,
                                "response_length/mean": 100 + step, "perf/traj_per_s": 5 + step % 3}) + "\n")
    png = plot_curves(tmp_path)
    pixels = screenshot(tmp_path, png.resolve().as_uri(), size="1600,320")
    line = "#1f77b4"  # matplotlib's first colour
    panel_w = pixels.shape[1] // len(CURVE_PANELS)
    drawn = [has_colour(pixels[:, i * panel_w:(i + 1) * panel_w], line, tol=20) for i in range(len(CURVE_PANELS))]
    assert all(n > 100 for n in drawn), drawn
