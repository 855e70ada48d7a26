"""`treepo-ray viz RUN_DIR`: render the trees a run saved (trees.jsonl) as one self-contained HTML page.

Each node is a box (one generated segment) placed by depth (x) and leaf order (y), coloured by its propagated
reward (red 0 -> green 1, grey when unknown); hovering shows the segment's decoded text and its numbers. Below each
tree, its prompt and every segment's text as written (newlines kept; a text longer than FOLD_CHARS shows its start
and opens on a click, <details>). A tree the step did not train on (dynamic sampling dropped it) says so. Where the
record holds entropies, each branch point (a node with two children or more) gets a dot where its children's lines
start, coloured by the entropy its children's first tokens were drawn from (light low, dark high, on the page's
scale: the legend) and showing it on hover.
No scripts or external files: inline SVG with <title> tooltips, so the page opens anywhere.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import re
from pathlib import Path

from treepo_ray.config import UserError

BOX_W, BOX_H, GAP_X, GAP_Y = 90, 14, 30, 6
FOLD_CHARS = 200
"""A text longer than this shows its first FOLD_CHARS characters; the rest opens on a click."""
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def escaped(text: str) -> str:
    """`text` for an HTML page: escaped, newlines and tabs kept, other control characters (a byte-level model writes
    any byte) shown as \\xNN."""
    return html.escape(_CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text))


def folded(text: str, css: str = "text") -> str:
    """`text` in a block that keeps its newlines (white-space: pre-wrap); folded when longer than FOLD_CHARS: its
    start shown, the rest on a click."""
    if len(text) <= FOLD_CHARS:
        return f"<div class='{css}'>{escaped(text)}</div>"
    return (f"<details class='{css}'><summary>{escaped(text[:FOLD_CHARS])}<span class='more'> … "
            f"({len(text) - FOLD_CHARS} more characters)</span></summary>{escaped(text[FOLD_CHARS:])}</details>")


def node_texts(rec: dict) -> str:
    """Every generated segment's text, in node order (depth first: each path reads down the list), with its parent,
    reward and finish reason."""
    texts = rec.get("texts") or [""] * len(rec["parent"])
    rewards, finish = rec.get("reward", []), rec.get("finish", [])
    ends = set(rec.get("trajectories", []))
    rows = []
    for i in range(1, len(rec["parent"])):
        r = rewards[i] if i < len(rewards) else None
        head = (f"#{i} after #{rec['parent'][i]} · reward {'?' if r is None else f'{r:.3f}'} · "
                f"{finish[i] if i < len(finish) else 'none'}{' · answer end' if i in ends else ''}")
        rows.append(f"<li><span class='node'>{html.escape(head)}</span>{folded(texts[i] if i < len(texts) else '')}"
                    "</li>")
    return f"<ol class='texts'>{''.join(rows)}</ol>"


def load_trees(run_dir: str | Path, step: int | None = None, max_trees: int = 50) -> list[dict]:
    """Saved tree records of a run (all steps, or one), the most recent `max_trees` of them."""
    path = Path(run_dir) / "trees.jsonl"
    if not Path(run_dir).is_dir():
        raise UserError(f"run directory {str(run_dir)!r} does not exist")
    if not path.exists():
        raise UserError(f"{path} does not exist; was the run started with log.trees_per_step > 0?")
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{i + 1} is not valid JSON: {e}") from None
        if step is None or row.get("step") == step:
            rows.append(row)
    return rows[-max_trees:]


def reward_colour(r: float | None) -> str:
    """Red (0) through yellow to green (1); grey when the reward is unknown."""
    if r is None or (isinstance(r, float) and math.isnan(r)):
        return "#bbbbbb"
    r = min(max(float(r), 0.0), 1.0)
    red, green = (255, int(510 * r)) if r < 0.5 else (int(510 * (1 - r)), 255)
    return f"#{red:02x}{min(green, 255):02x}60"


def children(parent: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parent]
    for i in range(1, len(parent)):
        kids[parent[i]].append(i)
    return kids


def branch_entropies(rec: dict) -> dict[int, float]:
    """Branch point -> the entropy at it: the first entropy of its first child that has one (all children's first
    tokens come from the same distribution). Empty for a record without entropies."""
    ent = rec.get("entropy") or []
    out = {}
    for node, kids in enumerate(children(rec["parent"])):
        first = next((ent[c][0] for c in kids if c < len(ent) and ent[c]), None) if len(kids) >= 2 else None
        if isinstance(first, (int, float)) and not math.isnan(first):  # null or NaN: none reported
            out[node] = float(first)
    return out


def entropy_colour(e: float, top: float) -> str:
    """Light (0) to dark violet (`top` and above): the scale of the page's branch-point entropies."""
    t = min(max(e / top, 0.0), 1.0) if top > 0 else 0.0
    lo, hi = (235, 230, 255), (60, 0, 140)
    return "#" + "".join(f"{round(a + (b - a) * t):02x}" for a, b in zip(lo, hi))


