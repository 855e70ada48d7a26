"""The HTML tree view of a run's saved trees (job/viz.py, `treepo-ray viz`; no Ray)."""

import json

import pytest

from treepo_ray.config import UserError
from treepo_ray.job.viz import branch_entropies, entropy_colour, layout, main as viz_main, render_html, reward_colour
from treepo_ray.tree import Tree


def saved_tree(step):
    t = Tree(prompt_ids=[1, 2], query_id=f"q{step}")
    a = t.add_node(0, [3, 4], [-0.1, -0.2])
    t.trajectories = [t.add_node(a, [5], [-0.3], "eos"), t.add_node(a, [6], [-0.4], "eos"), t.add_node(0, [7], [-1.0], "eos")]
    t.set_trajectory_rewards([1.0, 0.0, 1.0])
    return {"step": step, **t.to_dict(), "prompt_text": "1+1=<?>", "texts": ["", "ab", "c<&>", "d", "e"]}


def test_layout_puts_leaves_in_order_and_parents_between_children():
    depth, slot = layout([-1, 0, 1, 1, 0])
    assert depth == [0, 1, 2, 2, 1]
    assert slot[2:4] == [0.0, 1.0] and slot[4] == 2.0
    assert slot[1] == 0.5 and slot[0] == pytest.approx((0.5 + 2.0) / 2)


def test_reward_colours_run_from_red_to_green():
    assert reward_colour(0.0) == "#ff0060"
    assert reward_colour(1.0) == "#00ff60"
    assert reward_colour(None) == "#bbbbbb"


def test_viz_writes_a_self_contained_page(tmp_path, capsys):
    with (tmp_path / "trees.jsonl").open("w") as f:
        for step in (1, 2):
            f.write(json.dumps(saved_tree(step)) + "\n")
    assert viz_main([str(tmp_path)]) == 0
    page = (tmp_path / "trees.html").read_text()
    assert page.count("<svg") == 2 and "<script" not in page and "http" not in page.replace("http://www.w3.org", "")
    assert "c&lt;&amp;&gt;" in page  # decoded text, escaped, in the hover title
    assert "reward 0.500" in page  # the inner node's propagated reward
    assert viz_main([str(tmp_path), "--step", "2", "--out", str(tmp_path / "two.html")]) == 0
    assert (tmp_path / "two.html").read_text().count("<svg") == 1
    assert "q2" in render_html([saved_tree(2)], "t")


def test_branch_points_are_coloured_by_their_entropy(tmp_path):
    t = Tree(prompt_ids=[1, 2], query_id="q")
    a = t.add_node(0, [3, 4], [-0.1, -0.2], entropy=[0.5, 0.1])
    t.trajectories = [t.add_node(a, [5], [-0.3], "eos", entropy=[1.2]),
                      t.add_node(a, [6], [-0.4], "eos", entropy=[1.2]), t.add_node(0, [7], [-1.0], "eos", entropy=[0.5])]
    t.set_trajectory_rewards([1.0, 0.0, 1.0])
    rec = {"step": 1, **json.loads(json.dumps(t.to_dict())), "prompt_text": "p", "texts": [""] * 5}
    assert branch_entropies(rec) == {0: 0.5, 1: 1.2}  # the root and node 1, from their first child's first token
    assert entropy_colour(0.0, 1.2) == "#ebe6ff" and entropy_colour(1.2, 1.2) == entropy_colour(3.0, 1.2) == "#3c008c"
    with (tmp_path / "trees.jsonl").open("w") as f:
        f.write(json.dumps(rec) + "\n")
    assert viz_main([str(tmp_path)]) == 0
    page = (tmp_path / "trees.html").read_text()
    assert page.count("<circle") == 2  # the leaves and node 4 branch nowhere
    assert "<title>branch point 1: entropy 1.200 nats</title>" in page and "entropy at branch 0.500" in page
    assert f'fill="{entropy_colour(1.2, 1.2)}"' in page and "Dots mark branch points" in page and "1.20" in page

    plain = saved_tree(2)
    assert "<circle" not in render_html([plain], "t") and "Dots mark" not in render_html([plain], "t")
    del plain["entropy"]  # a tree saved before trees carried entropies renders as before
    assert "<circle" not in render_html([plain], "t") and branch_entropies(plain) == {}


def test_viz_of_a_run_without_trees_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="trees.jsonl"):  # one line from the CLI, exit status 2
        viz_main([str(tmp_path)])


def test_viz_shows_each_text_with_its_newlines_and_folds_a_long_one(tmp_path):
    rec = saved_tree(3)
    long = "".join(f"step {k}: 12 * {k} = {12 * k}\n" for k in range(40))  # ~800 characters over 40 lines
    rec["texts"] = ["", "First line\n<b>second</b> & third", "c", "\x00byte\x07", long]
    rec["prompt_text"] = "Q: 1+1?\nA:"
    rec["trained"] = False
    with (tmp_path / "trees.jsonl").open("w") as f:
        f.write(json.dumps(rec) + "\n")
    assert viz_main([str(tmp_path)]) == 0
    page = (tmp_path / "trees.html").read_text()
    assert "white-space:pre-wrap" in page
    # the texts as written, outside the hover titles: newlines kept, markup escaped
    assert "<div class='text'>First line\n&lt;b&gt;second&lt;/b&gt; &amp; third</div>" in page
    assert "<div class='prompt'>Q: 1+1?\nA:</div>" in page
    assert "<div class='text'>\\x00byte\\x07</div>" in page and "\x00" not in page  # a byte-level model's bytes
    # the long one: its first 200 characters shown, the rest on a click
    head, rest = long[:200], long[200:]
    assert f"<details class='text'><summary>{head}<span class='more'> … ({len(rest)} more characters)</span>" \
           f"</summary>{rest}</details>" in page
    assert page.count("<details") == 1
    assert "not trained" in page
