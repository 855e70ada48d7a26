"""Secrets never written (job/redact.py): the printed config, config.yaml, configs/attempt-*.yaml, W&B's config (a real
offline W&B run, read back) and the benchmarks' saved overrides hold "<redacted>" where a credential was, while the
run keeps the real values; resume=auto compares redacted with redacted."""

import json
import struct
from pathlib import Path

import pytest
import yaml

from treepo_ray import config as config_io
from treepo_ray.config import UserError
from treepo_ray.job.config import DEFAULT_CONFIG, load_config, print_config, redacted
from treepo_ray.job.logs import RunLogger
from treepo_ray.job.redact import REDACTED, names_credential, redacted_overrides
from treepo_ray.job.rundir import config_changes, resolve_run, write_config
from treepo_ray.learner.checkpoint import COMPLETE_MARKER, LEARNER_STATE, OPTIMIZER_FILE

JUDGE_KEY = "sk-judge-0123456789abcdefghijklmnop"
HF_TOKEN = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
JUDGE_URL = "https://judge.internal.example/v1?sig=opaque"  # no credential-like key or format: listed by the user
GITHUB_TOKEN = "ghp_0123456789abcdefghijklmnopqrstuvwxyzAB"  # an innocuous key name: caught by its format
SECRETS = (JUDGE_KEY, HF_TOKEN, JUDGE_URL, GITHUB_TOKEN)

SECRET_OVERRIDES = [
    f'custom_reward_function.reward_kwargs={{"api_key": "{JUDGE_KEY}", "judge_url": "{JUDGE_URL}", "threshold": 0.5}}',
    f'model.engine_kwargs={{"hf_token": "{HF_TOKEN}", "max_num_batched_tokens": 4096, "pad_token": "<pad>", '
    f'"mirrors": [{{"name": "a", "note": "{GITHUB_TOKEN}"}}]}}',
    "log.redact_keys=[judge_url]",
]


def secret_config(*more: str):
    return load_config(DEFAULT_CONFIG, [*SECRET_OVERRIDES, *more])


def assert_no_secret(text: str) -> None:
    leaked = [s for s in SECRETS if s in text]
    assert not leaked, f"secrets written: {leaked}"


def test_credential_keys_formats_and_listed_keys_are_redacted_at_any_depth():
    config = {"reward": {"api_key": "abc", "apiKey": "abc", "OPENAI_API_KEY": "abc", "hf_token": "abc",
                         "password": "abc", "client_secret": "abc", "aws_secret_access_key": "abc",
                         "private_key": "abc", "Authorization": "Bearer abc", "credentials": {"user": "u", "pw": 1},
                         "judges": [{"name": "j", "token": "abc"}], "url": "http://x", "extra": "url"},
              "innocent": {"prompt_key": "prompt", "reward_fn_key": "data_source", "max_tokens": 8,
                           "pad_token": "<pad>", "eos_token_id": 2, "tokenizer": "t", "author": "me",
                           "use_auth_token": True, "api_key": "", "token": None, "note": GITHUB_TOKEN,
                           "wandb_entity": "a" * 40, "digest": "b" * 40},
              "log": {"redact_keys": ["reward.url"]}}
    before = json.dumps(config)
    out = redacted(config, ["extra"])
    hidden = {k for k, v in out["reward"].items() if v == REDACTED}
    assert hidden == set(config["reward"]) - {"judges"}
    assert out["reward"]["judges"] == [{"name": "j", "token": REDACTED}]
    # Booleans and empty values say "not set" and hold no secret; a known format or a W&B key is hidden anywhere.
    assert {k for k, v in out["innocent"].items() if v == REDACTED} == {"note", "wandb_entity"}
    assert json.dumps(config) == before  # the run's own dict is untouched


@pytest.mark.parametrize("key,credential", [
    ("api_key", True), ("judgeApiKey", True), ("X-Auth-Token", True), ("passwd", True), ("session_key", True),
    ("prompt_key", False), ("max_new_tokens", False), ("bos_token", False), ("keyword", False), ("authors", False),
])
def test_key_names(key, credential):
    assert names_credential(key) is credential


