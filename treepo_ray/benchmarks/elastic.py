"""Does the generator pool scale itself? The default job on a local Ray with Ray's own autoscaler, against the same
job on a pool of fixed size.

    treepo-ray bench elastic [config.yaml] [--steps N] [--max-nodes N] [--slow-from F] [--slow-s S]
                             [--drain-at K] [--kill-at K] [--json PATH] [key=value ...]

The cluster (runtime/autoscaling.py) is one machine: a head with the learner, the schedulers, the verifiers and room
for one engine, and a `gen` node type (min 0, max --max-nodes) with room for one engine each, started and stopped
by the autoscaler as on a cloud. Engines ask for a `generator` resource that only those offer. The scaling policy
(runtime.elastic.autoscale, job/scaling.py) sets the pool's target between runtime.num_engines (1) and 1 +
--max-nodes: while the learner waits for batches it asks for engines (pending actors, the demand the autoscaler
answers with a node); from step F x N on, the learner is slowed on purpose (S seconds of sleep after each step: the
run's observer runs in the learner's loop), rollout runs ahead, and the policy gives engines back (their nodes idle
and the autoscaler removes them). At step --drain-at a generator node is drained as on a spot notice (`ray
drain-node`'s call, a 30 s deadline; its engine leaves first and its node goes once idle), at --kill-at one is
killed without notice (its raylet SIGKILLed): a lost engine's requests are re-sent, so no trajectory may be lost.

The fixed-size run is the same job, seeds and slowdown with the policy off and one engine. With
runtime.max_staleness >= 1 (needed for the learner to stop waiting at all: at 0 it always waits for a whole batch),
which weights grow a batch depends on timing, so the two runs part once one runs ahead of the other: `same` says per
quantity, `versions` shows each batch's weights version.

JSON: `engines` (per step: the pool's size and target, the learner's wait share, batches queued), `scale_ups`,
`scale_downs` (the policy's decisions), `preemptions` (drains and kills done), `trajectories_lost` (against the
fixed run, step by step), `wait_share_before` / `wait_share_after` (the learner's mean wait share over the steps
after the pipeline filled and up to the first scale-up, and over those from when the pool reached its new size
until the slowdown or the first preemption: `windows`), `fixed_wait_share_before` / `_after` (the fixed run's over
the same steps: what the extra engines did not do), `identical`, `same`, `versions`, and the faults of both runs.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import time

from treepo_ray.benchmarks.common import parse_job_args, write_json

# An engine of at most 16 rows at a time: one of them cannot keep up with the learner, so rollout is the bottleneck
# until the pool grows (with all 128 rows of a step at once, one engine keeps up on two cores).
DEFAULTS = ["model.engine_kwargs={max_batch_size: 16}", "runtime.num_engines=1", "runtime.engine_cpus=0", "runtime.engine_resources={generator: 1}",
            "runtime.elastic.poll_s=0.2", "runtime.elastic.patience=2", "runtime.elastic.cooldown_s=8",
            "trainer.eval_size=0", "log.wandb=false", "log.ray_metrics=false",
            "log.console_every=0"]


def run_once(cfg, run_dir: str, slow_from: int, slow_s: float, events: dict, cluster) -> dict:
    """One run of the training job; every step's trees, rewards, loss and the pool's figures. `events`: step ->
    'drain' or 'kill', done to a generator node right after that step (skipped if none is up)."""
    from treepo_ray.runtime.autoscaling import drain_node
    from treepo_ray.runtime.train import run

    rows: list[dict] = []
    done: list[dict] = []

    def observe(batch, metrics) -> None:
        rows.append({"step": batch.step, "version": batch.version, "trees": [t["tokens"] for t in batch.trees],
                     "rewards": [t["reward"] for t in batch.trees], "loss": metrics.get("actor/loss"),
                     "trajectories": sum(len(t["trajectories"]) for t in batch.trees),
                     "size": metrics.get("pool/size"), "target": metrics.get("pool/target"),
                     "wait_share": metrics.get("pool/wait_share"), "queued": metrics.get("pool/queued"),
                     "scale_ups": metrics.get("pool/scale_ups", 0.0),
                     "scale_downs": metrics.get("pool/scale_downs", 0.0),
                     "t": time.monotonic()})
        what = events.get(batch.step)
        nodes = cluster.worker_nodes("generator")
        if what and nodes:
            node = nodes[0]
            ok = drain_node(node, 30.0) if what == "drain" else cluster.kill_node(node) > 0
            done.append({"step": batch.step, "what": what, "node": node[-5:], "done": bool(ok)})
            print(f"bench elastic: {what} of node {node[-5:]} after step {batch.step}", flush=True)
        if batch.step >= slow_from:
            time.sleep(slow_s)  # the learner slowed on purpose: rollout runs ahead of it

    tr = dataclasses.replace(cfg.trainer, run_dir=run_dir, resume="")
    summary = run(dataclasses.replace(cfg, trainer=tr), observe)
    return {"steps": summary["steps"], "wall_s": summary["train_time_s"], "faults": summary["faults"], "rows": rows,
            "preemptions": done}


def windows(rows: list[dict], warmup: int, end: int) -> tuple[range, range] | None:
    """The steps before the first scale-up (after the pipeline filled: `warmup` steps), and those from when the
    pool reached its new size until step `end` (the slowdown or the first preemption, which shrink it)."""
    first = next((r["step"] for r in rows if r["scale_ups"]), None)
    if first is None:
        return None
    grown = next((r["step"] for r in rows if r["step"] > first and r["size"] >= r["target"]), end)
    return range(warmup, first + 1), range(grown, end)


def mean_wait(rows: list[dict], steps: range) -> float | None:
    shares = [r["wait_share"] for r in rows if r["step"] in steps]
    return sum(shares) / len(shares) if shares else None


def run(cfg, steps: int, max_nodes: int, slow_from: int, slow_s: float, events: dict) -> dict:
    from treepo_ray.runtime.autoscaling import LocalAutoscalingCluster

    head = {"CPU": 2, "generator": 1}
    gen = {"gen": {"resources": {"CPU": 0, "generator": 1}, "min_workers": 0, "max_workers": max_nodes}}
    cluster = LocalAutoscalingCluster(head, gen, idle_timeout_s=5.0)
    tr = dataclasses.replace(cfg.trainer, steps=steps, stop_after=0)
    rt = dataclasses.replace(cfg.runtime, address=cluster.address)
    on = dataclasses.replace(rt.elastic, autoscale=True, max_engines=1 + max_nodes)
    off = dataclasses.replace(rt.elastic, autoscale=False, max_engines=0)
    results = {}
    try:
        with tempfile.TemporaryDirectory(prefix="treepo-elastic-") as storage_path:
            for name, elastic, ev in (("elastic", on, events), ("fixed", off, {})):
                run_cfg = dataclasses.replace(cfg, trainer=tr, runtime=dataclasses.replace(rt, elastic=elastic),
                                              log=dataclasses.replace(cfg.log, trees_per_step=tr.prompts_per_step))
                results[name] = r = run_once(run_cfg, f"{storage_path}/{name}", slow_from, slow_s, ev, cluster)
                print(f"{name:>7}: {r['steps']} steps in {r['wall_s']:.1f} s, engines "
                      f"{[int(row['size']) for row in r['rows']]}", flush=True)
    finally:
        cluster.shutdown()
    el, fx = results["elastic"], results["fixed"]
    column = lambda run, key: [row[key] for row in run["rows"]]  # noqa: E731
    same = {key: column(el, key) == column(fx, key) for key in ("trees", "rewards", "loss")}
    lost = sum(max(0, a["trajectories"] - b["trajectories"]) for a, b in zip(fx["rows"], el["rows"]))
    lost += sum(row["trajectories"] for row in fx["rows"][len(el["rows"]):])
    warmup = cfg.runtime.max_staleness + 1
    win = windows(el["rows"], warmup, min([slow_from, *[s + 1 for s in events]]))
    before, after = (mean_wait(el["rows"], w) for w in win) if win else (None, None)
    fixed_before, fixed_after = (mean_wait(fx["rows"], w) for w in win) if win else (None, None)
    out = {
        "steps": steps, "max_nodes": max_nodes, "slow_from_step": slow_from, "slow_s": slow_s,
        "max_staleness": cfg.runtime.max_staleness,
        "engines": [{"step": r["step"], "size": r["size"], "target": r["target"], "wait_share": r["wait_share"],
                     "queued": r["queued"], "t_s": r["t"] - el["rows"][0]["t"]} for r in el["rows"]],
        "scale_ups": int(sum(column(el, "scale_ups"))), "scale_downs": int(sum(column(el, "scale_downs"))),
        "wait_share_before": before, "wait_share_after": after,
        "windows": {"before": [win[0].start, win[0].stop], "after": [win[1].start, win[1].stop]} if win else None,
        "fixed_wait_share_before": fixed_before, "fixed_wait_share_after": fixed_after,
        "preemptions": el["preemptions"], "trajectories_lost": lost,
        "identical": all(same.values()) and el["steps"] == fx["steps"], "same": same,
        "versions": {"elastic": column(el, "version"), "fixed": column(fx, "version")},
        "faults": {"elastic": el["faults"], "fixed": fx["faults"]},
        "wall_s": {"elastic": el["wall_s"], "fixed": fx["wall_s"]},
    }
    print(f"elastic: {out['scale_ups']} scale-ups, {out['scale_downs']} scale-downs, preemptions "
          f"{[p['what'] for p in el['preemptions']]}, trajectories lost {lost}; learner wait share "
          f"{_pct(before)} before the first scale-up, {_pct(after)} after (the fixed run over the same steps: "
          f"{_pct(fixed_before)}, {_pct(fixed_after)}); same as the fixed run: {same}")
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def main(argv: list[str] | None = None) -> int:
    def flags(ap) -> None:
        ap.add_argument("--steps", type=int, default=36, help="training steps of each run")
        ap.add_argument("--max-nodes", type=int, default=2, help="the most generator nodes the autoscaler starts")
        ap.add_argument("--slow-from", type=float, default=0.7, help="the share of steps after which the learner "
                        "is slowed")
        ap.add_argument("--slow-s", type=float, default=4.0, help="seconds the learner sleeps after each slow step")
        ap.add_argument("--drain-at", type=int, default=20, help="drain a generator node after this step (-1: none)")
        ap.add_argument("--kill-at", type=int, default=23, help="kill a generator node after this step (-1: none)")

    parsed = parse_job_args(argv, "elastic", __doc__, flags, before=DEFAULTS)
    if isinstance(parsed, int):
        return parsed
    args, cfg = parsed
    if args.steps < 2 or args.max_nodes < 1 or not 0 < args.slow_from <= 1 or args.slow_s < 0:
        print("treepo-ray bench elastic: --steps must be >= 2, --max-nodes >= 1, --slow-from in (0, 1], "
              "--slow-s >= 0", file=sys.stderr)
        return 2
    events = {args.drain_at: "drain", args.kill_at: "kill"}
    events.pop(-1, None)
    result = run(cfg, args.steps, args.max_nodes, int(args.slow_from * args.steps), args.slow_s, events)
    write_json(args.json, result)
    print(json.dumps({k: result[k] for k in ("scale_ups", "scale_downs", "trajectories_lost", "wait_share_before",
                                              "wait_share_after", "fixed_wait_share_before",
                                              "fixed_wait_share_after")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