def layout(parent: list[int]) -> tuple[list[int], list[float]]:
    """Depth and vertical slot of every node: leaves take consecutive slots, a parent sits at its children's mean."""
    n = len(parent)
    kids = children(parent)
    depth, slot, next_leaf = [0] * n, [0.0] * n, 0
    stack = [(0, False)]
    while stack:  # iterative post-order walk (trees can be deeper than Python's recursion limit allows)
        node, seen = stack.pop()
        if not seen:
            stack.append((node, True))
            for c in reversed(kids[node]):
                depth[c] = depth[node] + 1
                stack.append((c, False))
        elif kids[node]:
            slot[node] = sum(slot[c] for c in kids[node]) / len(kids[node])
        else:
            slot[node], next_leaf = float(next_leaf), next_leaf + 1
    return depth, slot


def tree_svg(rec: dict, entropy_top: float | None = None) -> str:
    """One tree as an inline <svg>; branch points with an entropy get a dot coloured on the scale 0..entropy_top
    (default: this tree's highest)."""
    parent, rewards = rec["parent"], rec.get("reward", [None] * len(rec["parent"]))
    texts = rec.get("texts") or [""] * len(parent)
    depth, slot = layout(parent)
    x = [d * (BOX_W + GAP_X) for d in depth]
    y = [s * (BOX_H + GAP_Y) + BOX_H for s in slot]
    width = max(x) + BOX_W + 10
    height = max(y) + 2 * BOX_H
    ends = set(rec.get("trajectories", []))
    entropy = branch_entropies(rec)
    top = max(entropy.values(), default=0.0) if entropy_top is None else entropy_top
    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg">']
    for i in range(1, len(parent)):
        p = parent[i]
        parts.append(f'<line x1="{x[p] + BOX_W}" y1="{y[p]}" x2="{x[i]}" y2="{y[i]}" stroke="#999"/>')
    for i in range(len(parent)):
        r = rewards[i] if i < len(rewards) else None
        label = "prompt" if i == 0 else f"#{i} {len(rec['tokens'][i])} tok"
        finish = rec.get("finish", ["none"] * len(parent))[i]
        at_branch = f" entropy at branch {entropy[i]:.3f}" if i in entropy else ""
        tip = (f"node {i} depth {depth[i]} reward {'?' if r is None else f'{r:.3f}'} finish {finish}{at_branch}"
               f"{' (trajectory end)' if i in ends else ''}\n\n{texts[i] if i < len(texts) else ''}")
        stroke = ' stroke="#000" stroke-width="2"' if i in ends else ' stroke="#555"'
        parts.append(
            f'<g><title>{escaped(tip)}</title><rect x="{x[i]}" y="{y[i] - BOX_H / 2}" width="{BOX_W}" '
            f'height="{BOX_H}" rx="3" fill="{reward_colour(r)}"{stroke}/><text x="{x[i] + 4}" y="{y[i] + 4}" '
            f'font-size="10" font-family="monospace">{html.escape(label)}</text></g>'
        )
    for i, e in entropy.items():  # after the boxes, so the dots sit on top
        parts.append(f'<g><title>branch point {i}: entropy {e:.3f} nats</title><circle cx="{x[i] + BOX_W}" '
                     f'cy="{y[i]}" r="5" fill="{entropy_colour(e, top)}" stroke="#333"/></g>')
    parts.append("</svg>")
    return "".join(parts)


