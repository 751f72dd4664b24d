"""Running-text geometry of the parallel-residual families (GPT-NeoX / Pythia, GPT-J, Phi: the
MLP reads h, not h + a, and adds beside the attention; methods §9) and of OPT, against the
float64 hook reference of ``test_text_extract`` on tiny random models; post-norm OPT is refused
in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_text_extract import (
    check_against_reference,
    extract,
    random_texts,
    refused,
    text_task,
)


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
