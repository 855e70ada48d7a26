"""The learner's token budget a job takes when its config sets none (job/config.py: default_micro_batch_tokens):
the longest path its rollout allows, so no path is ever cut into pieces that repeat its ancestors."""

import warnings

import pytest

from treepo_ray.job.config import CONFIG_DIR, load_config

PAPER_ROLLOUT = ["algo.name=treepo", "data.prompt.max_prompt_tokens=1024", "rollout.treepo.segment_len=512",
                 "rollout.treepo.max_depth=14", "rollout.treepo.max_response_len=7168",
                 "rollout.treepo.max_total_len=0"]


def test_unset_budget_follows_the_longest_path_and_says_so(capsys):
    cfg = load_config(CONFIG_DIR / "cpu.yaml", PAPER_ROLLOUT)
    assert cfg.learner.micro_batch_tokens == 1024 + 7168
    assert "learner.micro_batch_tokens = 8192" in capsys.readouterr().err


def test_short_paths_keep_the_learners_default():
    assert load_config(CONFIG_DIR / "cpu.yaml").learner.micro_batch_tokens == 4096


def test_a_set_budget_is_kept_and_one_below_the_longest_path_warned():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_config(CONFIG_DIR / "cpu.yaml", [*PAPER_ROLLOUT, "learner.micro_batch_tokens=32768"]
                           ).learner.micro_batch_tokens == 32768
    with pytest.warns(UserWarning, match="below the longest path the rollout allows"):
        cfg = load_config(CONFIG_DIR / "cpu.yaml", [*PAPER_ROLLOUT, "learner.micro_batch_tokens=4096"])
    assert cfg.learner.micro_batch_tokens == 4096


def test_a_total_length_limit_shortens_the_longest_path():
    cfg = load_config(CONFIG_DIR / "cpu.yaml", [*PAPER_ROLLOUT, "rollout.treepo.max_total_len=6000"])
    assert cfg.learner.micro_batch_tokens == 6000
