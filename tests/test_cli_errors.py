"""Every user error from the command line is one line on stderr and exit status 2, never a traceback."""

import json

import pytest

from treepo_ray.cli import main
from treepo_ray.job.verl_keys import VERL_KEYS


def run(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.mark.parametrize("command", ["train", "eval"])
@pytest.mark.parametrize("args, message", [
    (["trainer.steps=abc"], ": trainer.steps: expected an integer, got 'abc'"),
    (["trainer.stepz=3"], "unknown key 'stepz'"),
    (["trainer.steps=0"], "trainer.steps = 0; it must be >= 1"),
    (["rollout.temperature=hot"], ": rollout.temperature: expected a number, got 'hot'"),
    (["no/such/config.yaml"], "config file 'no/such/config.yaml' does not exist"),
    (["jobs/configs/cpu.yaml", "stray"], "'stray' is not a key=value override"),
    (["--model", "x"], "'--model': `treepo-ray COMMAND` takes a config file and key=value overrides, not --flags"),
    (["model.path=/no/such/model"], "model.path = '/no/such/model': no such directory"),
    (["data.train_files=/no/such.parquet"], "data.train_files: '/no/such.parquet' does not exist"),
    (["data.name=/no/such/folder"], "data.name = '/no/such/folder': not 'synthetic'"),
    (["custom_reward_function.path=/no/such.py"], "custom_reward_function.path = '/no/such.py': no such file"),
])
def test_user_errors_are_one_line_and_status_2(capsys, command, args, message):
    code, err = run(capsys, command, *args)
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert err.startswith(f"treepo-ray {command}: ") and message.replace("COMMAND", command) in err, err


def test_a_bad_row_is_one_line_and_status_2(capsys, tmp_path, model_dir):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"problem": "1 + 1", "answer": "2"}) + "\n" + json.dumps({"problem": "x"}) + "\n")
    for command in ("train", "eval"):
        code, err = run(capsys, command, f"model.path={model_dir}", f"data.train_files={data}")
        assert code == 2 and err == f"treepo-ray {command}: {data}: row 1: field 'answer' is missing"


@pytest.mark.parametrize("key, said", [
    # mistyped: the closest keys here, never the section's whole key list
    ("trainer.stepz=3", "unknown key 'stepz' in trainer; did you mean trainer.steps?"),
    ("lr=1e-5", "unknown key 'lr'; did you mean learner.lr?"),
    ("learner.clip_high=0.3", "unknown key 'clip_high' in learner; did you mean learner.loss.clip_high?"),
    ("rollout.treepo.widht=4", "unknown key 'widht' in rollout.treepo; did you mean rollout.treepo.width?"),
    ("trainer.zzz=1", "unknown key 'zzz' in trainer; `treepo-ray train --print-config trainer` lists its keys"),
    # verl's: the key that does its job here, and how it differs
    ("actor_rollout_ref.rollout.n=8", "verl's key; here: rollout.treepo.width or rollout.sequential.group_size or "
                                      "rollout.treerpo.n_children"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=64", "verl's key; here: learner.mini_batches (a COUNT here, a SIZE"),
    ("data.max_response_length=1024", "verl's key; here: rollout.treepo.max_response_len or "
                                      "rollout.sequential.max_response_len or rollout.treerpo.max_response_len"),
    ("trainer.save_freq=10", "verl's key; here: trainer.save_every"),
    ("trainer.total_epochs=3", "verl's key, with no equivalent here: set trainer.steps instead"),
    ("actor_rollout_ref.model.lora_rank=32", "verl's key; here: model.lora_rank"),
])
def test_mistyped_and_verl_keys_name_the_key_here(capsys, key, said):
    code, err = run(capsys, "train", key)
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"treepo-ray train: override {key!r}: {said}"), err


def test_print_config_prints_the_resolved_keys_and_stops(capsys, tmp_path):
    import yaml

    storage = tmp_path / "runs"
    code = main(["train", "--print-config", "learner.loss", "trainer.steps", "trainer.steps=7",
                 f"trainer.storage_path={storage}"])
    out = capsys.readouterr().out
    assert code == 0 and yaml.safe_load(out) == {
        "learner": {"loss": yaml.safe_load(out)["learner"]["loss"]}, "trainer": {"steps": 7}}
    assert set(yaml.safe_load(out)["learner"]["loss"]) >= {"clip_low", "clip_high", "kl_coef"}
    assert not storage.exists()  # stopped before the run directory (and Ray)
    code, err = run(capsys, "train", "--print-config", "learner.lrr")
    assert code == 2 and err == "treepo-ray train: unknown key 'lrr' in learner; did you mean learner.lr?"


def test_no_abbreviated_options(capsys):
    # `--seed 3` must not silently mean `--seeds 3`
    code, err = run(capsys, "compare", "--seed", "3")
    assert code == 2 and err == "treepo-ray compare: unknown option '--seed' (`treepo-ray compare --help`)"
    with pytest.raises(SystemExit) as exit_:
        main(["viz", "some/run", "--max", "3"])  # --max-trees
    assert exit_.value.code == 2 and "unrecognized arguments: --max" in capsys.readouterr().err


def test_every_argument_parser_refuses_abbreviations():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for path in [*root.glob("treepo_ray/**/*.py"), *root.glob("jobs/*.py")]:
        for call in path.read_text().split("ArgumentParser(")[1:]:
            assert "allow_abbrev=False" in call[:300], f"{path}: an ArgumentParser allows abbreviations"


def test_help_lists_benchmarks_and_where_keys_are(capsys):
    from treepo_ray.cli import BENCHMARKS

    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in BENCHMARKS)
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--print-config" in out and "docs/verl-migration.md" in out and "sections: algo, model, data" in out


def test_viz_of_a_missing_run_is_one_line(capsys, tmp_path):
    code, err = run(capsys, "viz", str(tmp_path / "no-such-run"))
    assert code == 2 and err == f"treepo-ray viz: run directory {str(tmp_path / 'no-such-run')!r} does not exist"


def test_an_unreachable_cluster_is_one_line(capsys, tmp_path, model_dir):
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        data = tmp_path / "train.jsonl"
        data.write_text(json.dumps({"problem": "1 + 1", "answer": "2"}) + "\n")
        code, err = run(capsys, "train", f"model.path={model_dir}", f"data.train_files={data}",
                        f"trainer.storage_path={tmp_path / 'runs'}", f"runtime.address=127.0.0.1:{port}")
    assert code == 2 and "\n" not in err, err
    assert err.startswith(f"treepo-ray train: runtime.address = '127.0.0.1:{port}': nothing answers at"), err


def test_a_verl_key_in_a_config_file_is_named_whole(capsys, tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    n: 8\n")
    code, err = run(capsys, "train", str(path))
    assert code == 2 and err == (f"treepo-ray train: {path}: override 'actor_rollout_ref.rollout.n=8': verl's key; "
                                 "here: rollout.treepo.width or rollout.sequential.group_size or "
                                 f"rollout.treerpo.n_children ({VERL_KEYS['actor_rollout_ref.rollout.n'].differs})")