def render_html(records: list[dict], title: str) -> str:
    """The whole page: one section per tree, newest last."""
    top = max((e for rec in records for e in branch_entropies(rec).values()), default=None)
    sections = []
    for rec in records:
        meta = rec.get("meta", {})
        leaf_r = [rec["reward"][n] for n in rec.get("trajectories", []) if rec["reward"][n] is not None]
        acc = f"{sum(leaf_r) / len(leaf_r):.2f}" if leaf_r else "?"
        skipped = (" · <span class='dropped'>not trained (dropped by dynamic sampling)</span>"
                   if rec.get("trained", True) is False else "")
        head = (f"step {rec.get('step', '?')} · query {html.escape(str(rec.get('query_id', '')))} · "
                f"{len(rec['parent'])} nodes · {len(rec.get('trajectories', []))} trajectories · mean reward {acc}"
                f"{skipped}")
        extra = html.escape(json.dumps({k: v for k, v in meta.items() if isinstance(v, (int, float, str))}))
        sections.append(f"<section><h3>{head}</h3>{folded(rec.get('prompt_text', ''), 'prompt')}"
                        f"<p class='meta'>{extra}</p><div class='tree'>{tree_svg(rec, top)}</div>{node_texts(rec)}"
                        "</section>")
    style = ("body{font-family:sans-serif;margin:1.5em} section{border-top:1px solid #ccc;padding:.5em 0} "
             ".prompt{font-family:monospace;white-space:pre-wrap;background:#f6f6f6;padding:.4em} "
             ".text{font-family:monospace;white-space:pre-wrap;background:#fafafa;padding:.2em .4em;margin:.1em 0} "
             "summary{cursor:pointer} .more{color:#888;font-family:sans-serif} .node{color:#666;font-size:80%} "
             ".dropped{color:#b00} .meta{color:#666;font-size:80%} .tree{overflow-x:auto}")
    legend = ("<p>Each box is one generated segment, coloured by its propagated reward "
              "(<span style='background:#ff0060'>0</span> → <span style='background:#ffff60'>0.5</span> → "
              "<span style='background:#00ff60'>1</span>, grey unknown); thick borders end a trajectory. "
              "Hover a box for its decoded text; each segment's text is listed below its tree (long ones folded: "
              "click to read on).</p>")
    if top is not None:  # only pages whose trees carry entropies
        def swatch(e: float) -> str:
            ink = "#fff" if e > top / 2 else "#000"  # readable on the dark end
            return f"<span style='background:{entropy_colour(e, top)};color:{ink}'>&nbsp;{e:.2f}&nbsp;</span>"

        legend += (f"<p>Dots mark branch points, coloured by the entropy (nats) their children's first tokens were "
                   f"drawn from: {swatch(0.0)} → {swatch(top / 2)} → {swatch(top)} (this page's highest); hover a "
                   f"dot for its value.</p>")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(title)}</h1>{legend}{''.join(sections)}"
            f"</body></html>")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, prog="treepo-ray viz", description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="run directory holding trees.jsonl")
    ap.add_argument("--out", default=None, help="output HTML path (default RUN_DIR/trees.html)")
    ap.add_argument("--step", type=int, default=None, help="only the trees of this step")
    ap.add_argument("--max-trees", type=int, default=50, help="at most this many (most recent) trees")
    args = ap.parse_args(argv)
    records = load_trees(args.run_dir, args.step, args.max_trees)
    if not records:
        print(f"no trees found in {args.run_dir}/trees.jsonl" + (f" for step {args.step}" if args.step else ""))
        return 1
    out = Path(args.out) if args.out else Path(args.run_dir) / "trees.html"
    out.write_text(render_html(records, f"treepo-ray trees · {Path(args.run_dir).name}"))
    print(f"wrote {len(records)} trees to {out}")
    return 0