def test_print_config_redacts_and_the_run_keeps_the_real_values(capsys):
    cfg = secret_config()
    print_config(cfg)
    out = capsys.readouterr().out
    assert_no_secret(out)
    printed = yaml.safe_load(out.split("resolved config:\n", 1)[1])
    assert printed["custom_reward_function"]["reward_kwargs"] == {"api_key": REDACTED, "judge_url": REDACTED,
                                                                  "threshold": 0.5}
    engine = printed["model"]["engine_kwargs"]
    assert engine["hf_token"] == REDACTED and engine["mirrors"] == [{"name": "a", "note": REDACTED}]
    assert engine["max_num_batched_tokens"] == 4096 and engine["pad_token"] == "<pad>"
    assert cfg.custom_reward_function.reward_kwargs["api_key"] == JUDGE_KEY  # only what is shown is redacted
    assert cfg.model.engine_kwargs["hf_token"] == HF_TOKEN


def test_write_config_writes_no_secret_in_any_attempt(tmp_path):
    cfg_dict = config_io.to_dict(secret_config())
    write_config(str(tmp_path), cfg_dict, None, 0)
    write_config(str(tmp_path), cfg_dict, str(tmp_path / "checkpoint-00000004"), 4)
    files = [tmp_path / "config.yaml", tmp_path / "configs/attempt-1.yaml", tmp_path / "configs/attempt-2.yaml"]
    for path in files:
        text = path.read_text()
        assert_no_secret(text)
        assert yaml.safe_load(text)["custom_reward_function"]["reward_kwargs"]["api_key"] == REDACTED
    assert cfg_dict["custom_reward_function"]["reward_kwargs"]["api_key"] == JUDGE_KEY


