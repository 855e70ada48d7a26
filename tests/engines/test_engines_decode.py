"""Decoding model output never raises, whatever ids a model sampled (engines/decode.py: safe_decode; what the tree
scheduler relies on to hand model output to its verifiers). No Ray, no model."""

import pytest

from treepo_ray.engines.decode import safe_decode
from treepo_ray.engines.tiny import build_tokenizer


def test_safe_decode_never_raises_and_marks_bad_ids():
    tok = build_tokenizer()  # 258 ids: EOS, PAD, then one per byte (byte b is id b + 2)
    good = [ord("4") + 2, ord("2") + 2]
    assert safe_decode(tok, good) == tok.decode(good) == "42"
    # An id past the vocabulary (a padded embedding matrix can sample one) and ids the fast tokenizer cannot even
    # convert (negative, > 2**32) would raise OverflowError in tokenizer.decode.
    with pytest.raises(OverflowError):
        tok.decode([-1])
    assert safe_decode(tok, [good[0], 300, good[1]]) == "4\ufffd2"
    assert safe_decode(tok, [-1, good[0], 2**40]) == "\ufffd4\ufffd"
    assert safe_decode(tok, ["x", None]) == "\ufffd"
    assert safe_decode(tok, []) == ""
