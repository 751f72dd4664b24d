"""Integrated gradients per block and position (``extract --igrad``, methods §13) against an
independent float64 reference on tiny random models (a sequential and a parallel-block family)
and on SmolLM2, over the handwritten multi-hop questions of ``tasks/data/multihop``; their bad
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
from layerdiv.measurements.igrad.analysis import GAP_LEVEL
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
    settings = Store(store).partitions[0].manifest.settings["igrad"]  # the rule by default
    assert settings == {"igrad_sites": ["block", "attn"], "igrad_steps": STEPS,
                        "igrad_rule": "riemann"}  # fmt: skip
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
def test_integrated_gradients_of_a_soft_capped_model_match_the_float64_reference(
    tmp_path: Path, build_model: Any, tokenizer: Any
) -> None:
    """A text task's target reads the model's whole readout, its final soft-cap included (here
    0.1, near the tiny model's logits, so that leaving it out shows), with gradients through
    it (``--allow-softcap``)."""
    model = build_model("gemma2_softcap")
    model.config.final_logit_softcapping = 0.1
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    out = extract("--model", str(tmp_path / "model"), "--task", str(task), "--store", str(store),
                  "--igrad", "--igrad-steps", str(STEPS), "--limit", "2",
                  "--allow-softcap")  # fmt: skip
    assert out.exit_code == 0, out.output
    model = model.to(torch.float64)
    assert check_against_reference(store, model, answers(tokenizer, True, 2), ["block"], STEPS) == 4


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
    for steps in ("0", "-3", "65537", "99999999999999999999"):  # refused before any estimate
        line = refused(tmp_path, model, task, "--igrad", "--igrad-steps", steps)
        assert f"--igrad-steps {steps}: the Riemann sum takes 1 to 65536 steps" in line
    line = refused(tmp_path, model, task, "--igrad", "--igrad-rule", "gauss", "--igrad-steps",
                   "1025")  # fmt: skip
    assert "--igrad-steps 1025: the Gauss rule takes 1 to 1024 nodes" in line
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


class _Stop(Exception):
    """Stops an extraction at its first slice of path points."""


def test_path_points_are_made_per_slice(
    tmp_path: Path, model_dirs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The largest step count a run may ask for builds no list of its m path points per
    document: the memory Python holds when the first slice is sized is what it held before the
    integration began (a list of 2 x 65,536 points would hold over 10 MB)."""
    import tracemalloc

    from layerdiv.measurements.igrad.hooks import IgradCapture

    held: list[int] = []
    integrate, slice_rows = IgradCapture._integrate, IgradCapture._slice_rows

    def before(self: IgradCapture, docs: list[int]) -> Any:
        held.append(tracemalloc.get_traced_memory()[0])
        return integrate(self, docs)

    def first_slice(self: IgradCapture, width: int, runs: int) -> int:
        held.append(tracemalloc.get_traced_memory()[0])
        raise _Stop(slice_rows(self, width, runs))

    monkeypatch.setattr(IgradCapture, "_integrate", before)
    monkeypatch.setattr(IgradCapture, "_slice_rows", first_slice)
    task = multihop_task(tmp_path / "task", **SHORT)
    tracemalloc.start()
    try:
        with pytest.raises(_Stop):
            extract("--model", str(model_dirs("llama")), "--task", str(task), "--store",
                    str(tmp_path / "s"), "--igrad", "--igrad-steps", "65536", "--limit", "2",
                    "--batch-size", "2")  # fmt: skip
    finally:
        tracemalloc.stop()
    assert len(held) == 2 and held[1] - held[0] < 1_000_000, held


def test_the_same_sites_in_another_order_are_the_stored_ones(
    tmp_path: Path, model_dirs: Any
) -> None:
    """``--igrad-site`` values are a set: given in another order on a rerun they extend the
    partition with the recorded order; another set is refused."""
    task = multihop_task(tmp_path / "task", **SHORT)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
            "--igrad", "--igrad-steps", "2"]  # fmt: skip
    first = extract(*args, "--limit", "2", "--igrad-site", "mlp", "--igrad-site", "block")
    assert first.exit_code == 0, first.output
    more = extract(*args, "--limit", "3", "--igrad-site", "block", "--igrad-site", "mlp")
    assert more.exit_code == 0, more.output
    (info,) = Store(store).select()
    assert info.manifest.settings["igrad"]["igrad_sites"] == ["mlp", "block"]
    igrad, ends = stored(store)
    assert sorted(ends["doc"].unique().to_list()) == [0, 1, 2]
    cells = 2 * ends["block"].n_unique()  # per document: a row per site and block
    assert ends.group_by("doc").len()["len"].to_list() == [cells] * 3
    assert igrad["sublayer"].unique(maintain_order=True).to_list() == ["mlp", "block"]
    other = extract(*args, "--limit", "3", "--igrad-site", "block")
    assert other.exit_code == 1
    assert (
        "the stored igrad was extracted with --igrad --igrad-site mlp --igrad-site block "
        "--igrad-steps 2 --igrad-rule riemann, this run asks for --igrad --igrad-site block "
        "--igrad-steps 2 --igrad-rule riemann" in (other.output)
    )


