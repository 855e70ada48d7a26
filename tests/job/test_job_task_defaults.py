"""A run given the user's own data and no config file does not inherit cpu.yaml's tuning for its tiny synthetic task
(job/config.py parse_config): it starts from the built-in defaults with the model's context as its limit, and says
so before anything slow; a value a section refuses is said with where it came from. Ray-free, no mocks."""

import json

import pytest

from treepo_ray.config import UserError
from treepo_ray.job.config import DEFAULT_CONFIG, TrainConfig, load_config, parse_config, print_config
from treepo_ray import config as config_io


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}) + "\n")
    return path


def test_own_data_and_model_start_from_the_defaults_with_the_models_context(model_dir, data, capsys):
    cfg = parse_config([f"model.path={model_dir}", f"data.train_files={data}"], "train")
    t, s = cfg.rollout.treepo, cfg.rollout.sequential
    # None of cpu.yaml's tiny-task tuning: its repetition stop (8 x 3), 288-token budget, divergence 4..8.
    assert (t.repetition_substr_len, t.repetition_min_count) == (TrainConfig().rollout.treepo.repetition_substr_len,
                                                                  TrainConfig().rollout.treepo.repetition_min_count)
    assert (t.repetition_substr_len, t.repetition_min_count) != (8, 3)
    assert t.init_divergence_min is None and (t.segment_len, t.max_depth) == (512, 14)
    # The model_dir fixture's context is 1024 tokens: the whole of it is the path limit, a quarter the prompt's.
    assert t.max_total_len == s.max_total_len == 1024
    assert cfg.data.prompt.max_prompt_tokens == 256 and t.max_response_len == s.max_response_len == 768
    print_config(cfg)  # what `treepo-ray train` prints before anything slow
    err = capsys.readouterr().out.split("resolved config:")[0]
    assert "not cpu.yaml" in err
    assert "rollout.treepo.max_total_len = 1024 (derived: the model's context" in err
    assert "rollout.treepo.repetition_substr_len = 32 (default)" in err
    assert "cpu.yaml, the default config" not in err  # nothing is taken from it


def test_keys_on_the_command_line_win_over_what_is_derived(model_dir, data, capsys):
    cfg = parse_config([f"model.path={model_dir}", f"data.train_files={data}", "rollout.treepo.max_total_len=900",
                        "data.prompt.max_prompt_tokens=100", "rollout.treepo.max_response_len=700"], "train")
    assert (cfg.rollout.treepo.max_total_len, cfg.rollout.treepo.max_response_len) == (900, 700)
    assert cfg.data.prompt.max_prompt_tokens == 100
    print_config(cfg)
    assert "rollout.treepo.max_total_len = 900 (command line)" in capsys.readouterr().out


def test_width_4_with_own_data_and_no_file_runs(model_dir, data):
    cfg = parse_config([f"model.path={model_dir}", f"data.train_files={data}", "rollout.treepo.width=4"], "train")
    assert cfg.rollout.treepo.width == 4


def test_an_error_on_a_value_not_given_says_where_it_came_from(model_dir):
    # On the synthetic task cpu.yaml still applies; its init_divergence_min refuses width 4, and the error says so.
    with pytest.raises(UserError) as err:
        parse_config([f"model.path={model_dir}", "rollout.treepo.width=4"], "train")
    said = str(err.value)
    assert "rollout.treepo.init_divergence_min = 4 (from cpu.yaml, the default config)" in said
    assert "rollout.treepo.width = 4 (command line)" in said


def test_an_error_on_a_value_from_a_config_file_names_the_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("rollout:\n  treepo:\n    init_divergence_min: 6\n    init_divergence_max: 8\n")
    with pytest.raises(UserError) as err:
        parse_config([str(path), "rollout.treepo.width=4"], "train")
    assert f"rollout.treepo.init_divergence_min = 6 (from {path})" in str(err.value)
    # A default named by the check says so too.
    path.write_text("rollout:\n  treepo:\n    init_divergence: 20\n")
    with pytest.raises(UserError) as err:
        parse_config([str(path)], "train")
    assert f"rollout.treepo.init_divergence = 20 (from {path})" in str(err.value)
    assert "rollout.treepo.width = 16 (default)" in str(err.value)


def test_model_path_on_the_synthetic_task_lists_cpu_yamls_tuning(model_dir, capsys):
    cfg = parse_config([f"model.path={model_dir}"], "train")
    assert cfg.rollout.treepo.repetition_substr_len == 8  # the task is cpu.yaml's: its tuning fits it
    print_config(cfg)
    err = capsys.readouterr().out
    for line in ("rollout.treepo.repetition_substr_len = 8 (from cpu.yaml, the default config)",
                 "rollout.treepo.max_total_len = 288 (from cpu.yaml, the default config)",
                 "rollout.treepo.init_divergence_min = 4 (from cpu.yaml, the default config)"):
        assert line in err


def test_no_arguments_run_cpu_yaml_exactly_as_before(capsys):
    for argv in ([], ["data.name=synthetic_addition"]):
        cfg = parse_config(argv, "train")
        assert config_io.to_dict(cfg) == config_io.to_dict(load_config(DEFAULT_CONFIG, argv))
        print_config(cfg)
    said = capsys.readouterr()
    assert said.err == "" and "Task-dependent" not in said.out and "tuning" not in said.out


def test_a_response_budget_over_the_models_context_names_its_keys_and_origins(tmp_path):
    from treepo_ray.engines.tiny import build_tokenizer
    from treepo_ray.job.inputs import load_prompts

    model = tmp_path / "short"
    build_tokenizer().save_pretrained(model)
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 200}))
    cfg = parse_config([f"model.path={model}"], "train")
    with pytest.raises(UserError) as err:
        load_prompts(cfg, str(model), build_tokenizer())
    said = str(err.value)
    assert "context of 200 tokens leaves no room for a prompt after the 264-token response budget" in said
    assert "rollout.treepo.max_response_len = 264 (from cpu.yaml, the default config)" in said
