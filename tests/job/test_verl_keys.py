"""verl's keys: every key the table names exists here, the page shows the table the code holds, and each verl key gets
its one line."""

from pathlib import Path

import pytest

from treepo_ray import config as config_io
from treepo_ray.job.config import TrainConfig
from treepo_ray.job.verl_keys import VERL_KEYS, explain, markdown_table

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl-migration.md"
FREE_FORM = ("model.engine_kwargs.",)
"""Mappings passed to a library as they are: any key may be set under them."""


@pytest.mark.parametrize("verl_key", VERL_KEYS)
def test_every_key_named_here_exists(verl_key):
    known = set(config_io.dotted_keys(TrainConfig))
    for key in VERL_KEYS[verl_key].here:
        assert key in known or key.startswith(FREE_FORM), key


def test_the_page_holds_the_table_of_the_code():
    table = markdown_table(config_io.to_dict(TrainConfig()))
    assert table in DOC.read_text(), "regenerate the table in docs/verl-migration.md from markdown_table()"


def test_verl_keys_valid_here_are_left_alone():
    # The keys verl and this project share are set, not explained away.
    cfg = config_io.load(TrainConfig, None, ["data.prompt_key=question", "custom_reward_function.name=score"])
    assert (cfg.data.prompt_key, cfg.custom_reward_function.name) == ("question", "score")


@pytest.mark.parametrize("key, line", [
    ("actor_rollout_ref.rollout.n", "verl's key; here: rollout.treepo.width or rollout.sequential.group_size"),
    ("rollout.n", "verl's actor_rollout_ref.rollout.n; here: rollout.treepo.width"),  # a dotted tail of one
    ("+actor_rollout_ref.actor.optim.lr", "verl's key; here: learner.lr"),  # Hydra's `+key=`
    ("actor_rollout_ref.model.lora_rank", "verl's key; here: model.lora_rank (same (peft)"),
    ("actor_rollout_ref.rollout.enforce_eager", "verl's key, with no equivalent here (docs/verl-migration.md"),
    ("trainer.stepz", None),
])
def test_explain(key, line):
    said = explain(key)
    assert (said is None) if line is None else said.startswith(line), said
