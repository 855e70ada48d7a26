"""Where a run's numbers go: console, `metrics.jsonl`, W&B (offline without a key), TensorBoard (log.tensorboard),
a PNG, and any extra sink (the runtime adds Ray metrics gauges).

Metric names are verl's where verl has the figure (`critic/score/mean`, `critic/advantages/mean`,
`response_length/mean|clip_ratio`, `actor/pg_loss|entropy|ppo_kl|pg_clipfrac|grad_norm`, `timing_s/gen|update_actor`,
`val-core/<data_source>/acc/mean@k`; see verl's trainer/ppo/metric_utils.py), so a verl user's W&B panels carry
over; the project's own are grouped by what they describe (`tree/…` the trees' shape and sharing, `rollout/…`,
`perf/…`, `eval/…`, `fault/…`, `catpo/…`). Every step's
metrics are appended to `<run_dir>/metrics.jsonl` (the notebook and the curve read that file), and a sample of the
step's trees to `<run_dir>/trees.jsonl` (read by `treepo-ray viz`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from treepo_ray.job.redact import redacted

# The metrics printed on the console line of each step, with their short labels there (everything goes to the
# files, W&B and Ray under its full name).
CONSOLE_KEYS = (
    ("critic/score/mean", "reward"), ("response_length/mean", "response_len"), ("actor/kl_loss", "kl"),
    ("actor/pg_clipfrac", "clipfrac"), ("actor/entropy", "entropy"), ("tree/depth_max", "depth_max"),
    ("perf/staleness", "staleness"), ("perf/traj_per_s", "traj_per_s"), ("eval/accuracy", "accuracy"),
)
CONSOLE_IF_NONZERO = (
    ("verify/failed", "no_reward"), ("reward/errors", "reward_errors"), ("reward/timeouts", "reward_timeouts"),
    ("reward/nonfinite", "reward_nonfinite"),
)
"""Shown on the console line only in a step that has them: trajectories left out for want of a reward, by cause."""


@dataclass
class LogConfig:
    """What a run records and where."""

    wandb: bool = True
    """Log to Weights & Biases (offline, into the run directory, when WANDB_API_KEY is not set)."""
    wandb_project: str = "treepo-ray"
    """W&B project name."""
    trees_per_step: int = 2
    """How many of each step's trees are appended to trees.jsonl for `treepo-ray viz` (0 = none)."""
    console_every: int = 1
    """Print a metrics line every this many steps (0 = never)."""
    ray_metrics: bool = True
    """Export each metric as a ray.util.metrics Gauge tagged with the run and algorithm (Ray dashboard, Prometheus,
    Grafana: cluster/README.md)."""
    tensorboard: bool = False
    """Also write TensorBoard event files to <run_dir>/tensorboard (needs the tensorboard package:
    pip install 'treepo-ray[tensorboard]')."""
    redact_keys: list[str] = field(default_factory=list)
    """More config keys whose values are secrets, shown as "<redacted>" in the printed config, config.yaml and W&B:
    dotted paths (custom_reward_function.reward_kwargs.judge_url) or key names matched at any depth. Keys that name a
    credential (api_key, token, password, ...) and values in known token formats are hidden anyway (job/redact.py)."""


def _finite(metrics: dict) -> dict:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class TensorBoardSink:
    """A RunLogger sink writing each step's metrics as TensorBoard scalars under `<log_dir>` (same names as
    everywhere else: `tensorboard --logdir <run_dir>/tensorboard`)."""

    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(log_dir))

    def __call__(self, step: int, values: dict) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()


def check_tensorboard() -> None:
    """UserError when log.tensorboard is set but the tensorboard package is missing (checked before the run)."""
    import importlib.util

    from treepo_ray.config import UserError

    if importlib.util.find_spec("tensorboard") is None:
        raise UserError("log.tensorboard = true needs the tensorboard package: pip install 'treepo-ray[tensorboard]'")


ANSWERS_PER_TREE = 4


def answer_samples(step: int, trees: list[dict], per_tree: int = ANSWERS_PER_TREE) -> list[dict]:
    """What the model wrote at `step`, for samples.jsonl: one line per logged tree (the records of trees.jsonl, with
    decoded texts), its prompt and its first `per_tree` answers, each the text of its path from the prompt, its reward
    (None: unverified) and finish reason. `trained`: False for a tree the step did not train on (dynamic sampling
    dropped it: all its rewards were equal)."""
    out = []
    for rec in trees:
        parent, texts = rec["parent"], rec.get("texts") or [""] * len(rec["parent"])
        answers = []
        for end in rec.get("trajectories", [])[:per_tree]:
            path, node = [], end
            while node > 0:
                path.append(node)
                node = parent[node]
            answers.append({"text": "".join(texts[n] for n in reversed(path)), "reward": rec["reward"][end],
                            "finish": rec["finish"][end]})
        out.append({"step": step, "query_id": rec.get("query_id", ""), "trained": rec.get("trained", True),
                    "prompt": rec.get("prompt_text", ""), "answers": answers})
    return out


