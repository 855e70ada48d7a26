"""`treepo-ray compare` (benchmarks/compare.py): the summary over seeds by hand (no Ray, no model), and one short
real run of two algorithms checked for the JSON layout and the plots."""

import json
import math
import re
from pathlib import Path

import pytest

from treepo_ray.benchmarks.compare import (accuracy_at, branch_figures, first_reaching, main, parse_algos, parse_args,
                                           plot, run_configs, summarise, table, verdict)
from treepo_ray.config import UserError
from treepo_ray.tree import Tree, branch_metrics


def run(seed, curve, rows=(), **extra):
    return {"seed": seed, "curve": curve, "final_accuracy": curve[-1][2], "wall_s": curve[-1][0],
            "sampled_tokens": curve[-1][1], "steps": 10, "tree_counters": {"branches": 2.0},
            "branches": branch_figures(list(rows)), **extra}


def test_time_and_tokens_to_grpo_final_accuracy():
    algos = {
        "grpo": {"runs": [run(0, [[0, 0, 0.2], [50, 500, 0.3], [100, 1000, 0.5]]),
                          run(1, [[0, 0, 0.2], [50, 500, 0.4], [100, 1000, 0.3]])]},
        "treepo": {"runs": [run(0, [[0, 0, 0.2], [30, 400, 0.45], [100, 900, 0.6]]),
                            run(1, [[0, 0, 0.2], [40, 450, 0.3], [60, 700, 0.4], [100, 950, 0.5]])]},
        "dapo": {"runs": [run(0, [[0, 0, 0.2], [100, 800, 0.35]]), run(1, [[0, 0, 0.2], [100, 800, 0.5]])]},
    }
    summarise(algos)
    g, t, d = algos["grpo"], algos["treepo"], algos["dapo"]
    assert g["final_accuracy"] == pytest.approx(0.4) and g["final_accuracy_spread"] == [0.3, 0.5]
    # GRPO's mean final accuracy is 0.4: TreePO's seeds get there at 30 s / 400 tokens and 60 s / 700 tokens.
    assert t["time_to_grpo_final_s"] == pytest.approx(45) and t["tokens_to_grpo_final"] == pytest.approx(550)
    assert g["time_to_grpo_final_s"] == pytest.approx(75)  # seed 0 at 100 s, seed 1 at 50 s
    assert d["time_to_grpo_final_s"] is None  # seed 0 never gets there: no mean
    assert t["tree_counters"] == {"branches": 4.0}
    # each run's own time and tokens to GRPO's final, to compare seed by seed
    assert [(r["time_to_grpo_final_s"], r["tokens_to_grpo_final"]) for r in t["runs"]] == [(30, 400), (60, 700)]
    assert [r["time_to_grpo_final_s"] for r in d["runs"]] == [None, 100]
    v = verdict(algos)
    assert v["time_ratio"] == pytest.approx(45 / 100) and v["time_ratio_met"] and v["final_not_below_grpo"]
    assert accuracy_at(t["runs"][1]["curve"], 65, 0) == 0.4 and first_reaching(g["runs"][0]["curve"], 0.9, 0) is None


def test_catpo_heal_rate_cost_and_equal_tokens():
    heal = {"attempts": 10.0, "healed": 6.0, "errors": 0.0, "dead_wrong": 10.0, "generated_tokens": 300.0,
            "prompt_tokens": 100.0}
    algos = {"treerpo": {"runs": [run(0, [[0, 0, 0.2], [50, 600, 0.3], [100, 1200, 0.4]])]},
             "catpo": {"runs": [run(0, [[0, 0, 0.2], [50, 500, 0.35], [100, 1000, 0.45]], healing=heal)]}}
    summarise(algos)
    c = algos["catpo"]
    assert c["heal_rate"] == 0.6 and c["healing"]["share_of_sampled_tokens"] == pytest.approx(0.3)
    # at CATPO's 1000 tokens TreeRPO is two thirds of the way from its point at 600 tokens to the one at 1200
    assert c["vs_treerpo"] == pytest.approx({"sampled_tokens": 1000.0, "catpo_accuracy": 0.45,
                                             "treerpo_accuracy": 0.3 + 0.1 * 400 / 600})


