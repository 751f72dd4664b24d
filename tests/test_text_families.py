"""Running-text geometry of the parallel-residual families (GPT-NeoX / Pythia, GPT-J, Phi: the
MLP reads h, not h + a, and adds beside the attention; methods §9) and of OPT, against the
float64 hook reference of ``test_text_extract`` on tiny random models, and the parallel
families' logit lens and future effects against the float64 references of ``test_text_extract``
and ``test_future_effects``; post-norm OPT is refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.test_future_effects import check
from tests.test_text_extract import (
    assert_lens_close,
    check_against_reference,
    extract,
    lens_values,
    random_texts,
    reference_lens,
    refused,
    text_task,
)


@pytest.mark.numerical
@pytest.mark.parametrize("family", ["gpt_neox", "gptj", "phi", "opt"])
def test_text_geometry_matches_the_float64_reference(
    family: str, tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    texts = random_texts(5, seed=3)
    task = text_task(tmp_path / "task", texts, max_tokens=20)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs(family)), "--task", str(task), "--store",
                  str(store), "--batch-size", "3")  # fmt: skip
    assert out.exit_code == 0, out.output
    model = build_model(family).to(torch.float64)  # the same weights (seed 0)
    check_against_reference(store, model, tokenizer, texts, 20)


def test_post_norm_opt_is_refused_in_one_line(tmp_path: Path, model_dirs: Any) -> None:
    task = text_task(tmp_path / "task", random_texts(2))
    line = refused(tmp_path, str(model_dirs("opt_post_norm")), task)
    assert "do_layer_norm_before=False" in line and "post-norm" in line


@pytest.mark.numerical
@pytest.mark.parametrize("family", ["gpt_neox", "gptj", "phi"])
def test_parallel_families_lens_and_future_effects_match_the_float64_references(
    family: str, tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    texts = random_texts(4, seed=8)
    task = text_task(tmp_path / "task", texts, max_tokens=24)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs(family)), "--task", str(task), "--store", str(store),
                  "--lens", "--skips", "--skip-sublayer", "block", "--skip-sublayer", "attn",
                  "--skip-sublayer", "mlp", "--batch-size", "2")  # fmt: skip
    assert out.exit_code == 0, out.output
    model = build_model(family).to(torch.float64)
    got, want = [], []
    for doc, text in enumerate(texts):
        got.append(lens_values(store, doc))
        want.append(reference_lens(model, tokenizer(text)["input_ids"][:24]))
    assert_lens_close(np.concatenate(got), np.concatenate(want))
    assert check(store, model, tokenizer, texts, 24, ["block", "attn", "mlp"]) >= 3
