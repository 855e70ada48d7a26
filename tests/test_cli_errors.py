"""Every user error from the command line is one line on stderr and exit status 2, never a traceback."""

import json

import pytest

from treepo_ray.cli import main


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