def test_equal_tokens_with_only_base_and_final_points():
    """`--eval-points 0`: runs ending past the shorter total are read between base and final, not as the base."""
    heal = {"attempts": 4.0, "healed": 2.0, "errors": 0.0, "dead_wrong": 4.0, "generated_tokens": 10.0,
            "prompt_tokens": 5.0}
    algos = {"treerpo": {"runs": [run(0, [[0, 0, 0.1], [40, 1000, 0.3]]), run(1, [[0, 0, 0.1], [40, 1200, 0.3]])]},
             "catpo": {"runs": [run(0, [[0, 0, 0.1], [40, 800, 0.4]], healing=heal),
                                run(1, [[0, 0, 0.1], [40, 1000, 0.4]], healing=heal)]}}
    summarise(algos)
    v = algos["catpo"]["vs_treerpo"]
    assert v["sampled_tokens"] == 900.0
    # CATPO seed 0 ended before 900 tokens: its final counts
    assert v["catpo_accuracy"] == pytest.approx((0.4 + (0.1 + 0.3 * 0.9)) / 2)
    assert v["treerpo_accuracy"] == pytest.approx((0.1 + 0.2 * 0.9 + 0.1 + 0.2 * 0.75) / 2)


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(["--algos", "grpo,ppo"]) == 2
    assert "ppo" in capsys.readouterr().err
    assert main(["--seeds", "0"]) == 2
    assert main(["--first-seed", "-1"]) == 2


def test_algos_take_variants_in_brackets():
    variant = "treepo[rollout.treepo.branch_point=entropy,rollout.treepo.divergence_policy=entropy]"
    assert parse_algos(f"grpo,treepo,{variant}") == {
        "grpo": ("grpo", []), "treepo": ("treepo", []),
        variant: ("treepo", ["rollout.treepo.branch_point=entropy", "rollout.treepo.divergence_policy=entropy"])}
    # a value may hold bracketed commas; spaces around specs and overrides go
    assert parse_algos(" grpo[a.b=[1,2], c.d=3] ,") == {"grpo[a.b=[1,2], c.d=3]": ("grpo", ["a.b=[1,2]", "c.d=3"])}
    for bad, said in (("treepo[a.b=1", "unbalanced"), ("treepo]", "unbalanced"), ("treepo[]", "name[key=value"),
                      ("treepo[a.b=1]x", "name[key=value"), ("treepo[a.b=1,]", "name[key=value"),
                      ("treepo[a.b]", "not a key=value"), ("ppo[a.b=1]", "choose from"), ("", "(empty)"),
                      ("treepo[trainer.seed=3]", "compare sets trainer.seed"),
                      ("treepo,grpo,treepo", "given twice"), ("treepo[a.b=1],treepo[a.b=1 ]", "given twice")):
        with pytest.raises(UserError, match=re.escape(said)):
            parse_algos(bad)


def test_each_variant_gets_its_overrides_and_a_bad_one_stops_compare_up_front(capsys):
    args, overrides = parse_args(["--algos", "grpo,treepo[rollout.treepo.segment_len=16],treepo",
                                  "trainer.eval_size=4"])
    cfgs, shared = run_configs(args, overrides)
    # seed by seed, every spec in turn; the variant's override on top of the command's, for its runs only
    assert list(cfgs) == [(spec, seed) for seed in (0, 1)
                          for spec in ("grpo", "treepo[rollout.treepo.segment_len=16]", "treepo")]
    assert {k: (c.algo.name, c.trainer.seed, c.rollout.treepo.segment_len, c.trainer.eval_size)
            for k, c in cfgs.items() if k[1] == 1} == {
        ("grpo", 1): ("grpo", 1, 64, 4), ("treepo[rollout.treepo.segment_len=16]", 1): ("treepo", 1, 16, 4),
        ("treepo", 1): ("treepo", 1, 64, 4)}
    assert shared.rollout.treepo.segment_len == 64 and shared.trainer.eval_size == 4  # set-up and evaluation
    for variant, said in (("treepo[rollout.treepo.nope=1]", "unknown key 'nope'"),
                          ("treepo[runtime.weights.path=nowhere]", "runtime.weights.path = 'nowhere'"),
                          ("treepo[rollout.treepo.segment_len=abc]", "expected an integer")):
        assert main(["--algos", f"grpo,{variant}", "--budget-s", "1"]) == 2  # before set-up: no Ray, no model
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"treepo-ray compare: --algos {variant!r}: ") and said in err


def branching_tree(rewards, entropy=None):
    """A root with two children, the first with two children of its own: 3 trajectories, 2 branch points."""
    t = Tree(prompt_ids=[1], query_id="q")
    e = (lambda x: [x, 0.1]) if entropy is not None else (lambda x: None)
    a = t.add_node(0, [2, 3], [-0.1, -0.1], entropy=e(entropy))
    t.trajectories = [t.add_node(a, [4, 5], [-0.1, -0.1], "eos", entropy=e(2 * entropy if entropy else 0)),
                      t.add_node(a, [6, 7], [-0.1, -0.1], "eos", entropy=e(2 * entropy if entropy else 0)),
                      t.add_node(0, [8, 9], [-0.1, -0.1], "eos", entropy=e(entropy))]
    t.set_trajectory_rewards(rewards)
    return t


