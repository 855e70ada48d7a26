"""The job's configuration (job/config.py), loaded as `treepo-ray train` loads it (load_config): every YAML under
jobs/configs loads, the paper settings are what they say, bad values name their key, and the algorithm sections'
settings reach the code they configure."""

import re
from pathlib import Path

import pytest

from treepo_ray.config import UserError
from treepo_ray.job.config import CONFIG_DIR, DEFAULT_CONFIG, load_config
from treepo_ray.tree import Tree

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
    # The official script where the paper is silent: 16 updates per step, weight decay, warmup, overlong buffer,
    # synchronous training, random fallback, random initial divergence 2..8, prompts truncated on the left.
    lr = cfg.learner
    assert (lr.mini_batches, lr.weight_decay, lr.lr_warmup_steps, lr.loss.dual_clip) == (16, 0.1, 10, 10.0)
    o = cfg.algo.overlong
    assert (o.enable, o.buffer_len, o.penalty_factor, o.max_len) == (True, 512, 1.0, 7168)
    assert cfg.runtime.max_staleness == 0 and t.fallback_policy == "random"
    assert (t.init_divergence_min, t.init_divergence_max) == (2, 8)
    assert (cfg.data.prompt.max_prompt_tokens, cfg.data.prompt.overlong) == (1024, "truncate_left")
    assert cfg.algo.treepo.root_group and not cfg.algo.treepo.subgroup_rejection


def test_paper_configs_comment_every_value():
    """Every value names its source: on its own line, or on the line of the section that holds it."""
    for path in CONFIG_DIR.glob("*_paper.yaml"):
        headers: dict[int, str] = {}  # indentation -> the latest section line at it
        for i, line in enumerate(path.read_text().splitlines()):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            indent = len(line) - len(line.lstrip())
            headers = {k: v for k, v in headers.items() if k < indent}
            if line.split("#")[0].rstrip().endswith(":"):
                headers[indent] = line
                continue
            assert "#" in line or any("#" in h for h in headers.values()), f"{path.name}:{i + 1}: {line.strip()}"


