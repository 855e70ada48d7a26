"""The prompt record and the stream that hands prompts out (data/prompts.py): reproducible, unique ids over epochs,
and a resumed run continues with exactly the prompts the interrupted one would have taken (no Ray, no model)."""

import dataclasses

import pytest

from treepo_ray.data.prompts import Prompt, PromptStream

PROMPTS = [Prompt(str(i), (i + 1, i + 2), str(2 * i), "synthetic_addition", f"{i} + {i}") for i in range(5)]


def test_ids_stay_unique_over_epochs_and_each_epoch_is_a_permutation():
    taken = PromptStream(PROMPTS, seed=3).take(12)  # two full epochs and the start of a third
    assert len({p.id for p in taken}) == 12
    assert [p.id.split("#")[1] for p in taken] == [str(i) for i in range(12)]  # `<id>#<position>`
    for epoch in (taken[:5], taken[5:10]):
        assert sorted(p.id.split("#")[0] for p in epoch) == ["0", "1", "2", "3", "4"]
    assert [p.id.split("#")[0] for p in taken[:5]] != [p.id.split("#")[0] for p in taken[5:10]]  # reshuffled
    # Everything but the id and the seed is the dataset's record, unchanged (and the record stays immutable).
    for p in taken:
        original = PROMPTS[int(p.id.split("#")[0])]
        assert dataclasses.replace(p, id=original.id, seed=original.seed) == original
    with pytest.raises(dataclasses.FrozenInstanceError):
        taken[0].seed = 1
    # One sampling seed per position, from (stream seed, position): distinct, and the same in every run.
    assert len({p.seed for p in taken}) == 12
    assert PromptStream(PROMPTS, seed=3).take(12) == taken
    assert [p.id for p in PromptStream(PROMPTS, seed=4).take(5)] != [p.id for p in taken[:5]]


def test_a_resumed_position_gives_the_same_prompts():
    stream = PromptStream(PROMPTS, seed=3)
    stream.take(7)  # a checkpoint saved here holds data_position = 7
    assert stream.position == 7
    rest = stream.take(6)
    assert PromptStream(PROMPTS, seed=3, position=7).take(6) == rest  # a run resumed from the checkpoint
    assert stream.rewound(7).take(6) == rest  # a learner rebuilt from it mid-run
    assert stream.position == 13  # rewinding makes a new stream; this one goes on


def test_without_shuffle_the_dataset_order_is_kept_and_an_empty_set_is_refused():
    assert [p.id for p in PromptStream(PROMPTS, seed=3, shuffle=False).take(7)] == [
        "0#0", "1#1", "2#2", "3#3", "4#4", "0#5", "1#6"]
    with pytest.raises(ValueError, match="training set is empty"):
        PromptStream([], seed=0)