def test_branch_informativeness_from_the_steps_metrics():
    # step 1: 4 branch points, 3 informative (depth 0: both; depth 1: one of two); entropies 0.5 and 1.0
    # step 2: 2 branch points, none informative, no entropies; step 3: no trees, no branch points (NaN shares)
    rows = [branch_metrics([branching_tree([1.0, 0.0, 1.0], 0.5), branching_tree([1.0, 1.0, 0.0], 0.5)]),
            branch_metrics([branching_tree([1.0, 1.0, 1.0])]), branch_metrics([])]
    assert math.isnan(rows[1]["tree/branch_entropy"]) and math.isnan(rows[2]["tree/informative_branches"])
    b = branch_figures([{**r, "critic/score/mean": 0.5} for r in rows])
    assert b["branch_points"] == 6.0
    assert b["informative_share"] == pytest.approx(3 / 6)  # 0.75 over 4 points and 0 over 2, not (0.75 + 0) / 2
    by_depth = b["informative_share_by_depth"]
    assert by_depth[:2] == pytest.approx([(1.0 * 4 + 0) / 6, (0.5 * 4 + 0) / 6]) and by_depth[2:] == [None, None]
    assert b["branch_entropy"] == pytest.approx(0.75)  # step 1 only
    assert b["token_entropy"] == pytest.approx(rows[0]["tree/token_entropy"])
    assert b["tokens_per_informative_branch"] == pytest.approx(16 / 3)  # step 1's 16 tokens; step 2 has none
    empty = branch_figures([])
    assert empty["branch_points"] == 0.0 and empty["informative_share"] is None and empty["branch_entropy"] is None

    # an algorithm: its runs' shares weighted by their branch points, entropies a mean over seeds, null for NaN
    algos = {"grpo": {"runs": [run(0, [[0, 0, 0.2], [100, 1000, 0.4]], rows[1:]),
                               run(1, [[0, 0, 0.2], [100, 1000, 0.4]], rows[2:])]},
             "treepo[x=1]": {"runs": [run(0, [[0, 0, 0.2], [100, 1000, 0.5]], rows[:1]),
                                      run(1, [[0, 0, 0.2], [100, 1000, 0.5]], rows[1:])]}}
    summarise(algos)
    g, t = algos["grpo"]["branches"], algos["treepo[x=1]"]["branches"]
    assert g["informative_share"] == 0.0 and g["branch_points"] == 1.0 and g["branch_entropy"] is None
    assert t["informative_share"] == pytest.approx(3 / 6) and t["branch_points"] == 3.0
    assert t["branch_entropy"] == pytest.approx(0.75)
    json.dumps(algos, allow_nan=False)  # nulls, no NaN
    assert verdict(algos) is None  # a variant of TreePO is not TreePO
    lines = table(algos).splitlines()
    assert lines[0].split()[-1] == "informative" and lines[2].startswith("treepo[x=1] ")
    assert lines[1].split()[-1] == "0.000" and lines[2].split()[-1] == "0.500"


def test_plots_are_labelled_by_the_spec(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    legends, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (
        legends.append([t.get_text() for t in fig.axes[0].get_legend().get_texts()]), save(fig, *a, **k))[1])
    algos = {spec: {"runs": [run(0, [[0, 0, 0.2], [100, 1000, 0.5]])]} for spec in ("grpo", "treepo[a.b=1,c.d=2]")}
    assert len(plot(algos, tmp_path)) == 2
    assert legends == [["grpo", "treepo[a.b=1,c.d=2]"]] * 2


def test_seeds_count_from_the_first_seed():
    args, _ = parse_args(["--seeds", "2", "--first-seed", "3"])
    assert args.seed_list == [3, 4]
    assert parse_args([])[0].seed_list == [0, 1]


def small_run(tiny: str) -> list[str]:
    """Overrides of a compare run of the tiny model on small trees (2 prompts, 4 paths of 2 x 8 tokens)."""
    cache = Path(__file__).resolve().parents[2] / ".cache" / "treepo-ray"  # synthetic task files, written once
    return [f"model.path={tiny}", f"model.cache_dir={cache}", "trainer.eval_size=4", "trainer.prompts_per_step=2",
            "rollout.treepo.width=4", "rollout.treepo.init_divergence_min=2", "rollout.treepo.init_divergence_max=4", "rollout.treepo.max_depth=2", "rollout.treepo.segment_len=8",
            "rollout.sequential.group_size=4", "rollout.sequential.max_depth=2", "rollout.sequential.segment_len=8",
            "rollout.treepo.max_response_len=0", "rollout.treepo.max_total_len=0",  # 2 x 8 tokens: in the context
            "rollout.sequential.max_response_len=0", "rollout.sequential.max_total_len=0",
            "algo.dynamic_sampling=false", "log.wandb=false"]


