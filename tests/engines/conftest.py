"""Fixtures of the engine tests: tiny Qwen2 models whose weights are spread out (see hf_testlib.build), built once
per session. A plain tiny model would not do here: its default init only ever repeats its last token, which would
make greedy, sampling and cache tests pass vacuously."""

from __future__ import annotations

import pytest
from hf_testlib import build, hf_model


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A 2-layer tiny Qwen2 (GQA 4:2) with spread weights."""
    return build(tmp_path_factory.mktemp("hf_engine") / "small")


@pytest.fixture(scope="session")
def padded_model_dir(tmp_path_factory):
    """The same shape with an embedding padded to 300 rows (the tokenizer has 258) and large padding rows."""
    return build(tmp_path_factory.mktemp("hf_engine") / "padded", padded_vocab=300)


@pytest.fixture(scope="session")
def hf(model_dir):
    """The Hugging Face model of `model_dir`: the reference the engine is checked against."""
    return hf_model(model_dir)
