"""Integrated gradients per block and position (``extract --igrad``, methods §13) against an
independent float64 reference on tiny random models (a sequential and a parallel-block family)
and on SmolLM2, over the handwritten multi-hop questions of ``tests/data/multihop``; their bad
input refused in one line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
import torch

from layerdiv.extract.adapters import adapter_for, get_module
from layerdiv.store import Store
from tests.test_multihop import SHORT, documents, multihop_task
from tests.test_text_extract import extract, refused, text_task
from tests.tolerance import assert_within

STEPS = 6
"""Steps m of the tiny models' runs (the reference loops over them one by one)."""


Target = Callable[[torch.Tensor], torch.Tensor]
"""The model's logits (T, V) over one sequence, float64 -> f."""


def answer_target(ids: list[int], start: int) -> Target:
    """f = sum over j = start..T-1 of softmax(z_(j-1))[x_j] (a text task's answer)."""
    j = torch.arange(max(start, 1), len(ids))
    return lambda logits: torch.softmax(logits, dim=-1)[j - 1, torch.tensor(ids)[j]].sum()


def option_target(options: list[int], gold: int) -> Target:
    """f = softmax over the option logits at the last token, at the gold option (a choice
    task)."""
    return lambda logits: torch.softmax(logits[-1, options], dim=-1)[gold]


def reference(
    model: Any, ids: list[int], target: Target, site: str, layer: int, steps: int
) -> tuple[np.ndarray, float, float]:
    """IG (T,), f(x) and f(b) of one sequence, site and block, float64, as methods §13 states
    them: x the site's activation of block ``layer`` in a plain pass; b its mean over the
    positions; for k = 0..m-1 a forward hook replaces the site's output by b + (k/m)(x - b) at
    every position, f is ``target`` of the model's own logits, and torch.autograd.grad gives
    df/dx(alpha_k)."""
    adapter = adapter_for(model.config)
    block = get_module(model, adapter.blocks)[layer]
    module = block if site == "block" else get_module(block, getattr(adapter, site))
    tokens = torch.tensor([ids])
    replacement: list[torch.Tensor] = []
    kept: list[torch.Tensor] = []

    def hook(m: Any, args: Any, output: Any) -> Any:
        out = output[0] if isinstance(output, tuple) else output
        kept.append(out[0].detach())
        if not replacement:
            return None
        new = replacement[0][None]
        return (new, *output[1:]) if isinstance(output, tuple) else new

    handle = module.register_forward_hook(hook)
    try:
        with torch.no_grad():
            f_x = float(target(model(tokens).logits[0].double()))
        x = kept[0]
        b = x.mean(dim=0, keepdim=True)
        grads = torch.zeros_like(x)
        f_b = 0.0
        for k in range(steps):
            point = (b + k / steps * (x - b)).requires_grad_()
            replacement[:] = [point]
            f = target(model(tokens).logits[0].double())
            (g,) = torch.autograd.grad(f, point)
            grads += g
            f_b = float(f.detach()) if k == 0 else f_b
    finally:
        handle.remove()
    return ((x - b) * grads / steps).sum(-1).numpy(), f_x, f_b


def stored(store: Path) -> tuple[pl.DataFrame, pl.DataFrame]:
    s = Store(store)
    cast = pl.col("sublayer").cast(pl.String)
    return (
        s.scan("igrad").collect().with_columns(cast),
        s.scan("igrad_ends").collect().with_columns(cast),
    )


def answers(tokenizer: Any, short: bool, limit: int) -> list[tuple[list[int], Target]]:
    """The token ids and target of the first ``limit`` multi-hop documents (text + answer, the
    answer starting at s = T - A, methods §10)."""
    cases = []
    for document, answer in documents(short)[:limit]:
        ids = tokenizer(document)["input_ids"]
        start = len(ids) - len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        cases.append((ids, answer_target(ids, start)))
    return cases