def test_catpo_treerpo_grpo_paper_configs_are_like_for_like():
    cfgs = {m: load_config(CONFIG_DIR / f"{m}_paper.yaml") for m in ("grpo", "treerpo", "catpo")}
    for m, c in cfgs.items():
        tr, lr = c.trainer, c.learner
        assert (tr.eval_samples, tr.eval_temperature, tr.eval_every, tr.save_every) == (8, 0.6, 20, 20), m
        assert (lr.loss.entropy_coef, lr.loss.kl_coef, lr.lr, lr.weight_decay) == (-0.001, 0.001, 1e-6, 0.01), m
        assert c.data.prompt.max_prompt_tokens == 512 and c.runtime.max_staleness == 0, m
        assert c.sampler_config.response_limit() == 1152 and c.rollout.temperature == 0.6, m
        # PPO mini-batches of 16 prompts (Table 4)
        assert tr.prompts_per_step / lr.mini_batches == 16, m
    # 30 epochs of MATH's 7,500 training problems
    assert cfgs["treerpo"].trainer.steps == 30 * (7500 // 32) and cfgs["grpo"].trainer.steps == 30 * (7500 // 128)


def test_default_is_the_cpu_treepo_run_and_overrides_win():
    cfg = load_config(DEFAULT_CONFIG, ["algo.name=grpo", "model.engine_kwargs={max_batch_size: 64}"])
    assert DEFAULT_CONFIG.name == "cpu.yaml" and cfg.algo.spec.sampler == "sequential"
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


def test_an_asynchronous_job_takes_the_ratio_to_the_sampling_weights_unless_set_explicitly(tmp_path):
    catpo_cpu = load_config(CONFIG_DIR / "catpo_cpu.yaml")  # max_staleness 1, off_policy not set
    assert catpo_cpu.runtime.max_staleness == 1 and catpo_cpu.learner.off_policy == "behaviour"
    assert load_config(CONFIG_DIR / "catpo_paper.yaml").learner.off_policy == "recompute"  # synchronous
    assert load_config(None, ["runtime.max_staleness=0"]).learner.off_policy == "recompute"
    assert load_config(None, ["runtime.max_staleness=2"]).learner.off_policy == "behaviour"
    mine = tmp_path / "mine.yaml"
    mine.write_text("runtime: {max_staleness: 1}\nlearner: {off_policy: decoupled}\n")
    assert load_config(mine).learner.off_policy == "decoupled"
    with pytest.warns(UserWarning, match="train as if on-policy"):  # allowed (verl's way), but said
        assert load_config(mine, ["learner.off_policy=recompute"]).learner.off_policy == "recompute"


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


def test_catpo_configs_hold_the_paper_settings():
    paper = load_config(CONFIG_DIR / "catpo_paper.yaml")
    c, t, loss = paper.algo.catpo, paper.rollout.treerpo, paper.learner.loss
    assert paper.algo.name == "catpo" and (t.n_children, t.max_depth, t.step_len) == (8, 3, 384)
    assert (c.tau_low, c.tau_high, c.var_cut, c.healing.num_refinements, c.healing.epsilon) == (
        0.025, 0.10, 0.05, 4, 0.05)
    assert (c.healing.critique_temperature, c.healing.critique_max_tokens, c.healing.refine_temperature) == (
        0.3, 256, 0.6)
    assert (loss.kl_coef, loss.kl_estimator, loss.entropy_coef, loss.clip_low, loss.clip_high) == (
        0.001, "k3", -0.001, 0.2, 0.2)
    assert paper.rollout.temperature == paper.learner.temperature == 0.6
    assert (paper.learner.lr, paper.trainer.prompts_per_step, paper.learner.mini_batches) == (1e-6, 32, 2)
    cpu = load_config(CONFIG_DIR / "catpo_cpu.yaml")
    assert cpu.algo.name == "catpo" and cpu.model.engine == "hf" and cpu.runtime.num_engines == 1
    assert load_config(CONFIG_DIR / "catpo_cpu.yaml", ["algo.name=treerpo"]).algo.spec.sampler == "treerpo"


@pytest.mark.parametrize("override, message", [
    ("runtime.faults.max_resends=-1", "runtime.faults.max_resends = -1"),
    ("runtime.faults.verifier_call_timeout_s=0", "runtime.faults.verifier_call_timeout_s = 0"),
    ("runtime.chaos.how=nuke", "runtime.chaos.how = 'nuke'"),
    ("runtime.chaos.kill_every=-1", "runtime.chaos.kill_every = -1"),
    ("runtime.chaos.kill=[engine,driver]", r"runtime.chaos.kill = \['engine', 'driver'\]"),
    ("runtime.deadlines.heartbeat_s=0", "runtime.deadlines.heartbeat_s = 0"),
    ("runtime.faults.max_verify_failed_share=1.5", "runtime.faults.max_verify_failed_share = 1.5"),
    ("trainer.lock_stale_s=0", "trainer.lock_stale_s = 0"),
    ("runtime.elastic.max_engines=-2", "runtime.elastic.max_engines = -2"),
    ("algo.oversample=0.5", "algo.oversample = 0.5"),
    ("algo.catpo.tau_low=0.2", r"need 0 <= tau_low \(0.2\) <= tau_high \(0.1\)"),
    ("algo.catpo.var_cut=0", "algo.catpo.var_cut = 0"),
])
def test_bad_runtime_and_algorithm_values_name_their_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(DEFAULT_CONFIG, [override])


def chains(rewards):
    t = Tree(prompt_ids=[1, 2], query_id="s")
    for _ in rewards:
        t.trajectories.append(t.add_node(0, [5, 5], [-1.0, -1.0]))
    t.set_trajectory_rewards(rewards)
    return t


def test_algorithm_settings_reach_the_credit_and_the_catpo_scoring():
    grpo = load_config(DEFAULT_CONFIG, ["algo.name=grpo"]).algo
    assert [round(a, 5) for a in grpo.advantages([chains([1, 0, 0, 1])])[0]] == [1.0, -1.0, -1.0, 1.0]
    unscaled = load_config(DEFAULT_CONFIG, ["algo.name=grpo", "algo.grpo.scale=false"]).algo
    assert unscaled.advantages([chains([1, 0, 0, 1])]) == [[0.5, -0.5, -0.5, 0.5]]
    assert load_config(DEFAULT_CONFIG, ["algo.name=catpo"]).algo.spec.sampler == "treerpo"
    # Four one-token leaves, one right, equal log-probs: p = 1/4 and F = 3/16 = 0.1875, informative under the
    # paper's tau_high (0.10), stale under a tau_high above F.
    tree = Tree(prompt_ids=[5, 6], query_id="t")
    for _ in range(4):
        tree.add_node(0, [10], [-1.0], "eos")
    tree.trajectories = tree.leaves()
    tree.set_trajectory_rewards([1, 0, 0, 0])
    for overrides, regime in (([], "informative"), (["algo.catpo.tau_high=0.2"], "stale")):
        algo = load_config(DEFAULT_CONFIG, ["algo.name=catpo", *overrides]).algo
        scored = Tree.from_dict(tree.to_dict())
        algo.spec.score(scored, algo)
        assert scored.meta["catpo"]["regime"] == regime


def float_keys(cls, prefix=""):
    """(key, index) of every float the config holds: `float` and `float | None` keys (index ''), lists of floats
    (index '[0]'), walked from the dataclasses themselves, so a key added later is covered too."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from float_keys(tp, f"{prefix}{f.name}.")
        elif float in typing.get_args(tp) and typing.get_origin(tp) in (list, tuple):
            yield f"{prefix}{f.name}", "[0]"
        elif float in (tp, *typing.get_args(tp)):
            yield f"{prefix}{f.name}", ""


@pytest.mark.parametrize("value", ["nan", "-.inf"])
def test_no_float_key_takes_nan_or_infinity(value):
    """NaN passes every `<= 0` check (lock_stale_s=nan spun the lock's heartbeat loop) and inf turns a deadline
    into none: the loader refuses both for every float key, naming it, before any section's own checks."""
    from treepo_ray.config import UserError
    from treepo_ray.job.config import TrainConfig

    keys = dict(float_keys(TrainConfig))
    assert {"trainer.lock_stale_s", "runtime.deadlines.grow_s", "learner.lr", "learner.betas"} <= set(keys)
    for key, index in keys.items():
        with pytest.raises(UserError, match=rf"^{re.escape(key + index)}: expected a finite number, got"):
            load_config(None, [f"{key}=[{value}]" if index else f"{key}={value}"])


def test_lora_is_set_in_the_model_section_and_the_learner_follows_it():
    cfg = load_config(None, ["model.lora_rank=8", "model.lora_alpha=32", "model.target_modules=q_proj,v_proj"])
    assert (cfg.learner.lora_rank, cfg.learner.lora_alpha, cfg.learner.target_modules) == (8, 32.0, ["q_proj", "v_proj"])
    assert cfg.learner.lora and not load_config(None, []).learner.lora
    with pytest.raises(UserError, match="learner.lora_rank is set from model.lora_rank"):
        load_config(None, ["learner.lora_rank=8"])
    # a saved config holds both, equal: it loads again
    assert load_config(None, ["model.lora_rank=8", "learner.lora_rank=8"]).learner.lora_rank == 8
