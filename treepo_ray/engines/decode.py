"""Detokenisation that survives any model output."""

from __future__ import annotations


def safe_decode(tokenizer, ids, **kwargs) -> str:
    """`tokenizer.decode(ids)` that never raises. A model output the tokenizer cannot read (ids outside its
    vocabulary, e.g. from an embedding matrix padded past the tokenizer) decodes with U+FFFD in place of the bad
    ids, so a bad sample is scored (as wrong) instead of killing the scheduler that holds a batch of trees."""
    size = len(tokenizer)
    try:
        ids = [int(i) for i in ids]
    except (TypeError, ValueError, OverflowError):
        return "\ufffd"
    if all(0 <= i < size for i in ids):
        try:
            return tokenizer.decode(ids, **kwargs)
        except Exception:  # noqa: BLE001 - a tokenizer bug must not take down the run either
            pass
    out, run = [], []
    for i in ids + [-1]:
        if 0 <= i < size:
            run.append(i)
            continue
        if run:
            try:
                out.append(tokenizer.decode(run, **kwargs))
            except Exception:  # noqa: BLE001
                out.append("\ufffd" * len(run))
            run = []
        out.append("\ufffd")
    return "".join(out[:-1])  # the last U+FFFD stands for the -1 sentinel
