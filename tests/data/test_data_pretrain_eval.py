"""Base-model pretraining (tiny step budget) and the eval command, on real tiny models."""

import json
import time

import pytest
import torch
from safetensors.torch import load_file

from treepo_ray.job.evaluate import main as eval_main
from treepo_ray.data.pretrain import PretrainConfig, main as pretrain_main, prepare_base_model, settings_hash
from treepo_ray.data.synthetic import SyntheticTaskConfig
from treepo_ray.engines.tiny import TinyModelConfig

pytestmark = pytest.mark.slow  # builds and trains models

# A few steps of a very small model: tests the recipe's plumbing, not its accuracy (the real run takes minutes).
SMALL = PretrainConfig(
    task="synthetic_addition",
    addition=SyntheticTaskConfig(digits=2, noise=0.5),
    max_len=64,
    model=TinyModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                          max_positions=128),
    steps=6,
    batch_size=8,
    warmup_steps=2,
    eval_problems=6,
    eval_samples=2,
    eval_max_new_tokens=24,
    min_pass1=0.0,
)


@pytest.fixture(scope="module")
def base_model(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, prepare_base_model(cache, seed=0, cfg=SMALL, log=lambda *_: None)


def test_base_model_is_cached_with_its_eval(base_model):
    cache, path = base_model
    assert path.name == f"base-{settings_hash(PretrainConfig(**{**SMALL.__dict__, 'seed': 0}))}"
    ev = json.loads((path / "base_eval.json").read_text())
    assert 0.0 <= ev["pass@1"] <= 1.0 and 0.0 <= ev["greedy_accuracy"] <= 1.0
    assert "temperature 1.0" in ev["pass@1_sampling"]
    assert (path / "config.json").is_file() and (path / "tokenizer_config.json").is_file()
    # a second call finds the cache and returns at once, without retraining
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    start = time.monotonic()
    assert prepare_base_model(cache, seed=0, cfg=SMALL) == path
    assert time.monotonic() - start < 1.0
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary folder left behind


def test_pretraining_is_deterministic_in_the_seed(base_model, tmp_path):
    _, path = base_model
    again = prepare_base_model(tmp_path / "a", seed=0, cfg=SMALL, log=lambda *_: None)
    other = prepare_base_model(tmp_path / "b", seed=1, cfg=SMALL, log=lambda *_: None)
    w0, w1, w2 = (load_file(p / "model.safetensors") for p in (path, again, other))
    assert all(torch.equal(w0[k], w1[k]) for k in w0)
    assert not all(torch.equal(w0[k], w2[k]) for k in w0)
    assert other.name != path.name


def test_training_goes_on_until_the_check_reaches_min_pass1(base_model, tmp_path):
    _, path = base_model
    # An unreachable floor: the budget is extended check_every steps at a time up to max_extra_steps, checked at
    # every extension; the first `steps` steps are those of the fixed budget (same data, same learning rates).
    logs = []
    longer = PretrainConfig(**{**SMALL.__dict__, "min_pass1": 1.0, "check_every": 2, "max_extra_steps": 4,
                               "check_problems": 3})
    ext = prepare_base_model(tmp_path / "x", seed=0, cfg=longer, log=logs.append)
    ev = json.loads((ext / "base_eval.json").read_text())
    assert ev["steps"] == SMALL.steps + 4
    assert [step for step, _ in ev["checks"]] == [SMALL.steps, SMALL.steps + 2]
    assert all(0.0 <= acc < 1.0 for _, acc in ev["checks"])
    assert sum("check pass@1" in line for line in logs) == 2
    w0, w1 = (load_file(p / "model.safetensors") for p in (path, ext))
    assert not all(torch.equal(w0[k], w1[k]) for k in w0)  # trained further
    short = PretrainConfig(**{**longer.__dict__, "max_extra_steps": 0})
    same = prepare_base_model(tmp_path / "y", seed=0, cfg=short, log=lambda *_: None)
    assert json.loads((same / "base_eval.json").read_text())["checks"] == []
    w2 = load_file(same / "model.safetensors")
    assert all(torch.equal(w0[k], w2[k]) for k in w0)  # no extension: the fixed budget's model, bit for bit
    with pytest.raises(ValueError, match="check_every"):
        PretrainConfig(**{**longer.__dict__, "check_every": 0})


def test_pretrain_command(tmp_path, capsys):
    args = ["--out", str(tmp_path / "m"), "steps=2", "batch_size=4", "eval_problems=2", "eval_samples=1",
            "eval_max_new_tokens=8", "model.hidden_size=32", "model.intermediate_size=32", "model.num_layers=1",
            "model.num_heads=2", "model.num_kv_heads=1", "min_pass1=0"]
    assert pretrain_main(args) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["model"] == str(tmp_path / "m") and 0.0 <= line["pass@1"] <= 1.0  # the default task: running sums
    with pytest.raises(ValueError, match="unknown key"):
        pretrain_main(["--out", str(tmp_path / "x"), "stepz=2"])


def test_eval_command_metrics_and_sweep(base_model, tmp_path):
    cache, path = base_model
    out = tmp_path / "ev"
    argv = [f"model.path={path}", f"model.cache_dir={cache}", "data.name=synthetic_addition", "trainer.eval_size=5",
            "trainer.eval_samples=4",
            "eval.k=[1,2,4,8]", "trainer.eval_max_new_tokens=24", "rollout.treepo.segment_len=8",
            "rollout.treepo.max_response_len=0", "rollout.treepo.max_total_len=0",
            "rollout.sequential.max_response_len=0", "rollout.sequential.max_total_len=0", f"eval.out={out}",
            "eval.sweep_divergence=[1,2]", "eval.sweep_rollouts=[1,2,4]"]
    assert eval_main(argv) == 0
    report = json.loads((out / "eval.json").read_text())
    m = report["metrics"]
    assert report["problems"] == 5 and m["overall/problems"] == 5
    assert {"overall/pass@1", "overall/pass@2", "overall/pass@4", "overall/major@4",
            "synthetic_addition/pass@1"} <= set(m)
    assert "overall/pass@8" not in m  # k > n is skipped
    assert m["overall/pass@1"] <= m["overall/pass@2"] <= m["overall/pass@4"]
    sweep = json.loads((out / "sweep.json").read_text())["points"]
    assert [(p["divergence"], p["rollouts"]) for p in sweep] == [(1, 1), (1, 2), (1, 4), (2, 2), (2, 4)]
    assert all(p["generated_tokens"] > 0 for p in sweep)
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_eval_tree_sampler_and_greedy(base_model, tmp_path):
    cache, path = base_model
    common = [f"model.path={path}", f"model.cache_dir={cache}", "data.name=synthetic_addition", "trainer.eval_size=3",
              "trainer.eval_max_new_tokens=16", "rollout.treepo.segment_len=8",
            "rollout.treepo.max_response_len=0", "rollout.treepo.max_total_len=0",
            "rollout.sequential.max_response_len=0", "rollout.sequential.max_total_len=0"]
    assert eval_main(common + ["eval.sampler=treepo", "trainer.eval_samples=4", "eval.divergence=2",
                               f"eval.out={tmp_path / 't'}"]) == 0
    assert json.loads((tmp_path / "t" / "eval.json").read_text())["settings"]["sampler"] == "treepo"
    assert eval_main(common + ["trainer.eval_temperature=0", f"eval.out={tmp_path / 'g'}"]) == 0
    m = json.loads((tmp_path / "g" / "eval.json").read_text())["metrics"]
    assert "overall/pass@1" in m and "overall/pass@4" not in m  # greedy: one answer each
