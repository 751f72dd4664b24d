"""The learned-lens translators file (store/translators.py): round trip, fingerprint, refusals."""

from __future__ import annotations

import numpy as np
import pytest

from layerdiv.store.translators import (
    TranslatorError,
    Translators,
    load_translators,
    save_translators,
)


def _lens(kind: str = "ls") -> Translators:
    rng = np.random.default_rng(0)
    return Translators(
        kind=kind,
        A=rng.normal(size=(3, 4, 4)),
        b=rng.normal(size=(3, 4)),
        weights_fingerprint="f" * 64,
        task="train-task",
        settings={"lambda": 0.5},
    )


def test_round_trip_keeps_tensors_metadata_and_fingerprint(tmp_path):
    t = _lens()
    fp = save_translators(tmp_path / "lens.safetensors", t)
    back = load_translators(tmp_path / "lens.safetensors")
    assert np.array_equal(back.A, t.A) and np.array_equal(back.b, t.b)
    assert (back.kind, back.task, back.settings) == ("ls", "train-task", {"lambda": 0.5})
    assert back.fingerprint == fp == t.fingerprint
    assert _lens("tuned").fingerprint != fp


def test_edited_file_and_other_model_are_refused(tmp_path):
    path = tmp_path / "lens.safetensors"
    save_translators(path, _lens())
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a byte of b
    path.write_bytes(bytes(data))
    with pytest.raises(TranslatorError, match="fingerprint"):
        load_translators(path)
    with pytest.raises(TranslatorError, match="fit-lens"):
        load_translators(tmp_path / "missing.safetensors")
    t = _lens()
    with pytest.raises(TranslatorError, match="fitted on weights"):
        t.check_model("0" * 64, 3, 4)
    with pytest.raises(TranslatorError, match="3 blocks of width 4"):
        t.check_model("f" * 64, 30, 4)
    with pytest.raises(TranslatorError, match="not a learned lens"):
        _lens("logit")