def check_against_reference(
    store: Path,
    model: Any,
    cases: list[tuple[list[int], Target]],
    sites: list[str],
    steps: int,
    blocks: list[int] | None = None,
) -> int:
    """The stored rows of each sequence of ``cases`` (by index: its token ids and target; of
    ``blocks``, default all) against :func:`reference`; returns the (sequence, site, block) maps
    compared."""
    igrad, ends = stored(store)
    every = range(len(get_module(model, adapter_for(model.config).blocks)))
    compared = 0
    for doc, (ids, target) in enumerate(cases):
        for site in sites:
            for layer in every if blocks is None else blocks:
                ig, f_x, f_b = reference(model, ids, target, site, layer, steps)
                key = (pl.col("doc") == doc) & (pl.col("sublayer") == site)
                mine = igrad.filter(key & (pl.col("block") == layer)).sort("pos")
                assert mine["pos"].to_list() == list(range(len(ids)))
                got = mine["attribution"].to_numpy()
                # within 2e-3 of the map's largest |attribution| (float32 against float64)
                what = f"doc {doc} {site} block {layer}"
                assert_within(got, ig, np.abs(ig).max(), 2e-3, what=what)
                (end,) = ends.filter(key & (pl.col("block") == layer)).iter_rows(named=True)
                assert_within(end["f_input"], f_x, max(f_x, f_b), 2e-3, what=what)
                assert_within(end["f_baseline"], f_b, max(f_x, f_b), 2e-3, what=what)
                compared += 1
    return compared


@pytest.mark.numerical
@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_integrated_gradients_match_the_float64_reference(
    family: str, tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any
) -> None:
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs(family)), "--task", str(task), "--store", str(store),
                  "--igrad", "--igrad-site", "block", "--igrad-site", "attn", "--igrad-steps",
                  str(STEPS), "--limit", "5", "--batch-size", "3")  # fmt: skip
    assert out.exit_code == 0, out.output
    settings = Store(store).partitions[0].manifest.settings["igrad"]
    assert settings == {"igrad_sites": ["block", "attn"], "igrad_steps": STEPS}
    model = build_model(family).to(torch.float64)
    cases = answers(tokenizer, True, 5)
    assert check_against_reference(store, model, cases, ["block", "attn"], STEPS) == 20
    igrad, ends = stored(store)
    # completeness: sum_t IG(l, t) approaches f(x) - f(b) (a left Riemann sum of 6 steps: loosely)
    gaps = (
        igrad.group_by("doc", "sublayer", "block")
        .agg(pl.col("attribution").sum())
        .join(ends, on=["doc", "sublayer", "block"])
    )
    assert float((gaps["f_input"] - gaps["f_baseline"]).abs().max()) > 0  # type: ignore[arg-type]


@pytest.mark.numerical
def test_integrated_gradients_of_a_choice_task_match_the_float64_reference(
    tmp_path: Path, model_dirs: Any, build_model: Any, tokenizer: Any, make_task: Any
) -> None:
    task = make_task(tmp_path / "task", n=4)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
                  "--igrad", "--igrad-site", "block", "--igrad-site", "mlp", "--igrad-steps",
                  str(STEPS), "--batch-size", "3")  # fmt: skip
    assert out.exit_code == 0, out.output
    (info,) = Store(store).select()
    options = list(info.manifest.option_token_ids)
    instances = info.scan("instances").collect().sort("instance")
    cases = [
        (tokenizer(prompt)["input_ids"], option_target(options, gold))
        for prompt, gold in zip(instances["prompt"], instances["gold"], strict=True)
    ]
    model = build_model("llama").to(torch.float64)
    assert check_against_reference(store, model, cases, ["block", "mlp"], STEPS) == 16


