"""A user's reward function (verl's custom_reward_function) in bounded worker processes: a failure is no reward
(with its cause), not a wrong answer; the workers' CPU time, processes and environment are contained."""

import os
import textwrap
import time

import psutil

import pytest

from treepo_ray.config import UserError
from treepo_ray.rewards import BatchScorer, RewardFunctionConfig, check_reward_function

REWARD_FILE = textwrap.dedent('''
    import json, os, subprocess, time
    from treepo_ray.rewards import default_compute_score

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        if data_source == "mine/float":
            return float(solution_str.strip() == ground_truth["answer"]) + bonus
        if data_source == "mine/extra":
            return {"score": float(extra_info["index"]), "pred": json.dumps(extra_info, sort_keys=True)}
        if data_source == "mine/raise":
            raise KeyError("no such thing")
        if data_source == "mine/hang":
            time.sleep(60)
        if data_source == "mine/memory":
            return len(bytearray(1 << 34))
        if data_source == "mine/bad":
            return "yes"
        if data_source == "mine/nan":
            return {"score": float("nan")}
        if data_source == "mine/none":
            return None
        if data_source == "mine/spin":
            while True:
                pass
        if data_source == "mine/spawn":  # children that would outlive a worker killed alone
            pids = [subprocess.Popen(["sleep", "600"]).pid for _ in range(5)]
            with open(ground_truth, "w") as f:
                f.write(json.dumps(pids))
            time.sleep(60)
        if data_source == "mine/env":
            return {"score": 1.0, "pred": json.dumps(sorted(k for k in os.environ if k.startswith("TREEPO_TEST")))}
        return default_compute_score(data_source, solution_str, ground_truth, extra_info)
''')


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


def test_float_and_dict_results_extra_info_and_kwargs(reward_file):
    cfg = RewardFunctionConfig(path=str(reward_file), reward_kwargs={"bonus": 0.5})
    check_reward_function(cfg)
    items = [("mine/float", " 42 ", {"answer": "42"}), ("mine/float", "41", {"answer": "42"}),
             ("mine/extra", "x", "1", {"index": 7, "split": "train"}),
             ("openai/gsm8k", "#### 72", "72", {}), ("lighteval/MATH", r"\boxed{\frac12}", "0.5", {})]
    with BatchScorer(timeout_s=5.0, reward_function=cfg) as scorer:
        got = scorer.score_details(items)
    assert [g["score"] for g in got] == [1.5, 0.5, 7.0, 1.0, 1.0]
    assert [g["acc"] for g in got] == [1.0, 0.0, 1.0, 1.0, 1.0]  # without 'acc': score >= correct_score
    assert got[2]["pred"] == '{"index": 7, "split": "train"}'  # extra_info reached the function intact
    assert got[3]["pred"] == "72"


def test_failures_are_no_reward_with_their_cause_and_the_workers_go_on(reward_file, capfd):
    cfg = RewardFunctionConfig(path=str(reward_file))
    items = [("mine/raise", "x", "1"), ("mine/spin", "x", "1"), ("mine/memory", "x", "1"), ("mine/bad", "x", "1"),
             ("mine/nan", "x", "1"), ("mine/none", "x", "1"), ("openai/gsm8k", "#### 3", "3")]
    with BatchScorer(timeout_s=1.0, reward_function=cfg) as scorer:
        got = scorer.score_details(items)
        assert [g.get("failed") for g in got] == ["error", "timeout", "error", "error", "nonfinite", "error", None]
        assert scorer.score_batch(items[-2:]) == [None, 1.0]  # no reward is None, not wrong_score
        assert scorer.function_errors == 6 + 1
        assert "KeyError: 'no such thing' (my_reward.py:" in got[0]["error"]
        assert "no answer within 1 s of CPU time" in got[1]["error"]
        assert "MemoryError" in got[2]["error"]
        assert "returned str as the score" in got[3]["error"] and "returned NoneType" in got[5]["error"]
        assert "returned nan as 'score'" in got[4]["error"]
        assert scorer.score_batch([("mine/float", "1", {"answer": "1"})]) == [1.0]  # replaced workers serve on
    assert "KeyError: 'no such thing'" in capfd.readouterr().err  # each distinct failure is printed once


@pytest.mark.slow
def test_a_hang_ends_at_the_wall_backstop_and_takes_the_processes_it_started(reward_file, tmp_path):
    cfg = RewardFunctionConfig(path=str(reward_file))
    pids_file = tmp_path / "pids.json"
    with BatchScorer(timeout_s=1.0, reward_function=cfg) as scorer:
        start = time.monotonic()
        got = scorer.score_details([("mine/spawn", "x", str(pids_file))])
        # asleep, it uses no CPU time: the wall-clock backstop (3 x the limit) ends it
        assert got[0]["failed"] == "timeout" and 3.0 <= time.monotonic() - start < 8.0
    children = [int(p) for p in pids_file.read_text().strip("[]").split(",")]
    time.sleep(0.2)
    alive = [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert len(children) == 5 and alive == []


def test_workers_see_only_the_environment_passed_through(reward_file, monkeypatch):
    monkeypatch.setenv("TREEPO_TEST_JUDGE_KEY", "k1")
    monkeypatch.setenv("TREEPO_TEST_CLOUD_SECRET", "s1")
    items = [("mine/env", "x", "1")]
    with BatchScorer(reward_function=RewardFunctionConfig(path=str(reward_file))) as scorer:
        assert scorer.score_details(items)[0]["pred"] == "[]"
    with BatchScorer(reward_function=RewardFunctionConfig(path=str(reward_file), env=["TREEPO_TEST_JUDGE_KEY"])) as s:
        assert s.score_details(items)[0]["pred"] == '["TREEPO_TEST_JUDGE_KEY"]'
    assert os.environ["TREEPO_TEST_CLOUD_SECRET"] == "s1"  # the caller's own environment is untouched


def test_wrong_path_or_name_is_one_clear_error(reward_file, tmp_path):
    with pytest.raises(UserError, match="no such file"):
        check_reward_function(RewardFunctionConfig(path=str(tmp_path / "missing.py")))
    with pytest.raises(UserError, match="defines no function custom_reward_function.name = 'score_it'"):
        check_reward_function(RewardFunctionConfig(path=str(reward_file), name="score_it"))
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(UserError, match="importing it fails: ModuleNotFoundError"):
        check_reward_function(RewardFunctionConfig(path=str(broken)))