ANSWERED = ["the cat sat", "a dog ran", "the mat", "the cat sat on the warm mat by the door "
            "of the house and the dog ran to the cat on the mat", "a dog ran by the door of "
            "the house to the warm mat and the cat sat on the mat by the dog"]  # fmt: skip
"""Three short documents whose answer ``max_tokens`` keeps, two long ones whose answer it cuts
off entirely."""


def test_an_empty_answer_is_refused_before_anything_is_written(
    tmp_path: Path, model_dirs: Any
) -> None:
    """Issue 49: every answer-anchored measurement refuses a document whose answer has no tokens
    (before, stored as all-zero effects and averaged in)."""
    model = str(model_dirs("llama"))
    task = text_task(tmp_path / "t", ANSWERED, answer="{{ body[:0] }}")
    for flags in (["--igrad"], ["--erase", "--erase-reference", "1"],
                  ["--skips", "--skip-split", "answer"]):  # fmt: skip
        line = refused(tmp_path, model, task, *flags)
        assert "task docs: document 0's answer is empty (no tokens of its own; 5 of 5" in line


def test_a_cut_answer_is_missing_noted_and_left_out_of_every_mean(
    tmp_path: Path, model_dirs: Any
) -> None:
    """Issue 49: where ``max_tokens`` cuts a document's answer off entirely, ``--igrad`` (before, a
    traceback: "upper bound and lower bound inconsistent with step sign") and ``--erase``
    (before, all-zero effects) store its values as null, the run says so in one note, and the
    analyses count and average the answered documents only."""
    from layerdiv.analyze.api import analyze

    task = text_task(tmp_path / "t", ANSWERED, answer=" and then the cat sat", max_tokens=14)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
                  "--igrad", "--igrad-steps", "2", "--erase", "--erase-reference", "2",
                  "--skips", "--skip-split", "answer")  # fmt: skip
    assert out.exit_code == 0, out.output
    assert "2 of 5 documents' answers lie wholly past max_tokens 14 (the first: document 3)" in (
        out.output
    )
    documents = Store(store).scan("documents").collect()
    cut = documents.filter(pl.col("answer_start") >= pl.col("n_tokens"))["doc"].to_list()
    assert cut == [3, 4]
    igrad, ends = stored(store)
    erasure = Store(store).scan("erasure").collect()
    for frame, column in ((igrad, "attribution"), (ends, "f_input"), (ends, "f_baseline"),
                          (erasure, "effect")):  # fmt: skip
        missing = frame.filter(pl.col(column).is_null())["doc"].unique().sort().to_list()
        assert missing == cut, column
        assert frame.filter(~pl.col("doc").is_in(cut))[column].null_count() == 0
    assert ends.filter(~pl.col("doc").is_in(cut))["f_input"].min() > 0  # type: ignore[operator]
    assert Store(store).scan("future_output").collect()["doc"].is_in(cut).sum() == 0
    results = analyze(store)
    for table in ("igrad_depth", "erasure_depth", "igrad_share", "erasure_layers"):
        assert results[table]["n_documents"].unique().to_list() == [3], table
    assert results["igrad_completeness"]["n_documents"].unique().to_list() == [3]
    assert sorted(results["igrad_maps"]["doc"].unique().to_list()) == [0, 1]
    per_doc = (erasure.filter(~pl.col("doc").is_in(cut), pl.col("layer") == 0)
               .join(documents, on="doc").filter(pl.col("pos") < pl.col("n_tokens") - 1)
               .group_by("doc").agg(pl.col("effect").cast(pl.Float64).mean()))  # fmt: skip
    layer0 = results["erasure_layers"].filter(pl.col("layer") == 0)["effect"][0]
    mean = float(per_doc["effect"].to_numpy().mean())
    assert abs(layer0 - mean) <= 1e-9 * max(abs(layer0), 1e-12)


