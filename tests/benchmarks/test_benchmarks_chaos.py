"""The chaos bench's verdict on two runs' per-step records."""

from treepo_ray.benchmarks.chaos import compare


def _run(losses, trajectories=4, faults=None):
    rows = [{"version": i, "trees": [[1, 2, i]], "rewards": [1.0], "loss": loss, "trajectories": trajectories}
            for i, loss in enumerate(losses)]
    return {"steps": len(rows), "rows": rows, "faults": faults or {}}


def test_equal_runs_are_identical_and_lose_nothing():
    verdict = compare(_run([0.5, 0.25]), _run([0.5, 0.25]))
    assert verdict["identical"] and verdict["trajectories_lost"] == 0 and verdict["loss_max_abs_diff"] == 0.0


def test_a_loss_off_by_rounding_is_not_identical_and_its_size_is_reported():
    verdict = compare(_run([0.5, 0.25]), _run([0.5, 0.25 + 3e-7]))
    assert not verdict["identical"] and verdict["same"] == {"trees": True, "rewards": True, "loss": False}
    assert abs(verdict["loss_max_abs_diff"] - 3e-7) < 1e-12


def test_missing_steps_short_trajectories_and_failed_verifications_count_as_lost():
    clean = _run([0.5, 0.25, 0.125], trajectories=4)
    chaos = _run([0.5, 0.25], trajectories=4, faults={"fault/verifier_failures": 2})
    chaos["rows"][0]["trajectories"] = 3
    verdict = compare(clean, chaos)
    assert verdict["trajectories_lost"] == 1 + 4 + 2 and not verdict["identical"]
