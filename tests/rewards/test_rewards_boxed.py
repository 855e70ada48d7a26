"""Box extraction and the string normal form: pure functions, no worker."""

import time

from treepo_ray.rewards.boxed import last_boxed, normalize_answer


def test_last_complete_box_wins():
    assert last_boxed(r"first \boxed{1}, then \boxed{2}.") == "2"
    # a truncated last box does not count: the earlier complete one does
    assert last_boxed(r"\boxed{3} so the answer is \boxed{12") == "3"


def test_nested_braces_and_boxes():
    assert last_boxed(r"\boxed{\frac{1}{\sqrt{2}}}") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\boxed{\boxed{5}}") == "5"
    assert last_boxed(r"\boxed{ \boxed{ 5 } }") == "5"
    # a box holding more than one box is not unwrapped
    assert last_boxed(r"\boxed{\boxed{1}+\boxed{2}}") == r"\boxed{1}+\boxed{2}"
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"\boxed {4}") == "4"


def test_no_box():
    assert last_boxed("the answer is 4") is None
    assert last_boxed(r"\boxed{") is None
    assert last_boxed("") is None
    assert last_boxed(r"\boxed{}") == ""


def test_unmatched_braces_are_ignored():
    assert last_boxed(r"}} \boxed{x}}") == "x"


def test_scan_is_bounded_by_max_chars():
    text = r"\boxed{1}" + "x" * 1000
    assert last_boxed(text) == "1"
    assert last_boxed(text, max_chars=500) is None


def test_pathological_nesting_is_linear():
    start = time.monotonic()
    assert last_boxed(r"\boxed{" * 50_000 + "1" + "}" * 50_000) == "1"
    assert last_boxed(r"\boxed{" * 50_000) is None
    assert time.monotonic() - start < 5.0


def test_normal_form():
    assert normalize_answer(r" \dfrac{1}{2}. ") == r"\frac{1}{2}"
    assert normalize_answer(r"\left( 1, 2 \right)") == "(1,2)"
    assert normalize_answer(r"90^\circ") == normalize_answer("90")
    assert normalize_answer(r"\text{ 5 cm}") == "5cm"
    assert normalize_answer("$x$") == "x"
    assert normalize_answer("12") != normalize_answer("21")