class RunLogger:
    """Fans each step's metrics out to every sink; `close()` draws the training curve."""

    def __init__(self, run_dir: Path, cfg: LogConfig, config_dict: dict, name: str, resume_step: int = 0,
                 sinks: list[Callable[[int, dict], None]] | None = None, run_id: str | None = None):
        """`sinks`: more places each step's finite metrics go (called with the step and the {name: value} dict;
        a sink with a close() method is closed with the logger). log.tensorboard adds a TensorBoardSink. `run_id`:
        the W&B run id (kept in the run directory, job/rundir.py), so that a resumed run continues the same W&B run."""
        self.run_dir, self.cfg = Path(run_dir), cfg
        self.sinks = list(sinks or [])
        if cfg.tensorboard:
            self.sinks.append(TensorBoardSink(self.run_dir / "tensorboard"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.trees_path = self.run_dir / "trees.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        if resume_step == 0:  # a fresh run starts fresh files (said, when there were any); a resumed one appends
            files = (self.metrics_path, self.trees_path, self.samples_path)
            replaced = [p.name for p in files if p.is_file() and p.stat().st_size]
            if replaced:
                print(f"a fresh start in {self.run_dir}: the {' and '.join(replaced)} of an earlier start there "
                      "are replaced", flush=True)
            for p in files:
                p.unlink(missing_ok=True)
        self._unwritten: dict[Path, list[str]] = {}
        self.write_error = ""
        """Why a write of metrics.jsonl or trees.jsonl failed (its lines are kept, and written with the next ones or
        by `flush`); whoever reads it clears it (the trainer, or `flush`, which raises it instead)."""
        self._wandb = None
        if cfg.wandb:
            if not os.environ.get("WANDB_API_KEY"):
                os.environ.setdefault("WANDB_MODE", "offline")
            import wandb

            self._wandb = wandb.init(project=cfg.wandb_project, name=name, id=run_id, dir=str(self.run_dir),
                                     config=redacted(config_dict, cfg.redact_keys), resume="allow",
                                     reinit="finish_previous")

    def log(self, step: int, metrics: dict) -> str:
        """Record `metrics` of `step`; returns the console line (empty when not printed this step)."""
        values = _finite(metrics)
        self._append(self.metrics_path, [json.dumps({"step": step, **values}) + "\n"])
        if self._wandb is not None:
            self._wandb.log(values, step=step)
        for sink in self.sinks:
            sink(step, values)
        every = self.cfg.console_every
        if every and step % every == 0:
            shown = [f"{label}={values[k]:.3g}" for k, label in CONSOLE_KEYS if k in values]
            shown += [f"{label}={values[k]:.0f}" for k, label in CONSOLE_IF_NONZERO if values.get(k)]
            return f"step {step}: " + " ".join(shown)
        return ""

    def save_trees(self, step: int, trees: list[dict]) -> None:
        """Append tree dicts (Tree.to_dict plus decoded segment texts) of `step` to trees.jsonl, and a few of their
        answers as text to samples.jsonl (`answer_samples`)."""
        self._append(self.trees_path, [json.dumps({"step": step, **t}) + "\n" for t in trees])
        self._append(self.samples_path, [json.dumps(s) + "\n" for s in answer_samples(step, trees)])

    def _append(self, path: Path, lines: list[str]) -> None:
        """Append `lines` after any kept from a failed write; on failure keep them all, the file cut back to where
        it was (no half line), and say why in `write_error`."""
        self._unwritten[path] = self._unwritten.get(path, []) + lines
        try:
            _append_whole(path, "".join(self._unwritten[path]).encode())
        except OSError as err:
            self.write_error = f"{path.name} not written: {err}"
            return
        del self._unwritten[path]

    def flush(self) -> None:
        """Write the lines kept from failed writes; OSError (with `write_error`, which it clears) if they still
        cannot be written."""
        for path in list(self._unwritten):
            self._append(path, [])
        error, self.write_error = self.write_error, ""
        if self._unwritten:
            raise OSError(error)

    def summary(self, values: dict) -> None:
        if self._wandb is not None:
            for k, v in _finite(values).items():
                self._wandb.summary[k] = v

    def close(self) -> Path | None:
        """Finish W&B and draw `training_curve.png`; returns its path (None when no step was logged)."""
        try:
            self.flush()
        except OSError as err:
            lost = sum(len(lines) for lines in self._unwritten.values())
            names = ", ".join(p.name for p in self._unwritten)
            print(f"{lost} lines of {names} could not be written: {err}", flush=True)
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        for sink in self.sinks:
            if callable(getattr(sink, "close", None)):
                sink.close()
        self.sinks = []
        return plot_curves(self.run_dir)


def _append_whole(path: Path, data: bytes) -> None:
    """Append `data` to `path` with unbuffered writes; when one fails (a full disk), cut the file back to where it
    was, so that no half line is left for the next try to follow."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of `<run_dir>/metrics.jsonl`, one per step: rows of the same step are merged, later values
    winning (a step's training metrics and its evaluation; a step redone by a resumed run)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(row["step"], {}).update(row)
    return [rows[s] for s in sorted(rows)]


CURVE_PANELS = (
    ("critic/score/mean", "train reward"), ("eval/accuracy", "held-out accuracy"),
    ("response_length/mean", "response length"), ("perf/traj_per_s", "trajectories / s of generation"),
)


def plot_curves(run_dir: str | Path) -> Path | None:
    """Draw the main training curves of a run into `<run_dir>/training_curve.png`."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(CURVE_PANELS), figsize=(4 * len(CURVE_PANELS), 3.2))
    for ax, (key, title) in zip(axes, CURVE_PANELS):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(run_dir) / "training_curve.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
