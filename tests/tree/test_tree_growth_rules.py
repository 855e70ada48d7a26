import pytest
from scripted_engine import BOX, CLOSE, EOS, OPEN, SEVEN, A, decode

from treepo_ray.tree import StopRules, Tree, has_complete_boxed, has_repetition


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{7}", True),
        (r"\boxed{\frac{1}{2}}", True),  # nested braces balanced
        (r"\boxed{\frac{1}{2}", False),  # the outer brace never closes
        (r"\boxed{", False),
        (r"\boxed 7", False),
        (r"\boxed{\frac{1}{2} and \boxed{3}", True),  # the second box is complete
        ("no box {here}", False),
    ],
)
def test_complete_boxed(text, expected):
    assert has_complete_boxed(text) is expected


def test_repetition_counts_overlapping_occurrences():
    # "a" * 39 holds "a" * 32 at 8 overlapping positions; "a" * 38 at 7. Non-overlapping counting would find 1.
    assert has_repetition("a" * 39, 32, 8)
    assert not has_repetition("a" * 38, 32, 8)
    assert has_repetition("xy" * 5, 4, 4)  # "xyxy" at 0, 2, 4, 6
    assert not has_repetition("abcdefgh" * 2, 4, 3)
    assert not has_repetition("a" * 100, 0, 8) and not has_repetition("a" * 100, 32, 0)  # 0 = no check


RULES = StopRules(max_depth=3, max_response_len=8, repetition_substr_len=8, repetition_min_count=3)


def classify(segments: list[list[int]], eos: bool, rules: StopRules = RULES) -> str:
    """Build one path of `segments` and classify its last node."""
    t = Tree(prompt_ids=[BOX, SEVEN, CLOSE])  # a box in the prompt must not count
    node = 0
    for seg in segments:
        node = t.add_node(node, seg, [0.0] * len(seg))
    return rules.classify(t, node, eos, decode)[0]


def test_nothing_to_stop():
    assert classify([[11, 12]], eos=False) == "none"


def test_each_rule_alone():
    assert classify([[11, BOX, SEVEN, CLOSE]], eos=False) == "boxed"
    assert classify([[11, EOS]], eos=True) == "eos"
    assert classify([[11, 12, 13, 14], [15, 16, 17, 18]], eos=False) == "max_length"
    assert classify([[11], [12], [13]], eos=False) == "max_depth"
    assert classify([[A, A, A]], eos=False) == "repetition"  # 12 "a"s: "a" * 8 five times


def test_rule_order_boxed_eos_length_depth_repetition():
    # boxed beats eos, length and depth
    assert classify([[11], [12, 13, 14], [BOX, SEVEN, CLOSE, EOS]], eos=True) == "boxed"
    # eos beats max_length and max_depth
    assert classify([[11], [12, 13, 14], [15, 16, 17, EOS]], eos=True) == "eos"
    # max_length beats max_depth and repetition
    assert classify([[11], [12, 13, 14], [A, A, A, A]], eos=False) == "max_length"
    # max_depth beats repetition
    assert classify([[11], [12], [A, A, A]], eos=False) == "max_depth"


def test_boxed_may_span_segments_and_nest():
    assert classify([[11, BOX, SEVEN], [CLOSE]], eos=False) == "boxed"
    assert classify([[BOX, OPEN, SEVEN, CLOSE]], eos=False) == "none"  # \boxed{{7} is still open
    assert classify([[BOX, OPEN, SEVEN, CLOSE], [CLOSE]], eos=False) == "boxed"


def test_require_eos_after_boxed():
    rules = StopRules(max_depth=3, max_response_len=8, require_eos_after_boxed=True)
    assert classify([[BOX, SEVEN, CLOSE]], eos=False, rules=rules) == "none"
    assert classify([[BOX, SEVEN, CLOSE], [EOS]], eos=True, rules=rules) == "boxed"
    assert classify([[11, EOS]], eos=True, rules=rules) == "eos"


def test_repetition_looks_at_the_new_segment_only():
    # Two "aaaaaaaa" segments: the whole response repeats "a" * 8 nine times, each segment only once.
    rules = StopRules(max_depth=5, max_response_len=100, repetition_substr_len=8, repetition_min_count=3)
    assert classify([[A, A], [A, A]], eos=False, rules=rules) == "none"
    assert classify([[A, A], [A, A, A]], eos=False, rules=rules) == "repetition"


def test_treerpo_rules_skip_boxed_and_repetition():
    rules = StopRules(max_depth=3, max_response_len=100, check_boxed=False)
    assert classify([[BOX, SEVEN, CLOSE]], eos=False, rules=rules) == "none"
    assert classify([[A] * 10], eos=False, rules=rules) == "none"