def rule_run(
    tmp_path: Path, model: str, task: Path, rule: str, steps: int, limit: int = 2
) -> dict[str, Any]:
    """The first ``limit`` documents extracted with ``--igrad-rule rule --igrad-steps steps``
    (site ``block``): their IG maps (sorted by doc, block, pos), the completeness gap
    sum_t IG(l, t) - (f(x) - f(b)) over |f(x) - f(b)| per (doc, block), and the settings."""
    store = tmp_path / f"{rule}-{steps}"
    out = extract("--model", model, "--task", str(task), "--store", str(store), "--igrad",
                  "--igrad-rule", rule, "--igrad-steps", str(steps), "--limit",
                  str(limit))  # fmt: skip
    assert out.exit_code == 0, out.output
    igrad, ends = stored(store)
    sums = igrad.group_by("doc", "block").agg(pl.col("attribution").cast(pl.Float64).sum())
    ends = ends.join(sums, on=["doc", "block"]).sort("doc", "block")
    delta = (ends["f_input"].cast(pl.Float64) - ends["f_baseline"].cast(pl.Float64)).to_numpy()
    return {
        "ig": igrad.sort("doc", "block", "pos"),
        "rel_gap": np.abs(ends["attribution"].to_numpy() - delta) / np.abs(delta),
        "settings": Store(store).partitions[0].manifest.settings["igrad"],
    }


@pytest.mark.numerical
def test_the_gauss_rule_matches_a_fine_riemann_sum_with_a_far_smaller_gap(
    tmp_path: Path, model_dirs: Any
) -> None:
    """``--igrad-rule gauss`` (methods §13, beyond the paper): 16 Gauss-Legendre nodes give the
    integral that the left Riemann sum approaches at 512 steps, and at 8 steps its completeness
    gap is a small part of the Riemann sum's; the rule is recorded in the settings."""
    task = multihop_task(tmp_path / "task", **SHORT)
    model = str(model_dirs("llama"))
    gauss = rule_run(tmp_path, model, task, "gauss", 16)
    fine = rule_run(tmp_path, model, task, "riemann", 512)
    assert gauss["settings"] == {"igrad_sites": ["block"], "igrad_steps": 16,
                                 "igrad_rule": "gauss"}  # fmt: skip
    keys = ["doc", "block", "pos"]
    assert gauss["ig"].select(keys).equals(fine["ig"].select(keys))
    # within 1% of each map's largest |IG|: the Riemann sum's own error at m = 512, about
    # |g(1) - g(0)| / 2m, was seen up to 0.3% (a wrong weight or node is off by far more)
    for (doc, block), want in fine["ig"].group_by("doc", "block", maintain_order=True):
        got = gauss["ig"].filter((pl.col("doc") == doc) & (pl.col("block") == block))
        w = want["attribution"].to_numpy()
        assert_within(got["attribution"].to_numpy(), w, np.abs(w).max(), 1e-2,
                      what=f"doc {doc} block {block}")  # fmt: skip
    assert gauss["rel_gap"].max() < 1e-3
    # at m = 8: the Riemann sum's gap was seen at 8-13% of |f(x) - f(b)|, Gauss's below 0.1%
    g8, r8 = (rule_run(tmp_path, model, task, rule, 8) for rule in ("gauss", "riemann"))
    assert r8["rel_gap"].max() > GAP_LEVEL > 10 * g8["rel_gap"].max()
    assert g8["rel_gap"].max() < 0.02 * r8["rel_gap"].max()


