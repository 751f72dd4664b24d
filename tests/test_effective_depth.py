"""Effective depth (methods §15) against a reference written here from the raw tables with plain
loops, on a small made-up text store whose documents span chunks and read batches."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from layerdiv.analyze.analyses import effective_depth
from layerdiv.analyze.api import analyze
from layerdiv.analyze.synthetic import synthesize_text_store
from layerdiv.store import Store

BLOCKS = 24


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ed") / "store"
    synthesize_text_store(root, n_models=3, n_docs=9, n_tokens=12, blocks=BLOCKS, chunk=4,
                          lens=True, seed=5, progress=False)  # fmt: skip
    return root


def reference(store: Path, model: str) -> dict[str, Any]:
    """ED_cos, ED_KL and ED_top5 of one partition, loop by loop from the stored rows, and the
    margin of each past its rule (``<measure>_margin``)."""
    st = Store(store)
    blocks = st.scan("token_blocks").filter(pl.col("model") == model).collect()
    sums = {c: [0.0] * BLOCKS for c in ("attn", "mlp", "layer")}
    counts = {c: [0] * BLOCKS for c in ("attn", "mlp", "layer")}
    for r in blocks.iter_rows(named=True):
        hh, aa, mm, ha, hm, am = (float(r[k]) for k in ("hh", "aa", "mm", "ha", "hm", "am"))
        values = {
            "attn": ha / math.sqrt(aa * hh),
            "mlp": (hm + am) / math.sqrt(mm * (hh + 2 * ha + aa)),
            "layer": (ha + hm) / math.sqrt((aa + 2 * am + mm) * hh),
        }
        for k, v in values.items():
            sums[k][r["block"]] += v
            counts[k][r["block"]] += 1
    c = [sum(sums[k][b] / counts[k][b] for k in sums) / 3 for b in range(BLOCKS)]
    ed_cos = None
    for b in range(BLOCKS - 1):
        if c[b] < 0 and c[b + 1] >= 0:
            ed_cos = b

    lens = st.scan("token_lens").filter(pl.col("model") == model).collect()
    per_doc: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in lens.iter_rows(named=True):
        per_doc.setdefault((r["doc"], r["layer"]), []).append((r["kl"], r["top5_overlap"]))
    docs = sorted({d for d, _ in per_doc})
    kl, top5 = [], []
    for layer in range(BLOCKS):  # block inputs only
        means = [np.mean(per_doc[(d, layer)], axis=0) for d in docs]
        kl.append(sum(m[0] for m in means) / len(docs))
        top5.append(sum(m[1] for m in means) / len(docs))
    ed_kl = next((b for b in range(BLOCKS - 1) if kl[b] < 0.1 * max(kl)), None)
    ed_top5 = next((b for b in range(BLOCKS - 1) if top5[b] > 0.2), None)
    return {
        "cos": ed_cos,
        "kl": ed_kl,
        "top5": ed_top5,
        "cos_margin": None if ed_cos is None else min(-c[ed_cos], c[ed_cos + 1]),
        "kl_margin": None if ed_kl is None else 0.1 - kl[ed_kl] / max(kl),
        "top5_margin": None if ed_top5 is None else top5[ed_top5] - 0.2,
    }


def test_effective_depth_equals_the_reference(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # batches of 5 tokens: documents of 12 tokens are split over batches
    monkeypatch.setattr(effective_depth, "BATCH_TOKENS", 5)
    table = analyze(store).effective_depth
    assert table.height == 3 * 3
    found: dict[str, set[Any]] = {m: set() for m in effective_depth.MEASURES}
    for model in table["model"].unique():
        want = reference(store, model)
        rows = table.filter(pl.col("model") == model)
        for r in rows.iter_rows(named=True):
            assert r["ed"] == want[r["measure"]], (model, r["measure"])
            if want[f"{r['measure']}_margin"] is None:
                assert r["margin"] is None
            else:
                assert r["margin"] == pytest.approx(want[f"{r['measure']}_margin"], rel=1e-6)
                assert r["margin"] > 0
            found[r["measure"]].add(r["ed"])
            assert r["n_documents"] == 9 and r["n_blocks"] == BLOCKS
            if r["ed"] is None:
                assert r["ratio"] is None
                continue
            assert r["ratio"] == pytest.approx((r["ed"] + 1) / BLOCKS)
            assert r["ci_low"] <= r["ratio"] <= r["ci_high"]
            assert 0 < r["defined"] <= 1
    assert all(any(e is not None for e in eds) for eds in found.values()), found


def test_scalars_on_hand_made_profiles() -> None:
    c = np.array([[0.2, -0.1, 0.3, -0.2, 0.1, 0.5], [0.1, 0.2, 0.3, 0.4, -0.1, 0.2],
                  [-0.1, -0.2, np.nan, 0.1, -0.3, -0.1]])  # fmt: skip
    # last crossing (the last pair, blocks 4 -> 5, is allowed); none; NaN never crosses
    got = effective_depth.ed_cos(c)
    assert got[0] == 3 and got[1] == 4 and np.isnan(got[2])
    kl = np.array([[5.0, 4.0, 0.4, 0.1, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 0.05]])
    # the last block input is never the answer; the max is over every block input
    got = effective_depth.ed_kl(kl)
    assert got[0] == 2 and np.isnan(got[1])
    top5 = np.array([[0.0, 0.2, 0.4, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0, 0.2, 1.0]])
    got = effective_depth.ed_top5(top5)
    assert got[0] == 2 and np.isnan(got[1])


def test_report_draws_the_figure(store: Path, tmp_path: Path) -> None:
    from layerdiv.analyze.report import write_report

    results = analyze(store)
    write_report(results, tmp_path / "report", "paper", str(store), "md")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## Running text: effective depth" in text
    assert (tmp_path / "report" / "figures" / "effective_depth.png").is_file()


def test_a_store_of_several_revisions_draws_effective_depth_against_step(tmp_path: Path) -> None:
    """Three revisions of one model with their training steps: one row per (revision, measure)
    with its step, and the report's figure against the step; one revision alone draws none."""
    import dataclasses

    from layerdiv.analyze.report import write_report
    from layerdiv.analyze.synthetic import text_chunk, text_manifest, write_text_partition

    root = tmp_path / "store"
    steps = {"step-1000": 1000, "step-2000": 2000, "step-4000": 4000}
    for i, (revision, step) in enumerate(steps.items()):
        manifest = text_manifest("synth/ckpt", "fineweb", 6, BLOCKS, 12, 3, True, False)
        manifest = dataclasses.replace(manifest, revision=revision, step=step)
        rng = np.random.default_rng(i)
        chunks = ((s, 3, text_chunk(rng, range(s, s + 3), 12, BLOCKS, lens=True)) for s in (0, 3))
        write_text_partition(root, manifest, chunks)
    results = analyze(root)
    table = results["effective_depth"]
    by_revision = dict(zip(table["revision"], table["step"], strict=False))
    assert by_revision == steps and table.height == 3 * 3
    write_report(results, tmp_path / "report", "paper", str(root), "md")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "figures/effective_depth_steps.png" in text
    assert (tmp_path / "report" / "figures" / "effective_depth_steps.png").is_file()
    assert effective_depth.several_steps(table)
    assert not effective_depth.several_steps(table.filter(pl.col("revision") == "step-1000"))


