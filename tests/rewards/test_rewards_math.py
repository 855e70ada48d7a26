"""The math verifier on real answer formats and on pathological inputs, with real math-verify workers."""

import time

import pytest

from treepo_ray.rewards.math import MathVerifier, MathVerifyConfig, compute_score

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def verifier():
    with MathVerifier(MathVerifyConfig(timeout_s=TIMEOUT_S, num_workers=2)) as v:
        yield v


EQUAL = [
    (r"\frac{1}{2}", "0.5"),
    ("1/2", r"\frac12"),
    (r"\dfrac{3}{4}", "0.75"),
    (r"50\%", "0.5"),
    (r"50\%", "50"),
    ("[1,2)", "[1, 2)"),
    (r"\{1,2\}", r"\{2,1\}"),
    (r"\sqrt{2}/2", r"\frac{\sqrt{2}}{2}"),
    ("x=3", "3"),
    ("1,000", "1000"),
    (r"10^{3}", "1000"),
    (r"\left(1, 2\right)", "(1,2)"),
    (r"\text{(B)}", "B"),
    (r"\infty", r"\infty"),
]

UNEQUAL = [
    ("2", "3"),
    ("[1,2)", "(1,2)"),
    (r"\{1,2\}", r"\{1,3\}"),
    ("(1,2)", "(2,1)"),
    ("0.333", r"\frac13"),
    (r"\pi", "3.14159"),
    (r"\frac{1}{2}", r"\frac{2}{1}"),
    ("-5", "5"),
    (r"\sqrt{3}", "3"),
]


def test_equal_forms(verifier):
    sols = [rf"So the answer is $\boxed{{{p}}}$." for p, _ in EQUAL]
    results = verifier.score_batch(sols, [g for _, g in EQUAL])
    for (p, g), r in zip(EQUAL, results):
        assert r["acc"] == 1.0 and r["score"] == 1.0, (p, g, r)
        assert r["pred"] == p


def test_unequal_forms(verifier):
    sols = [rf"\boxed{{{p}}}" for p, _ in UNEQUAL]
    results = verifier.score_batch(sols, [g for _, g in UNEQUAL])
    for (p, g), r in zip(UNEQUAL, results):
        assert r["acc"] == 0.0 and r["score"] == 0.0, (p, g, r)


def test_box_selection(verifier):
    r = verifier.score_batch(
        [r"try \boxed{4}, no: \boxed{5}", r"\boxed{\boxed{5}}", "the answer is 5", r"\boxed{5} and \boxed{6"],
        ["5", "5", "5", "5"],
    )
    assert [x["acc"] for x in r] == [1.0, 1.0, 0.0, 1.0]
    assert r[2]["pred"] == ""  # no box: wrong, nothing extracted


def test_ground_truth_forms(verifier):
    r = verifier.score_batch([r"\boxed{7}", r"\boxed{7}", r"\boxed{0.25}"], [7, r"so $\boxed{7}$", 0.25])
    assert [x["acc"] for x in r] == [1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="ground_truth"):
        verifier.score_batch([r"\boxed{1}"], [[1]])
    with pytest.raises(ValueError, match="2 ground truths"):
        verifier.score_batch([r"\boxed{1}"], ["1", "2"])


def test_plus_minus_one_scores():
    cfg = MathVerifyConfig(correct_score=1.0, wrong_score=-1.0, timeout_s=TIMEOUT_S)
    assert compute_score(r"\boxed{3}", "3", cfg) == {"score": 1.0, "acc": 1.0, "pred": "3"}
    assert compute_score(r"\boxed{4}", "3", cfg) == {"score": -1.0, "acc": 0.0, "pred": "4"}
    assert compute_score(r"\boxed{\frac{6}{4}}", "1.5", cfg)["score"] == 1.0


def test_pathological_inputs_are_wrong_within_timeout_and_the_pool_goes_on(verifier):
    sols = [
        r"\boxed{10^{10^{10}}}",  # sympy tries to expand the tower: only the kill ends it
        r"\boxed{" + "{" * 50 + "1" + "}" * 50 + "}",  # the LaTeX parser backtracks for minutes
        r"\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",  # over the answer length cap: wrong without parsing
        "x" * 3_000_000,  # megabytes, no box
        "y" * 3_000_000 + r"\boxed{843}",  # megabytes, then a right answer
        r"\boxed{" * 3000 + "}" * 10,  # thousands of unclosed boxes
    ]
    gts = ["5", "1", "1", "843", "843", "1"]
    start = time.monotonic()
    results = verifier.score_batch(sols, gts)
    elapsed = time.monotonic() - start
    assert [r["acc"] for r in results] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    # two hung items, two workers: both killed at one deadline (plus the extraction of megabytes)
    assert elapsed < 3 * TIMEOUT_S + 2.0, elapsed
    assert verifier.restarts >= 2
    # the replaced workers serve the next batch
    after = verifier.score_batch([r"\boxed{\frac{2}{4}}", r"\boxed{3}"], ["0.5", "4"])
    assert [r["acc"] for r in after] == [1.0, 0.0]


def test_closed_verifier_refuses():
    v = MathVerifier(MathVerifyConfig(num_workers=1))
    v.close()
    with pytest.raises(RuntimeError, match="closed"):
        v.score_batch([r"\boxed{1}"], ["2"])
    with pytest.raises(ValueError, match="num_workers"):
        MathVerifier(MathVerifyConfig(num_workers=0))


PARENT = r"""
import sys, threading
from treepo_ray.rewards.math import MathVerifier, MathVerifyConfig
v = MathVerifier(MathVerifyConfig(timeout_s=600.0, num_workers=2))
print(" ".join(str(w.proc.pid) for w in v._pool._workers), flush=True)
v.score_batch([r"\boxed{10^{10^{10}}}"] * 2, ["5", "5"])  # both workers busy for minutes, in C
"""


@pytest.mark.slow
def test_workers_die_with_the_process_that_started_them():
    import subprocess
    import sys

    import psutil

    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    workers = [psutil.Process(int(pid)) for pid in parent.stdout.readline().split()]
    time.sleep(3.0)  # past start-up (about a second of imports): the towers are being expanded
    assert len(workers) == 2 and all(w.is_running() for w in workers)
    parent.kill()  # SIGKILL: no clean-up of its own runs
    parent.wait()
    gone, alive = psutil.wait_procs(workers, timeout=5)
    assert alive == []