def wandb_run_config(run_file: Path) -> dict:
    """The config of the run record in an offline W&B run's `.wandb` file: a 7-byte file header, then records in
    LevelDB's log format (32 KiB blocks; chunks of a 7-byte header: CRC, length, type FULL=1 FIRST=2 MIDDLE=3
    LAST=4), each record a wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2

    raw, offset, record = run_file.read_bytes(), 7, b""
    while offset + 7 <= len(raw):
        if 32768 - offset % 32768 < 7:  # a block's tail too short for a header is padding
            offset += 32768 - offset % 32768
            continue
        length, kind = struct.unpack("<HB", raw[offset + 4:offset + 7])
        record += raw[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            if parsed.WhichOneof("record_type") == "run":
                return {item.key: json.loads(item.value_json) for item in parsed.run.config.update}
            record = b""
    raise AssertionError(f"no run record in {run_file}")


def test_wandb_config_holds_no_secret(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = secret_config()
    logger = RunLogger(tmp_path, cfg.log, config_io.to_dict(cfg), name="redact", run_id="redact01")
    logger.log(1, {"critic/score/mean": 0.5})
    logger.close()
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-redact01.wandb")
    config = wandb_run_config(run_file)
    assert config["custom_reward_function"]["reward_kwargs"] == {"api_key": REDACTED, "judge_url": REDACTED,
                                                                 "threshold": 0.5}
    assert config["model"]["engine_kwargs"]["hf_token"] == REDACTED
    assert config["trainer"]["steps"] == cfg.trainer.steps  # the rest as it is
    # Nowhere in the run's W&B files either (logs, metadata).
    for path in (tmp_path / "wandb").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not [s for s in SECRETS if s.encode() in data], path


def fake_run(root: Path, name: str, cfg) -> Path:
    run = root / name
    write_config(str(run), config_io.to_dict(cfg), None, 0)
    checkpoint = run / "checkpoint-00000004"  # the files a restore reads, so that resume=auto takes it
    checkpoint.mkdir()
    (checkpoint / COMPLETE_MARKER).write_text("{}")
    (checkpoint / LEARNER_STATE).write_text('{"world_size": 1}')
    for name in ("model.safetensors", "config.json", OPTIMIZER_FILE):
        (checkpoint / name).write_bytes(b"")
    return run


def test_resume_with_the_same_or_a_rotated_secret_is_no_config_change(tmp_path, capsys):
    run = fake_run(tmp_path, "treepo-20261130-090000", secret_config())
    for key in (JUDGE_KEY, "sk-rotated-9876543210zyxwvutsrqponm"):  # a rotated key cannot be seen, so never blocks
        cfg = secret_config(f"custom_reward_function.reward_kwargs.api_key={key}",
                            f"trainer.storage_path={tmp_path}", "trainer.resume=auto")
        assert resolve_run(cfg) == (str(run), f"{run}/checkpoint-00000004")
        assert config_changes(yaml.safe_load((run / "config.yaml").read_text()), config_io.to_dict(cfg)) == (
            [], ["trainer.resume: '' -> 'auto'", f"trainer.storage_path: 'runs' -> {str(tmp_path)!r}"])
    assert "not resuming" not in capsys.readouterr().out


def test_a_listed_identity_key_does_not_break_the_resume_it_was_saved_by():
    # data.name is part of a run's identity (rundir.IDENTITY); listed as a secret, config.yaml holds the marker.
    current = {"data": {"name": "s3://bucket/math?X-Amz-Signature=abc"}, "log": {"redact_keys": ["data.name"]}}
    saved = yaml.safe_load(yaml.safe_dump(redacted(current)))
    assert saved["data"]["name"] == REDACTED
    assert config_changes(saved, current) == ([], [])


def test_config_changes_name_no_secret():
    saved = {"algo": {"name": "treepo"}, "model": {"engine_kwargs": {"hf_token": "old-token-value"}}}
    current = {"algo": {"name": "grpo"}, "model": {"engine_kwargs": {"hf_token": HF_TOKEN}},
               "log": {"redact_keys": ["extra"]}, "extra": "listed-now"}
    breaking, other = config_changes(saved, current)
    assert breaking == ["algo.name: 'treepo' -> 'grpo'"]
    assert other == [f"extra: None -> {REDACTED!r}", "log.redact_keys: None -> ['extra']"]


def test_a_saved_config_must_have_its_secrets_set_again(tmp_path):
    write_config(str(tmp_path), config_io.to_dict(secret_config()), None, 0)
    with pytest.raises(UserError, match="this config was saved with its secrets removed") as err:
        load_config(tmp_path / "config.yaml")
    named = str(err.value).split(": '<redacted>'")[0].split(", ")
    assert sorted(named) == ["custom_reward_function.reward_kwargs.api_key",
                             "custom_reward_function.reward_kwargs.judge_url", "model.engine_kwargs.hf_token",
                             "model.engine_kwargs.mirrors[0].note"]
    again = load_config(tmp_path / "config.yaml", [
        f"custom_reward_function.reward_kwargs.api_key={JUDGE_KEY}",
        f"custom_reward_function.reward_kwargs.judge_url={JUDGE_URL}", f"model.engine_kwargs.hf_token={HF_TOKEN}",
        f"model.engine_kwargs.mirrors=[{{name: a, note: {GITHUB_TOKEN}}}]"])
    assert again.custom_reward_function.reward_kwargs["api_key"] == JUDGE_KEY


def test_saved_overrides_are_redacted():
    overrides = [*SECRET_OVERRIDES, f"custom_reward_function.reward_kwargs.api_key={JUDGE_KEY}", "trainer.steps=3",
                 f"data.note={GITHUB_TOKEN}", f"x.judge_url={JUDGE_URL}"]
    out = redacted_overrides(overrides, ["judge_url"])
    assert_no_secret(" ".join(out))
    assert out[3:] == [f"custom_reward_function.reward_kwargs.api_key={REDACTED}", "trainer.steps=3",
                       f"data.note={REDACTED}", f"x.judge_url={REDACTED}"]
    assert json.loads(out[0].split("=", 1)[1]) == {"api_key": REDACTED, "judge_url": REDACTED, "threshold": 0.5}