@pytest.mark.slow
def test_two_algorithms_side_by_side(ray_local, tiny, tmp_path):
    out = tmp_path / "cmp.json"
    args = ["--algos", "grpo,treepo", "--seeds", "2", "--budget-s", "1", "--eval-points", "1", "--json", str(out),
            *small_run(tiny)]
    assert main(args) == 0
    r = json.loads(out.read_text())
    for name in ("grpo", "treepo"):
        a = r["algorithms"][name]
        assert [one["seed"] for one in a["runs"]] == [0, 1]
        for one in a["runs"]:
            assert one["curve"][0] == [0.0, 0.0, r["base_accuracy"]]
            assert all(len(row) == 3 for row in one["curve"]) and one["curve"][-1][2] == one["final_accuracy"]
            # base, the weights published first after the mark at half the budget, the final weights: one point
            # when those are the final ones (a first step past half the budget, as on a loaded machine)
            points = one["curve"][1:]
            assert 1 <= len(points) <= 2 and points[0][0] >= 0.5
            assert [w for w, _, _ in points] == sorted({w for w, _, _ in points})
            assert [t for _, t, _ in points] == sorted({t for _, t, _ in points}) and points[0][1] > 0
            assert points[-1][:2] == [round(one["wall_s"], 2), one["sampled_tokens"]]
            assert one["wall_s"] >= 1.0 and one["sampled_tokens"] > 0 and one["steps"] >= 1
        assert "time_to_grpo_final_s" in a and "tokens_to_grpo_final" in a
        assert all("time_to_grpo_final_s" in one and "tokens_to_grpo_final" in one for one in a["runs"])
        assert set(a["branches"]) == {"informative_share", "branch_points", "informative_share_by_depth",
                                      "tokens_per_informative_branch", "branch_entropy", "token_entropy"}
    # Seed by seed, the algorithms in turn: GRPO 0, TreePO 0, GRPO 1, TreePO 1.
    (g0, g1), (t0, t1) = (r["algorithms"][name]["runs"] for name in ("grpo", "treepo"))
    assert g0["started_s"] < t0["started_s"] < g1["started_s"] < t1["started_s"]
    assert t0["started_s"] >= g0["started_s"] + g0["wall_s"]
    assert r["algorithms"]["treepo"]["tree_counters"]["branches"] > 0
    assert r["algorithms"]["treepo"]["branches"]["branch_points"] > 0
    assert r["eval_engines"] == 2  # training over: the learner's CPU evaluates too (one engine CPU each)
    assert r["algorithms"]["grpo"]["time_to_grpo_final_s"] is not None  # GRPO reaches its own final accuracy
    for png in r["plots"]:
        assert open(png, "rb").read(4) == b"\x89PNG"


@pytest.mark.slow
def test_weights_sent_by_broadcast_are_kept_for_evaluation_too(ray_local, tiny, tmp_path):
    # A broadcast version lives on learner rank 0 and is dropped once engines moved on: compare exports a copy of
    # the kept ones, and the evaluator (after the learner is gone) scores each.
    out = tmp_path / "cmp.json"
    args = ["--algos", "treepo", "--seeds", "1", "--first-seed", "3", "--budget-tokens", "600", "--eval-points", "2",
            "--json", str(out), *small_run(tiny), "runtime.weights.path=broadcast", "trainer.steps=2"]
    assert main(args) == 0
    (one,) = json.loads(out.read_text())["algorithms"]["treepo"]["runs"]
    assert one["seed"] == 3  # the run trained with the seed asked for (trainer.seed)
    # The log-prob temperature schedule's clock is the share of the budget spent when a batch starts, not
    # step / (trainer.steps - 1), which would reach 1 at the second of the run's 5 or more steps (<= 128 tokens each).
    progress = one["schedule_progress"]
    assert len(progress) == one["steps"] and progress[0] == 0.0 and progress == sorted(progress)
    assert 0.0 < progress[-1] < 1.0
    tokens = [t for _, t, _ in one["curve"]]  # base, after 200 and 400 tokens, final (>= 600)
    assert len(tokens) == 4 and 200 <= tokens[1] < 400 <= tokens[2] < 600 <= tokens[3] == one["sampled_tokens"]