def test_an_unknown_rule_is_refused(tmp_path: Path, model_dirs: Any) -> None:
    """On the command line by its choices; in settings given otherwise (the Python API) by the
    plan's check, in one line."""
    from click.testing import CliRunner

    from layerdiv.cli import main
    from layerdiv.measurements.igrad import IgradError, rule_of

    task = multihop_task(tmp_path / "task", **SHORT)
    out = CliRunner().invoke(main, ["extract", "--model", str(model_dirs("llama")), "--task",
                                    str(task), "--store", str(tmp_path / "s"), "--igrad",
                                    "--igrad-rule", "simpson"])  # fmt: skip
    assert out.exit_code == 2 and not (tmp_path / "s").exists()
    assert "Invalid value for '--igrad-rule': 'simpson' is not one of 'riemann', 'gauss'" in (
        out.output
    )
    with pytest.raises(IgradError, match=r"^--igrad-rule simpson: no such integration rule; "
                       r"give one of riemann, gauss \(default riemann\)$"):  # fmt: skip
        rule_of({"igrad_steps": 4, "igrad_rule": "simpson"})


def test_the_rules_points_and_weights() -> None:
    """riemann: alpha_k = k/m, w_k = 1/m (methods §13); gauss: alpha = 0 of weight 0 (f(b)),
    then m nodes in (0, 1) whose weights sum to 1 and integrate a polynomial of degree 2m - 1
    exactly; a settings mapping without a rule (a store written before the option) is
    riemann's."""
    from layerdiv.measurements.igrad import path_points, rule_of

    alphas, weights = path_points({"igrad_steps": 4})
    assert alphas.tolist() == [0, 0.25, 0.5, 0.75] and weights.tolist() == [0.25] * 4
    assert rule_of({"igrad_steps": 4}) == "riemann"
    alphas, weights = path_points({"igrad_steps": 4, "igrad_rule": "gauss"})
    assert alphas[0] == 0 and weights[0] == 0 and len(alphas) == 5
    assert np.all((alphas[1:] > 0) & (alphas[1:] < 1)) and np.all(np.diff(alphas) > 0)
    for degree in range(8):  # integral over [0, 1] of alpha^n = 1 / (n + 1)
        assert abs(float(weights @ alphas**degree) - 1 / (degree + 1)) < 1e-14
    assert abs(float(weights @ alphas**8) - 1 / 9) > 1e-6  # degree 2m: no longer exact


def test_a_store_from_before_the_rule_reads_and_extends_as_riemann(
    tmp_path: Path, model_dirs: Any
) -> None:
    """A partition whose igrad settings (manifest and parts) lack ``igrad_rule``, as every one
    written before ``--igrad-rule``: it reads, its completeness table says ``riemann``, and a
    rerun without the option extends it with the left Riemann sum (the same maps as a new
    store's), its settings unchanged."""
    import json

    import pyarrow.parquet as pq

    from layerdiv.analyze.api import analyze
    from layerdiv.measurements.registry import SETTINGS_KEY

    task = multihop_task(tmp_path / "task", **SHORT)
    old, new = tmp_path / "old", tmp_path / "new"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--igrad",
            "--igrad-steps", "3"]  # fmt: skip
    assert extract(*args, "--store", str(old), "--limit", "2").exit_code == 0
    (manifest,) = old.glob("manifests/**/manifest.json")
    data = json.loads(manifest.read_text())
    del data["settings"]["igrad"]["igrad_rule"]
    manifest.write_text(json.dumps(data))
    before = {"igrad_sites": ["block"], "igrad_steps": 3}
    for table in ("igrad", "igrad_ends"):
        for part in old.glob(f"{table}/**/*.parquet"):
            written = pq.read_table(part)
            metadata = {**written.schema.metadata, SETTINGS_KEY: json.dumps(before).encode()}
            pq.write_table(written.replace_schema_metadata(metadata), part,
                           write_page_checksum=True)  # fmt: skip
    assert Store(old).select()[0].manifest.settings["igrad"] == before
    assert analyze(old)["igrad_completeness"]["rule"].unique().to_list() == ["riemann"]
    more = extract(*args, "--store", str(old), "--limit", "3")
    assert more.exit_code == 0, more.output
    assert Store(old).select()[0].manifest.settings["igrad"] == before
    assert extract(*args, "--store", str(new), "--limit", "3").exit_code == 0
    got, want = (
        stored(old)[0].sort("doc", "block", "pos"),
        stored(new)[0].sort("doc", "block", "pos"),
    )
    assert got.select("doc", "block", "pos").equals(want.select("doc", "block", "pos"))
    w = want["attribution"].to_numpy()
    assert_within(got["attribution"].to_numpy(), w, np.abs(w).max())
