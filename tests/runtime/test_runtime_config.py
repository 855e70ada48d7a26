"""The job's configuration files: every YAML under jobs/configs loads, and the paper settings are what they say."""

from pathlib import Path

import pytest

from treepo_ray.runtime.config import CONFIG_DIR, DEFAULT_CONFIG, load_config

CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_job_config_loads(path):
    cfg = load_config(path)
    assert cfg.learner.temperature == cfg.rollout.temperature  # the learner's log-probs use the sampling temperature


def test_treepo_paper_settings():
    cfg = load_config(CONFIG_DIR / "treepo_paper.yaml")
    t = cfg.rollout.treepo
    assert (cfg.algo.name, t.width, t.max_depth, t.segment_len, t.branch_factor) == ("treepo", 16, 14, 512, 2)
    assert cfg.rollout.temperature == 1.0 and cfg.learner.lr == 1e-6
    assert (cfg.learner.loss.clip_low, cfg.learner.loss.clip_high, cfg.learner.loss.aggregation) == (0.2, 0.28, "token-mean")
    assert cfg.algo.dynamic_sampling and cfg.algo.oversample == 3.0 and cfg.algo.max_extra_rounds == 2
    # Free-form mappings are taken whole from the file (not merged key by key into an empty default).
    assert cfg.runtime.engine_resources == {"generator_gpu": 1} and cfg.model.engine_kwargs["dtype"] == "bfloat16"


def test_default_is_the_cpu_treepo_run_and_overrides_win():
    cfg = load_config(DEFAULT_CONFIG, ["algo.name=grpo", "model.engine_kwargs={max_batch_size: 64}"])
    assert DEFAULT_CONFIG.name == "cpu.yaml" and cfg.algo.sampler == "sequential"
    assert cfg.model.engine_kwargs == {"max_batch_size": 64} and cfg.runtime.engine_gpus == 0
    assert load_config(DEFAULT_CONFIG).algo.name == "treepo"


def test_each_algorithm_brings_its_loss_and_sampling_protocol_unless_set_explicitly():
    grpo = load_config(DEFAULT_CONFIG, ["algo.name=grpo"]).learner.loss
    assert (grpo.aggregation, grpo.clip_high, grpo.kl_coef) == ("seq-mean", 0.2, 0.001)
    treepo = load_config(DEFAULT_CONFIG).learner.loss
    assert (treepo.aggregation, treepo.clip_low, treepo.clip_high, treepo.kl_coef) == ("token-mean", 0.2, 0.28, 0.0)
    mine = load_config(DEFAULT_CONFIG, ["algo.name=grpo", "learner.loss.kl_coef=0"]).learner.loss
    assert mine.kl_coef == 0.0 and mine.aggregation == "seq-mean"
    assert load_config(DEFAULT_CONFIG).algo.filters_groups  # TreePO trains with DAPO's dynamic sampling
    assert not load_config(DEFAULT_CONFIG, ["algo.name=grpo"]).algo.filters_groups
    assert not load_config(DEFAULT_CONFIG, ["algo.dynamic_sampling=false"]).algo.filters_groups
    plain = load_config(DEFAULT_CONFIG, ["algo.name=grpo", "algo.loss_preset=false"]).learner.loss
    assert plain.aggregation == "token-mean" and plain.kl_coef == 0.0


def test_bad_keys_and_values_name_the_file_or_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout:\n  treepo:\n    widht: 4\n")
    with pytest.raises(ValueError, match=r"bad.yaml: .*unknown key 'widht'"):
        load_config(bad)
    with pytest.raises(ValueError, match="algo.name"):
        load_config(DEFAULT_CONFIG, ["algo.name=ppo"])
    with pytest.raises(ValueError, match="max_staleness"):
        load_config(DEFAULT_CONFIG, ["runtime.max_staleness=-1"])
    with pytest.raises(ValueError, match="trainer.resume"):
        load_config(DEFAULT_CONFIG, [f"trainer.resume={Path(tmp_path) / 'missing'}"])