def test_the_figure_keeps_a_panel_without_a_crossing_and_every_interval(tmp_path: Path) -> None:
    """A measure without a crossing for a model keeps that model on its axis (a cross marked
    "no crossing", not an empty 0-1 axis), and the ratio axis holds every point and interval
    (an upper end beyond 1 included, and the crosses at 0)."""
    from layerdiv.analyze import plots

    columns = ("model", "task", "measure", "lens", "ratio", "ci_low", "ci_high")
    rows = [("m", "t", "cos", None, 0.6, 0.4, 1.1), ("m", "t", "kl", "logit", None, None, None),
            ("m", "t", "top5", "logit", 0.1, 0.07, 0.2)]  # fmt: skip
    table = pl.DataFrame(rows, schema=dict.fromkeys(columns, pl.String), orient="row").cast(
        {c: pl.Float64 for c in columns[4:]}
    )
    fig = effective_depth.ratio_figure(table, {"m": "Model M"})
    cos, kl, _ = fig.panels
    (cross,) = kl.series
    assert cross.name == effective_depth.NO_CROSSING and list(cross.x) == ["Model M"]
    for panel in fig.panels:
        assert panel.yrange is not None
        low, high = panel.yrange
        assert low < 0 < 1.1 < high  # the crosses at 0 and the interval's end at 1.1 inside
    assert [s.name for s in cos.series] == ["t"]
    path = plots.to_matplotlib(fig, tmp_path / "ed.png")
    assert path.stat().st_size > 0


def test_verdicts_count_documents_and_say_when_the_interval_is_of_few_resamples() -> None:
    def row(
        measure: str,
        ed: int | None,
        defined: float,
        low: float | None,
        high: float | None,
        margin: float | None,
        docs: int = 9,
    ) -> dict[str, Any]:
        return {"model": "m", "revision": "main", "task": "t", "measure": measure,
                "lens": None if measure == "cos" else "logit", "n_blocks": 10,
                "n_documents": docs, "ed": ed,
                "ratio": None if ed is None else (ed + 1) / 10, "ci_low": low, "ci_high": high,
                "defined": defined, "margin": margin}  # fmt: skip

    rows = [row("cos", 5, 1.0, 0.5, 0.7, 0.05), row("kl", None, 0.1, None, None, None),
            row("top5", 0, 0.6, 0.1, 0.2, 0.004)]  # fmt: skip
    table = pl.DataFrame(rows)
    text = effective_depth.ed_verdicts(table, pl.DataFrame(), {})
    lines = text.splitlines()
    assert lines[0].startswith("- **Verdict: does not agree.** m, t, ED_cos")
    assert "n = 9 documents" in lines[0] and "(margin 0.05 past the rule)" in lines[0]
    assert lines[1].startswith("- **Verdict: cannot tell.** m, t, ED_kl (logit lens)")
    assert "undefined" in lines[1]
    assert lines[2].startswith("- **Verdict: cannot tell.** m, t, ED_top5")
    assert "margin 0.004 past the rule, thin" in lines[2]
    assert "only 60% of the resamples" in lines[2]
    few = pl.DataFrame([row("cos", 2, 1.0, 0.2, 0.4, 0.05, docs=4)])
    assert "**Verdict: too few to tell.**" in effective_depth.ed_verdicts(few, pl.DataFrame(), {})