def test_bad_igrad_input_is_refused_in_one_line(tmp_path: Path, model_dirs: Any) -> None:
    model = str(model_dirs("llama"))
    plain = text_task(tmp_path / "a", ["the cat sat on the warm mat by the door of the house"])
    line = refused(tmp_path, model, plain, "--igrad")
    assert "--igrad's target is the probability of the answer's tokens" in line
    assert "names none; add an 'answer' template" in line
    task = multihop_task(tmp_path / "b", **SHORT)
    for steps in ("0", "-3"):
        line = refused(tmp_path, model, task, "--igrad", "--igrad-steps", steps)
        assert f"--igrad-steps {steps}: the Riemann sum needs at least one step" in line
    line = refused(tmp_path, model, task, "--igrad-steps", "4")
    assert "--igrad-steps" in line and "--igrad" in line


def test_a_site_the_blocks_lack_is_refused(build_model: Any) -> None:
    from dataclasses import replace

    from layerdiv.measurements.igrad import IgradError, check_sites

    model = build_model("llama")
    adapter = adapter_for(model.config)
    blocks = list(get_module(model, adapter.blocks))
    check_sites(("block", "attn", "mlp"), adapter, blocks)
    fused = replace(adapter, mlp="fused_mlp")  # a family whose block has no MLP module
    with pytest.raises(IgradError, match=r"--igrad-site mlp: this llama model's blocks have no "
                       "separate mlp output; use --igrad-site block"):  # fmt: skip
        check_sites(("block", "mlp"), fused, blocks)


@pytest.mark.slow
@pytest.mark.numerical
def test_smollm2_integrated_gradients_match_the_float64_reference(tmp_path: Path) -> None:
    from layerdiv.extract.models import load_model, load_tokenizer, resolve_source

    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    out = extract("--model", "smollm2-135m-instruct", "--task", str(task), "--store", str(store),
                  "--igrad", "--igrad-steps", "3", "--limit", "1")  # fmt: skip
    assert out.exit_code == 0, out.output
    source = resolve_source("smollm2-135m-instruct", None, None, False)
    tokenizer = load_tokenizer(source)
    model = load_model(source, tokenizer, torch.device("cpu"), torch.float64).model
    igrad, _ = stored(store)
    assert sorted(igrad["block"].unique().to_list()) == list(range(30))
    # the first, a middle and the last block against the reference (each a float64 loop)
    cases = answers(tokenizer, True, 1)
    compared = check_against_reference(store, model, cases, ["block"], 3, [0, 15, 29])
    assert compared == 3


def test_a_slice_out_of_memory_is_halved_and_gives_the_same_maps(
    tmp_path: Path, model_dirs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from layerdiv.measurements.igrad.hooks import IgradCapture

    task = multihop_task(tmp_path / "task", **SHORT)
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--igrad", "--igrad-steps",
            "4", "--limit", "3"]  # fmt: skip
    assert extract(*args, "--store", str(tmp_path / "a")).exit_code == 0
    target, sizes = IgradCapture._target, []

    def short_of_memory(self: IgradCapture, site: str, layer: int, z: torch.Tensor,
                        *rest: Any) -> torch.Tensor:  # fmt: skip
        sizes.append(len(z))
        if len(sizes) == 1:
            raise torch.OutOfMemoryError("out of memory")
        return target(self, site, layer, z, *rest)

    monkeypatch.setattr(IgradCapture, "_target", short_of_memory)
    out = extract(*args, "--store", str(tmp_path / "b"))
    assert out.exit_code == 0, out.output
    assert sizes[0] > 1 and max(sizes[1:]) < sizes[0]  # halved, then kept
    for got, want in zip(stored(tmp_path / "b"), stored(tmp_path / "a"), strict=True):
        keys = [c for c in got.columns if got[c].dtype != pl.Float32]
        assert got.select(keys).equals(want.select(keys))
        for column in (c for c in got.columns if c not in keys):
            scale = np.abs(want[column].to_numpy()).max()
            assert_within(got[column].to_numpy(), want[column].to_numpy(), scale)
