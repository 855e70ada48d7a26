"""The trainer state saved with every checkpoint (job/state.py): the JSON keys checkpoints have always held, and
the round trip a resumed run depends on (no Ray)."""

import json

from treepo_ray.job.state import TrainerState

# trainer_state.json as `treepo-ray train` has always written it (before TrainerState existed, too).
CHECKPOINT = {"step": 2, "data_position": 8, "elapsed_s": 12.5, "trajectories": 32,
              "base_eval": {"eval/accuracy": 0.25, "eval/problems": 8.0}, "seed": 3}


def test_a_checkpoints_json_round_trips_with_the_same_keys():
    state = TrainerState.from_dict(json.loads(json.dumps(CHECKPOINT)))
    assert (state.step, state.data_position, state.elapsed_s, state.trajectories, state.seed) == (2, 8, 12.5, 32, 3)
    assert state.base_eval == {"eval/accuracy": 0.25, "eval/problems": 8.0}
    assert json.loads(json.dumps(state.to_dict())) == CHECKPOINT


def test_base_eval_is_left_out_until_it_ran_and_kept_when_empty():
    fresh = TrainerState(seed=3)
    assert fresh.to_dict() == {"step": 0, "data_position": 0, "elapsed_s": 0.0, "trajectories": 0, "seed": 3}
    assert TrainerState.from_dict(fresh.to_dict()).base_eval is None  # a resumed run evaluates the base model
    # No held-out set: evaluated to nothing, which a resumed run must not evaluate again.
    assert TrainerState(base_eval={}).to_dict()["base_eval"] == {}
    assert TrainerState.from_dict(TrainerState(base_eval={}).to_dict()).base_eval == {}


def test_keys_it_does_not_know_are_ignored():
    assert TrainerState.from_dict({**CHECKPOINT, "written_by": "a later version"}) == TrainerState.from_dict(
        CHECKPOINT)
    assert TrainerState.from_dict({"step": 4, "data_position": 16}) == TrainerState(step=4, data_position=16)
