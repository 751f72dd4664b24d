"""The analyses of integrated gradients (methods §13) and residual erasure (methods §14) against
plain numpy loops over the made-up values a synthetic text store was written from: shares, depth
scores (methods §10) with their intervals, completeness gaps, the effect against the distance to
the answer; the sentence on too few Riemann steps exactly when a gap exceeds 5%; the figures; a
choice task's erasure beside a text task's in one store."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import numpy as np
import polars as pl
import pyarrow as pa
import pytest

from layerdiv.analyze.api import analyze
from layerdiv.analyze.synthetic import (
    random_partition,
    text_chunk,
    text_manifest,
    write_partition,
    write_text_partition,
)
from layerdiv.measurements import Measurement, Setting, register, registered, unregister
from layerdiv.measurements.erase import analysis as erasure
from layerdiv.measurements.igrad import analysis as igrad
from layerdiv.schemas import ERASURE, IGRAD, IGRAD_ENDS, SCHEMA_VERSION, SUBLAYERS
from tests.conftest import tables_as_version

BLOCKS = 4
TOKENS = 12
DOCS = 7
CHUNK = 4
STEPS = 16
MODEL = "synth/attrib"
DEEPER = "synth/deeper"


def _setting(option: str, name: str, default: Any) -> Setting:
    return Setting(name, click.Option([option, name], default=None), default)


STAND_INS = (
    Measurement(
        name="igrad",
        flag="--igrad",
        help="Integrated gradients per block and position (stands in for the measurement).",
        tables={"text": ("igrad", "igrad_ends")},
        settings=(
            _setting("--igrad-site", "igrad_sites", ("block",)),
            _setting("--igrad-steps", "igrad_steps", 256),
        ),
    ),
    Measurement(
        name="erase",
        flag="--erase",
        help="Residual erasure (stands in for the measurement).",
        tables={"text": ("erasure",), "choice": ("erasure",)},
        settings=(_setting("--erase-reference", "erase_reference", 10),),
    ),
)
"""The measurements that write the tables read here, declared by name, flag and settings only
(``extract --igrad``'s and ``--erase``'s), used where the package does not register them."""


@pytest.fixture(scope="module", autouse=True)
def measurements() -> Iterator[None]:
    known = {m.name for m in registered()}
    mine = [m for m in STAND_INS if m.name not in known]
    for m in mine:
        register(m)
    yield
    for m in mine:
        unregister(m.name)


def made_up(seed: int, gap: float, blocks: int = BLOCKS) -> dict[str, np.ndarray]:
    """The made-up maps of :data:`DOCS` documents: ``start`` s per document; ``ig`` (D, 3, L, T)
    zero where methods §13 makes it zero (the last block before s-1, the last position);
    ``f_input``, ``f_baseline`` (D, 3, L) with f(x) - f(b) = sum_t IG (1 + ``gap`` at site attn,
    block 1, else a gap of at most 1%), in [0, 3] (sums of probabilities over the answer's 3 to 6
    tokens); ``effect`` (D, L + 1, T) in [0, 1.4] (an L2 distance of two distributions), zero at
    the last position and, at state L, rounding noise below 1e-7 before s-1."""
    rng = np.random.default_rng(seed)
    start = 6 + np.arange(DOCS) % 4
    pos = np.arange(TOKENS)
    ig = rng.normal(0, 1, (DOCS, 3, blocks, TOKENS)) * (1 + np.arange(blocks))[:, None]
    ig[:, :, :, 0] *= 20  # position 0: large, as the attention sink's
    ig[..., -1] = 0.0
    ig[:, :, -1, :] *= (pos[None, :] >= start[:, None] - 1)[:, None, :]
    total = ig.sum(-1)
    total = np.where(np.abs(total) < 0.5, 0.5, total)
    ig[..., 1] += total - ig.sum(-1)  # sum_t IG away from 0, so gaps are relative to it
    delta = ig.sum(-1) * (1 + rng.uniform(-0.01, 0.01, total.shape))
    delta[:, SUBLAYERS.index("attn"), 1] *= 1 + gap
    scale = 1 / np.abs(delta).max()  # |f(x) - f(b)| <= 1
    ig, delta = ig * scale, delta * scale
    f_baseline = 1.5 + rng.uniform(0, 0.3, total.shape)
    effect = (
        rng.exponential(0.05, (DOCS, blocks + 1, TOKENS)) * (1 + np.arange(blocks + 1))[:, None]
    )
    effect = np.minimum(effect, 1.4)
    effect[..., -1] = 0.0
    before = pos[None, :] < start[:, None] - 1
    # before s-1 the last state's erasure is 0 but for rounding (another batch shape than the
    # clean pass's)
    effect[:, -1, :] = np.where(before, rng.uniform(0, 1e-7, (DOCS, TOKENS)), effect[:, -1, :])
    return {
        "start": start,
        "ig": ig.astype(np.float32).astype(np.float64),
        "f_input": (f_baseline + delta).astype(np.float32).astype(np.float64),
        "f_baseline": f_baseline.astype(np.float32).astype(np.float64),
        "effect": effect.astype(np.float32).astype(np.float64),
    }


def optional_tables(values: dict[str, np.ndarray], docs: range) -> dict[str, pa.Table]:
    """The ``igrad``, ``igrad_ends`` and ``erasure`` rows of ``docs``."""
    blocks = values["ig"].shape[2]
    d, s, b, t = np.meshgrid(docs, range(3), range(blocks), range(TOKENS), indexing="ij")
    sub = pa.DictionaryArray.from_arrays(pa.array(s.ravel(), pa.int8()), list(SUBLAYERS))
    ig = pa.table(
        [d.ravel().astype(np.int32), sub, b.ravel().astype(np.int16), t.ravel().astype(np.int32),
         values["ig"][docs.start : docs.stop].ravel().astype(np.float32)],
        schema=IGRAD,
    )  # fmt: skip
    d, s, b = np.meshgrid(docs, range(3), range(blocks), indexing="ij")
    sub = pa.DictionaryArray.from_arrays(pa.array(s.ravel(), pa.int8()), list(SUBLAYERS))
    ends = pa.table(
        [d.ravel().astype(np.int32), sub, b.ravel().astype(np.int16),
         values["f_input"][docs.start : docs.stop].ravel().astype(np.float32),
         values["f_baseline"][docs.start : docs.stop].ravel().astype(np.float32)],
        schema=IGRAD_ENDS,
    )  # fmt: skip
    d, layer, t = np.meshgrid(docs, range(blocks + 1), range(TOKENS), indexing="ij")
    erasure = pa.table(
        [d.ravel().astype(np.int32), layer.ravel().astype(np.int16), t.ravel().astype(np.int32),
         values["effect"][docs.start : docs.stop].ravel().astype(np.float32)],
        schema=ERASURE,
    )  # fmt: skip
    return {"igrad": ig, "igrad_ends": ends, "erasure": erasure}


def answered(model: str, blocks: int, settings: dict[str, dict[str, Any]], task: str = "qa") -> Any:
    """The manifest of a made-up text partition of a task that names an answer."""
    manifest = text_manifest(model, task, DOCS, blocks, TOKENS, CHUNK)
    spec = {**manifest.task_spec, "answer": " {{ answer }}"}
    return dataclasses.replace(manifest, settings=settings, task_spec=spec)


def answers(tables: dict[str, pa.Table], starts: np.ndarray) -> dict[str, pa.Table]:
    """``tables`` with their documents' answer starts (the first of ``starts``) stored."""
    documents = tables["documents"]
    column = pa.array(starts[: documents.num_rows], pa.int32())
    i = documents.schema.get_field_index("answer_start")
    return {**tables, "documents": documents.set_column(i, "answer_start", column)}


def write_store(
    root: Path,
    seed: int,
    gap: float,
    model: str = MODEL,
    blocks: int = BLOCKS,
    task: str = "qa",
    erase: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """A text partition of ``model`` with ``blocks`` blocks holding the made-up maps
    (:func:`made_up`), its erasure extracted with the settings ``erase`` (default: those of a
    partition extracted before the reference positions were recorded); returns them."""
    values = made_up(seed, gap, blocks)
    settings: dict[str, dict[str, Any]] = {
        "igrad": {"igrad_sites": list(SUBLAYERS), "igrad_steps": STEPS},
        "erase": erase or {"erase_reference": 10},
    }
    manifest = answered(model, blocks, settings, task)
    rng = np.random.default_rng(seed)
    chunks = (
        (s, len(docs), {**answers(text_chunk(rng, docs, TOKENS, blocks), values["start"][s:]),
                        **optional_tables(values, docs)})
        for s in range(0, DOCS, CHUNK)
        for docs in [range(s, min(DOCS, s + CHUNK))]
    )  # fmt: skip
    write_text_partition(root, manifest, chunks)
    return values


@pytest.fixture(scope="module")
def small_gap(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("attrib") / "store"
    return root, write_store(root, 3, 0.0)


@pytest.fixture(scope="module")
def large_gap(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    root = tmp_path_factory.mktemp("attrib_gap") / "store"
    write_store(root, 5, 0.0, DEEPER, 6)  # a deeper model whose gaps are all below 1%
    return root, write_store(root, 4, 0.2)


def close(got: Any, want: float, scale: float = 1.0) -> bool:
    """Within a float32 budget of ``scale`` (the values were stored as float32)."""
    return abs(float(got) - want) <= 1e-5 * max(scale, abs(want))


def score_of(v: list[float]) -> float:
    """sum_l l v(l) / sum_l v(l) (methods §10), by a loop."""
    return sum(i * x for i, x in enumerate(v)) / sum(v)


def interval(samples: list[float]) -> tuple[float, float]:
    """The 2.5 and 97.5 percentiles of the defined ``samples``."""
    kept = [s for s in samples if np.isfinite(s)]
    return float(np.percentile(kept, 2.5)), float(np.percentile(kept, 97.5))


def mean_interval(scores: list[float]) -> tuple[float, float]:
    """The bootstrap interval of a mean: resamples of the documents drawn as the package seeds
    them (``integers`` of a generator seeded 0, 1,000 resamples)."""
    rng = np.random.default_rng(0)
    picks = rng.integers(0, len(scores), (1000, len(scores)))
    return interval([sum(scores[i] for i in row) / len(row) for row in picks])


def test_igrad_numbers(small_gap: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, v = small_gap
    results = analyze(root)
    share = results["igrad_share"]
    depth = results["igrad_depth"]
    gaps = results["igrad_completeness"]
    assert share.height == 3 * BLOCKS and depth.height == 3 and gaps.height == 3 * BLOCKS
    for s, site in enumerate(SUBLAYERS):
        profiles = [[sum(abs(x) for x in v["ig"][d, s, b]) for b in range(BLOCKS)]
                    for d in range(DOCS)]  # fmt: skip
        for b in range(BLOCKS):
            want = sum(p[b] / sum(p) for p in profiles) / DOCS
            row = share.filter(pl.col("sublayer") == site, pl.col("block") == b).row(0, named=True)
            assert close(row["share"], want) and row["relative_depth"] == (b + 1) / BLOCKS
            g = [v["ig"][d, s, b].sum() - (v["f_input"][d, s, b] - v["f_baseline"][d, s, b])
                 for d in range(DOCS)]  # fmt: skip
            deltas = [abs(v["f_input"][d, s, b] - v["f_baseline"][d, s, b]) for d in range(DOCS)]
            row = gaps.filter(pl.col("sublayer") == site, pl.col("block") == b).row(0, named=True)
            scale = max(deltas)
            assert close(row["gap_mean"], sum(g) / DOCS, scale)
            assert close(row["abs_gap_mean"], sum(abs(x) for x in g) / DOCS, scale)
            assert close(row["delta_mean"], sum(deltas) / DOCS, scale)
            assert close(row["rel_gap"], sum(abs(x) for x in g) / sum(deltas), 1.0)
            assert row["steps"] == STEPS and row["n_documents"] == DOCS
        scores = [score_of(p) for p in profiles]
        row = depth.filter(pl.col("sublayer") == site).row(0, named=True)
        assert close(row["score"], sum(scores) / DOCS, BLOCKS)
        low, high = mean_interval(scores)
        assert close(row["ci_low"], low, BLOCKS) and close(row["ci_high"], high, BLOCKS)
        assert close(row["relative"], (sum(scores) / DOCS + 1) / BLOCKS)


def test_erasure_numbers(small_gap: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, v = small_gap
    results = analyze(root)
    effect = v["effect"]
    # methods §14: the last position is never computed; the profile sums positions 0..T-2
    profiles = [[effect[d, layer, : TOKENS - 1].sum() for layer in range(BLOCKS + 1)]
                for d in range(DOCS)]  # fmt: skip
    layers = results["erasure_layers"].sort("layer")
    for layer in range(BLOCKS + 1):
        want = sum(effect[d, layer, : TOKENS - 1].mean() for d in range(DOCS)) / DOCS
        assert close(layers["effect"][layer], want)
    scores = [score_of(p) for p in profiles]
    row = results["erasure_depth"].row(0, named=True)
    assert close(row["score"], sum(scores) / DOCS, BLOCKS)
    low, high = mean_interval(scores)
    assert close(row["ci_low"], low, BLOCKS) and close(row["ci_high"], high, BLOCKS)
    assert close(row["relative"], sum(scores) / DOCS / BLOCKS)

    # the effect against d = s - t: per document and position the mean over states
    e = {(d, v["start"][d] - t): effect[d, :, t].mean() for d in range(DOCS)
         for t in range(TOKENS - 1)}  # fmt: skip
    table = results["erasure_distance"].sort("distance")
    assert table["distance"].to_list() == sorted({k for _, k in e})
    weights = np.random.default_rng(0).multinomial(DOCS, np.full(DOCS, 1 / DOCS), size=1000)
    for r in table.iter_rows(named=True):
        held = [d for d in range(DOCS) if (d, r["distance"]) in e]
        assert r["n_documents"] == len(held)
        assert close(r["effect"], sum(e[d, r["distance"]] for d in held) / len(held))
        if len(held) < 5:
            assert r["ci_low"] is None and r["ci_high"] is None
            continue
        samples = [
            sum(w[d] * e[d, r["distance"]] for d in held) / sum(w[d] for d in held)
            if sum(w[d] for d in held)
            else np.nan
            for w in weights
        ]
        low, high = interval(samples)
        assert close(r["ci_low"], low) and close(r["ci_high"], high)


def test_answer_start_from_the_documents(small_gap: tuple[Path, dict[str, np.ndarray]]) -> None:
    root, v = small_gap
    results = analyze(root)
    for table in ("igrad_maps", "erasure_maps"):
        starts = results[table].group_by("doc").agg(pl.col("answer_start").first()).sort("doc")
        assert starts["answer_start"].to_list() == v["start"][: len(starts)].tolist()


def test_too_few_steps_said_when_and_only_when_a_gap_exceeds_5_percent(
    small_gap: tuple[Path, dict[str, np.ndarray]],
    large_gap: tuple[Path, dict[str, np.ndarray]],
    tmp_path: Path,
) -> None:
    from layerdiv.analyze.report import write_report

    for (root, v), over in ((small_gap, False), (large_gap, True)):
        results = analyze(root)
        gaps = results["igrad_completeness"].filter(pl.col("model") == "synth--attrib")
        assert bool((gaps["rel_gap"].to_numpy() > igrad.GAP_LEVEL).any()) == over
        out = tmp_path / ("over" if over else "under")
        write_report(results, out, "paper", str(root), "md,html")
        text = (out / "report.md").read_text()
        assert "## Running text: integrated gradients per block and token" in text
        assert text.count(f"M = {STEPS} steps is too small") == over  # once, for synth/attrib
        page = (out / "report.html").read_text()
        assert page.count(f"M = {STEPS} steps is too small") == over
        assert "too small for synth/deeper" not in text
        section = text[text.index("## Running text: integrated gradients") :].split("\n## ")[0]
        # a site over the gap gets no verdict, only why; the verdicts count documents
        assert section.count("**No verdict: unreliable.**") == over
        assert ("synth/attrib, qa, attn: the completeness gap exceeds 5%" in section) == over
        assert f"(n = {DOCS} documents)" in section and "needed" not in section
        if over:
            # the worst block: the one made up with a gap of 20%, the only one over 5%
            g = [v["ig"][d, 1, 1].sum() - (v["f_input"][d, 1, 1] - v["f_baseline"][d, 1, 1])
                 for d in range(DOCS)]  # fmt: skip
            deltas = [abs(v["f_input"][d, 1, 1] - v["f_baseline"][d, 1, 1]) for d in range(DOCS)]
            worst = sum(abs(x) for x in g) / sum(deltas)
            assert (
                f"at 1 of {3 * BLOCKS} (site, block) pairs, the worst at block 1 of site attn "
                f"({worst:.1%})" in text
            )
            # the advice names the command that does it: the redo of igrad alone; the store
            # records no rule (extracted before --igrad-rule): the Riemann sum's, which the
            # sentence, the gap table and the table name, with the Gauss rule as the other way
            assert f"--redo igrad --igrad-steps {2 * STEPS}`" in text
            assert "on qa (riemann rule)" in text and f"| {STEPS} (riemann) |" in text
            assert f"--redo igrad --igrad-rule gauss --igrad-steps {STEPS}`" in text
            assert "or with `--igrad-rule gauss`" in section
        assert results["igrad_completeness"]["rule"].unique().to_list() == ["riemann"]


def test_the_advice_under_the_gauss_rule_is_more_of_its_nodes() -> None:
    """A partition extracted with ``--igrad-rule gauss`` whose gap exceeds 5%: the sentence and
    the unreliable note name the rule and ask for more of its nodes, not for the rule again."""
    table = pl.DataFrame(
        {
            "model": ["m"] * 2,
            "revision": ["main"] * 2,
            "task": ["qa"] * 2,
            "sublayer": ["block"] * 2,
            "block": [0, 1],
            "steps": [8, 8],
            "rule": ["gauss"] * 2,
            "rel_gap": [0.01, 0.3],
        }
    )
    (line,) = igrad.too_few_steps(table, {})
    assert "M = 8 steps is too small for m on qa (gauss rule)" in line
    assert line.endswith("--redo igrad --igrad-rule gauss --igrad-steps 16`.")
    (note,) = igrad.unreliable(table).values()
    assert "(up to 30%, M = 8, gauss)" in note and note.endswith("a larger `--igrad-steps`")


def test_figures_render(small_gap: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    from layerdiv.analyze.report import write_report

    root, _ = small_gap
    results = analyze(root)
    write_report(results, tmp_path / "report", "paper", str(root), "md,html")
    figures = tmp_path / "report" / "figures"
    for name in ("igrad_share", "igrad_maps", "erasure_profile", "erasure_maps"):
        assert (figures / f"{name}.png").stat().st_size > 0
    page = (tmp_path / "report" / "report.html").read_text()
    tokens = results["igrad_maps"].filter(pl.col("doc") == 0, pl.col("block") == 0)
    first = tokens.filter(pl.col("sublayer") == "block").sort("pos")
    for p, t in zip(first["pos"], first["token"], strict=True):
        assert f"{p}:{t}" in page


def test_a_partition_without_the_maps_is_named_with_the_option_that_adds_them(
    tmp_path: Path,
) -> None:
    from layerdiv.analyze.synthetic import synthesize_text_store

    root = tmp_path / "store"
    # a task without an answer (neither measurement applies: no note), and one with an answer
    synthesize_text_store(root, 1, 6, TOKENS, BLOCKS, chunk=4, progress=False)
    rng = np.random.default_rng(0)
    chunks = [(0, DOCS, text_chunk(rng, range(DOCS), TOKENS, BLOCKS))]
    write_text_partition(root, answered(MODEL, BLOCKS, {}), chunks)
    results = analyze(root)
    assert "igrad" not in results.analyses and "erasure" not in results.analyses
    for title, flag in ((igrad.TITLE, "--igrad"), (erasure.TITLE, "--erase")):
        line = (
            f"{title}: not extracted for synth--attrib/main/qa (`layerdiv extract {flag}` adds it)."
        )
        assert line in results.notes
        assert not [n for n in results.notes if n.startswith(title) and "fineweb" in n]


def test_a_table_no_measurement_writes_gives_no_note(tmp_path: Path) -> None:
    from layerdiv.analyze.registry import not_extracted
    from layerdiv.analyze.synthetic import synthesize_text_store
    from layerdiv.store import Store

    synthesize_text_store(tmp_path, 1, 2, TOKENS, BLOCKS, chunk=4, progress=False)
    parts = Store(tmp_path).select()
    assert parts and not_extracted(parts, "igrad", "x").startswith("x: not extracted for")
    assert not_extracted(parts, "not_a_table", "x") == ""


def test_the_number_of_documents_mapped_is_an_option(
    small_gap: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    from layerdiv.analyze.report import write_report
    from layerdiv.errors import LayerdivError

    root, _ = small_gap
    assert analyze(root)["igrad_maps"]["doc"].unique().to_list() == [0, 1]  # the default, 2
    one = analyze(root, options={"attribution_documents": 1})
    for table in ("igrad_maps", "erasure_maps"):
        assert one[table]["doc"].unique().to_list() == [0]
    none = analyze(root, options={"attribution_documents": 0})
    assert none["igrad_maps"].height == 0 and none["erasure_maps"].height == 0
    write_report(none, tmp_path / "report", "paper", str(root), "md")
    text = (tmp_path / "report" / "report.md").read_text()
    assert "figures/igrad_share.png" in text and "igrad_maps.png" not in text
    with pytest.raises(LayerdivError, match="attribution_documents=-1: give a number"):
        analyze(root, options={"attribution_documents": -1})


def test_token_labels_spell_the_vocabulary() -> None:
    """A map's axis shows each token as the text it stands for (its space mark drawn as a
    visible space), or its id where the store has no spelling."""
    from layerdiv.analyze.analyses.attribution import token_labels

    tokens = pl.DataFrame(
        {"pos": [0, 1, 2, 3], "token": [5, 6, 7, 8], "piece": ["Hello", "Ġworld", "Ċ", None]}
    )
    assert token_labels(tokens) == ["0:Hello", "1:␣world", "2:\\n", "3:8"]


HOSTILE = {
    "<a href='https://example.com'>x</a>": "<a␣href='https://example.com'>x</a>",
    "<span style='color:red'>": "<span␣style='color:red'>",
    "<br>": "<br>",
    "<b>": "<b>",
    "$$": "$$",
    "$x$": "$x$",
    "ðŁĺĢ": "\U0001f600",  # byte-level spelling of an emoji: the emoji
    "ðŁĺ": "\\xf0\\x9f\\x98",  # part of one: its bytes
    "Ã©": "é",
    "é": "é",  # a vocabulary of other spelling: as it is
    "\u202eevil": "\\u202eevil",  # the bidi override made visible
    "a\u200bb": "a\\u200bb",
    "\x07": "\\u0007",
    "▁word": "␣word",
}
"""Vocabulary entries (as ``tokens.piece`` holds them) and the text their labels show."""


def hostile_tokens() -> pl.DataFrame:
    return pl.DataFrame(
        {"pos": range(len(HOSTILE)), "token": range(len(HOSTILE)), "piece": list(HOSTILE)}
    )


def test_token_labels_are_text() -> None:
    """Issue 49: byte-level spellings decoded, control and bidi characters visible, markup and
    dollars kept as the characters they are (each renderer escapes its own markup)."""
    from layerdiv.analyze.analyses.attribution import token_labels

    want = [f"{i}:{shown}" for i, shown in enumerate(HOSTILE.values())]
    assert token_labels(hostile_tokens()) == want


def hostile_map() -> tuple[Any, list[str]]:
    """A map figure whose axis holds :data:`HOSTILE`'s labels, and those labels."""
    from layerdiv.analyze.analyses.attribution import map_figure, token_labels

    tokens = hostile_tokens()
    rows = pl.DataFrame(
        {"model": "m", "revision": "main", "task": "t", "doc": 0, "layer": [0, 1]}
    ).join(tokens, how="cross")
    rows = rows.with_columns(effect=pl.col("pos").cast(pl.Float64) + pl.col("layer"))
    figure = map_figure("maps", rows, {}, row="layer", value="effect", colorbar="e",
                        signed=False)  # fmt: skip
    return figure, token_labels(tokens)


def test_token_labels_render_as_text_in_both_renderers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49: in report.html's Plotly figure a label is HTML-escaped (no live link, style,
    break or bold); in the PNG, drawn without mathtext (``$$`` does not raise, ``$x$`` is not an
    italic x)."""
    import html

    from matplotlib.figure import Figure as MplFigure

    from layerdiv.analyze import plots
    from layerdiv.analyze.html import render_page

    figure, labels = hostile_map()
    data = plots.to_plotly(figure)["data"][0]
    assert data["x"] == [html.escape(label, quote=False) for label in labels]
    assert not any("<" in x or ">" in x for x in data["x"])
    page = render_page("![maps](figures/maps.png)", {"maps.png": plots.to_plotly(figure)}, None)
    assert 'data-figure="maps.png"' in page and '"0:&lt;a' in page and '"1:&lt;span' in page
    assert '"0:<a' not in page and '"1:<span' not in page and '"3:<b>' not in page
    drawn: list[Any] = []
    save = MplFigure.savefig

    def keep(fig: Any, *args: Any, **kwargs: Any) -> Any:
        drawn.append(fig)
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(MplFigure, "savefig", keep)
    plots.to_matplotlib(figure, tmp_path / "maps.png")  # a "$$" label raised here
    (ax, *_) = drawn[0].axes
    ticks = ax.get_xticklabels()
    assert [t.get_text() for t in ticks] == labels
    assert not any(t.get_parse_math() for t in ticks)


PROMPT_TOKENS = 100
"""The prompt tokens of each instance of a synthetic choice partition (``write_partition``'s)."""


def write_choice(root: Path, seed: int) -> np.ndarray:
    """A choice partition (task ``pick``) of :data:`DOCS` instances holding made-up erasure
    effects (D, L + 1, T), the last state's 0 before the readout position T - 1; returns them."""
    rng = np.random.default_rng(seed)
    logits, gold, rms, kinds = random_partition(rng, DOCS, BLOCKS, 2)
    effect = rng.exponential(0.05, (DOCS, BLOCKS + 1, PROMPT_TOKENS))
    effect = np.minimum(effect * (1 + np.arange(BLOCKS + 1))[:, None], 1.4)
    effect[:, -1, :-1] = 0.0  # h_L reaches the readout at T - 1 alone
    write_partition(root, MODEL, "pick", logits, gold, kinds, rms, chunk=CHUNK,
                    optional={"erasure": effect})  # fmt: skip
    return effect.astype(np.float32).astype(np.float64)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    """A store of a text partition and a choice partition, both holding erasure."""
    root = tmp_path_factory.mktemp("mixed") / "store"
    write_store(root, 3, 0.0)
    return root, write_choice(root, 6)


def test_choice_erasure_numbers(mixed: tuple[Path, np.ndarray]) -> None:
    """Every position counts, the readout position T - 1 included; distances from it."""
    root, effect = mixed
    results = analyze(root)
    per_state = effect.mean(axis=2)  # (D, L + 1): each instance's mean over positions
    layers = results["choice_erasure_layers"].sort("layer")
    assert layers["layer"].to_list() == list(range(BLOCKS + 1))
    for layer in range(BLOCKS + 1):
        assert close(layers["effect"][layer], per_state[:, layer].mean())
        low, high = mean_interval(list(per_state[:, layer]))
        assert close(layers["ci_low"][layer], low) and close(layers["ci_high"][layer], high)
        assert layers["n_documents"][layer] == DOCS
    scores = [score_of(list(p)) for p in effect.sum(axis=2)]
    row = results["choice_erasure_depth"].row(0, named=True)
    assert close(row["score"], sum(scores) / DOCS, BLOCKS)
    low, high = mean_interval(scores)
    assert close(row["ci_low"], low, BLOCKS) and close(row["ci_high"], high, BLOCKS)
    table = results["choice_erasure_distance"].sort("distance")
    assert table["distance"].to_list() == list(range(PROMPT_TOKENS))
    per_token = effect.mean(axis=1)  # (D, T): the mean over states
    for r in table.iter_rows(named=True):
        t = PROMPT_TOKENS - 1 - r["distance"]
        assert r["n_documents"] == DOCS and close(r["effect"], per_token[:, t].mean())
    maps = results["choice_erasure_maps"]
    assert maps["doc"].unique().sort().to_list() == [0, 1]
    assert maps.height == 2 * (BLOCKS + 1) * PROMPT_TOKENS
    # each kind's tables hold its own partitions
    assert results["erasure_depth"]["task"].to_list() == ["qa"]
    assert results["choice_erasure_depth"]["task"].to_list() == ["pick"]


def test_choice_maps_label_positions_with_the_stored_prompt_tokens(
    mixed: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    """Issue 48 item 9: a choice partition's maps label each position with its prompt token
    (``instances.pieces``); a store without them, by position alone."""
    import shutil

    import pyarrow.parquet as pq

    from layerdiv.analyze.analyses.attribution import map_figure

    root = tmp_path / "store"
    shutil.copytree(mixed[0], root)
    for part in root.glob("instances/**/*.parquet"):
        data = pq.read_table(part)
        units = zip(data["instance"].to_pylist(), data["n_tokens"].to_pylist(), strict=True)
        pieces = [[f"Ġw{i}_{p}" for p in range(n)] for i, n in units]
        column = data.schema.get_field_index("pieces")
        pq.write_table(
            data.set_column(column, "pieces", pa.array(pieces, pa.list_(pa.string()))), part
        )
    maps = analyze(root)["choice_erasure_maps"]
    first = maps.filter(pl.col("doc") == 0, pl.col("layer") == 0).sort("pos")
    assert first["piece"].to_list() == [f"Ġw0_{p}" for p in range(PROMPT_TOKENS)]
    figure = map_figure("t", maps, {}, "layer", "effect", "effect", False)
    assert figure.panels[0].heatmap is not None
    assert figure.panels[0].heatmap.x[:2] == ["0:␣w0_0", "1:␣w0_1"]
    plain = analyze(mixed[0])["choice_erasure_maps"]
    assert "piece" not in plain.columns  # no pieces stored: by position alone
    tables_as_version(root, 9)  # a store of the previous version: no pieces column at all
    for path in root.glob("manifests/**/manifest.json"):
        path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 9}))
    old = analyze(root)["choice_erasure_maps"]
    assert "piece" not in old.columns and old.height == plain.height


def test_a_store_mixing_text_and_choice_erasure_reports_both(
    mixed: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    from layerdiv.analyze.report import write_report

    root, _ = mixed
    results = analyze(root)
    write_report(results, tmp_path / "report", "paper", str(root), "md,html")
    text = (tmp_path / "report" / "report.md").read_text()
    for title, prefix in ((erasure.TITLE, "erasure"), (erasure.CHOICE_TITLE, "choice_erasure")):
        assert f"## {title}" in text
        section = text[text.index(f"## {title}") :]
        assert f"figures/{prefix}_profile.png" in section.split("\n## ")[0]
        for figure in ("profile", "maps"):
            png = tmp_path / "report" / "figures" / f"{prefix}_{figure}.png"
            assert png.stat().st_size > 10_000


def test_an_erasure_state_outside_0_to_L_is_refused_in_one_line(tmp_path: Path) -> None:
    """Issue 49: an ``erasure`` row at state 77 of a 4-block model (a damaged part) is refused
    when the store opens, in one line naming the column, its range and the command that mends
    it, rather than an IndexError in the analysis."""
    import pyarrow.parquet as pq

    from layerdiv.store import StoreError

    root = tmp_path / "store"
    write_store(root, 3, 0.0)
    part = sorted(root.rglob("*erasure*/**/*.parquet"))[0]
    table = pq.read_table(part)
    layer = table["layer"].to_numpy().copy()
    layer[3] = 77
    columns = [pa.array(layer) if n == "layer" else table[n] for n in table.schema.names]
    pq.write_table(pa.Table.from_arrays(columns, schema=table.schema), part)
    with pytest.raises(StoreError, match=r"layer takes 0\.\.77, outside the 0\.\.4 .*--overwrite"):
        analyze(root)


def test_a_version_7_store_with_non_nullable_maps_still_reads(tmp_path: Path) -> None:
    """Schema version 8 made the maps' values nullable (a document without a measurable
    answer); a store version 7 wrote (every column non-nullable) reads and analyses as before,
    and a version 7 part under a version 8 manifest is refused as of another schema."""

    import pyarrow.parquet as pq

    from layerdiv.measurements import tables_of
    from layerdiv.store import Store, StoreError

    root = tmp_path / "store"
    write_store(root, 3, 0.0)
    want = analyze(root)
    for table in ("igrad", "igrad_ends", "erasure"):
        for part in root.glob(f"{table}/**/*.parquet"):
            data = pq.read_table(part)
            old = tables_of(7)[table].with_metadata(data.schema.metadata)
            assert not any(f.nullable for f in old) and data.schema != old
            pq.write_table(data.cast(old), part)
    with pytest.raises(
        StoreError, match=f"columns do not match the igrad schema of version {SCHEMA_VERSION}"
    ):
        Store(root).scan("igrad").collect()
    for path in root.glob("manifests/**/manifest.json"):
        data = json.loads(path.read_text())
        path.write_text(json.dumps({**data, "schema_version": 7}))
    (info,) = Store(root).partitions
    assert info.manifest.schema_version == 7
    got = analyze(root)
    for table in ("igrad_depth", "erasure_depth", "erasure_layers"):
        assert got[table].equals(want[table]), table


def test_the_reference_sensitivity_where_the_same_documents_have_two_references(
    tmp_path: Path,
) -> None:
    """Two partitions of one model and the same documents (tasks ``qa`` and ``qa-all``), their
    erasure taken with the reference over positions 1..T-1 and over every position: the report
    shows both depth scores and the largest change of the per-state mean effect; one
    partition alone shows none."""
    from layerdiv.analyze.report import write_report

    root = tmp_path / "store"
    first = {"erase_reference": 10, "erase_reference_positions": "after-first"}
    write_store(root, 3, 0.0, erase={**first, "erase_reference_task": None})
    alone = analyze(root)
    write_report(alone, tmp_path / "alone", "paper", str(root), "md")
    assert "Sensitivity to the reference" not in (tmp_path / "alone" / "report.md").read_text()
    write_store(root, 8, 0.0, task="qa-all",
                erase={**first, "erase_reference_positions": "all"})  # fmt: skip
    results = analyze(root)
    depth = results["erasure_depth"].sort("task")
    assert depth["reference"].to_list() == [
        "positions 1..T-1 of the task's first 10",
        "positions 0..T-1 of the task's first 10",
    ]
    rows = erasure.sensitivity_rows(depth, results["erasure_layers"]).sort("task")
    assert rows["task"].to_list() == ["qa", "qa-all"]
    per_state = {
        task: results["erasure_layers"].filter(pl.col("task") == task).sort("layer")["effect"]
        for task in ("qa", "qa-all")
    }
    diff = np.abs(per_state["qa-all"].to_numpy() - per_state["qa"].to_numpy())
    assert rows["largest_change"].to_list() == [0.0, pytest.approx(diff.max(), rel=1e-12)]
    assert rows["state"][1] == int(np.argmax(diff)) and diff.max() > 0.01
    assert rows["score"].to_list() == depth["score"].to_list()
    write_report(results, tmp_path / "report", "paper", str(root), "md")
    text = (tmp_path / "report" / "report.md").read_text()
    section = text[text.index(f"## {erasure.TITLE}") :].split("\n## ")[0]
    assert "**Sensitivity to the reference.**" in section
    assert "| positions 0..T-1 of the task's first 10 |" in section


def made_up_choice(seed: int, gap: float) -> dict[str, np.ndarray]:
    """Made-up integrated gradients of :data:`DOCS` choice instances at the site ``block``:
    ``ig`` (D, 1, L, T) over the :data:`PROMPT_TOKENS` prompt positions, the readout position
    T - 1 large; ``f_input``, ``f_baseline`` (D, 1, L) probabilities in [0, 1] with
    f(x) - f(b) = sum_t IG within 1% (1 + ``gap`` at block 1)."""
    rng = np.random.default_rng(seed)
    ig = rng.normal(0, 1, (DOCS, 1, BLOCKS, PROMPT_TOKENS)) * (1 + np.arange(BLOCKS))[:, None]
    ig[..., -1] *= 10  # the readout position
    total = ig.sum(-1)
    ig[..., 0] += np.where(np.abs(total) < 1, 1 - total, 0.0)  # sum_t IG away from 0
    delta = ig.sum(-1) * (1 + rng.uniform(-0.01, 0.01, (DOCS, 1, BLOCKS)))
    delta[:, 0, 1] *= 1 + gap
    scale = 0.3 / np.abs(delta).max()  # |f(x) - f(b)| <= 0.3
    f_baseline = rng.uniform(0.35, 0.6, (DOCS, 1, BLOCKS))
    f32 = np.float32
    return {
        "ig": (ig * scale).astype(f32).astype(np.float64),
        "f_input": (f_baseline + delta * scale).astype(f32).astype(np.float64),
        "f_baseline": f_baseline.astype(f32).astype(np.float64),
    }


def write_choice_igrad(root: Path, seed: int, gap: float, task: str = "pick") -> dict[str, Any]:
    """A choice partition of :data:`DOCS` instances holding :func:`made_up_choice`'s integrated
    gradients, written by the measurement's own rows, its manifest naming M = :data:`STEPS`;
    returns the values."""

    from layerdiv.measurements.igrad import IgradRows

    v = made_up_choice(seed, gap)
    rows = np.empty(DOCS, object)
    for d in range(DOCS):
        rows[d] = IgradRows(("block",), v["ig"][d], v["f_input"][d], v["f_baseline"][d])
    rng = np.random.default_rng(seed)
    logits, gold, rms, kinds = random_partition(rng, DOCS, BLOCKS, 2)
    write_partition(root, MODEL, task, logits, gold, kinds, rms, chunk=CHUNK,
                    optional={"igrad": rows, "igrad_ends": rows})  # fmt: skip
    for path in root.glob(f"manifests/**/task={task}/**/manifest.json"):
        data = json.loads(path.read_text())
        settings = {"igrad": {"igrad_sites": ["block"], "igrad_steps": STEPS}}
        path.write_text(json.dumps({**data, "settings": settings}))
    return v


@pytest.fixture(scope="module")
def choice_igrad(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A store of a text partition holding igrad and a choice partition holding igrad whose
    block 1 misses completeness by 20%."""
    root = tmp_path_factory.mktemp("choice_igrad") / "store"
    write_store(root, 3, 0.0)
    return root, write_choice_igrad(root, 9, 0.2)


def test_choice_igrad_numbers(choice_igrad: tuple[Path, dict[str, Any]]) -> None:
    """Issue 45 item 5: a choice partition's igrad gets shares, depth scores with intervals over
    instances, completeness gaps and maps, as running text does, in tables of its own."""
    root, v = choice_igrad
    results = analyze(root)
    assert "choice_igrad" in results.analyses
    assert not [n for n in results.notes if "igrad" in n]
    share = results["choice_igrad_share"].sort("block")
    gaps = results["choice_igrad_completeness"].sort("block")
    assert share["task"].unique().to_list() == ["pick"]
    assert share["sublayer"].unique().to_list() == ["block"]
    assert results["igrad_share"]["task"].unique().to_list() == ["qa"]
    ig, delta = v["ig"][:, 0], v["f_input"][:, 0] - v["f_baseline"][:, 0]
    profiles = np.abs(ig).sum(-1)  # (D, L): sum_t |IG(l, t)| per instance
    shares = profiles / profiles.sum(1, keepdims=True)
    g = ig.sum(-1) - delta  # (D, L)
    for b in range(BLOCKS):
        row = share.row(b, named=True)
        assert close(row["share"], shares[:, b].mean()) and row["n_documents"] == DOCS
        assert row["relative_depth"] == (b + 1) / BLOCKS
        row = gaps.row(b, named=True)
        scale = np.abs(delta).max()
        assert close(row["gap_mean"], g[:, b].mean(), scale)
        assert close(row["abs_gap_mean"], np.abs(g[:, b]).mean(), scale)
        assert close(row["delta_mean"], np.abs(delta[:, b]).mean(), scale)
        assert close(row["rel_gap"], np.abs(g[:, b]).sum() / np.abs(delta[:, b]).sum())
        assert row["steps"] == STEPS and row["n_documents"] == DOCS
        assert (row["rel_gap"] > igrad.GAP_LEVEL) == (b == 1)
    scores = [score_of(list(p)) for p in profiles]
    mean = sum(scores) / DOCS
    (row,) = results["choice_igrad_depth"].rows(named=True)
    assert close(row["score"], mean, BLOCKS) and row["n_scored"] == DOCS
    low, high = mean_interval(scores)  # resampling the instances
    assert close(row["ci_low"], low, BLOCKS) and close(row["ci_high"], high, BLOCKS)
    assert close(row["relative"], (mean + 1) / BLOCKS)
    maps = results["choice_igrad_maps"]
    assert maps["doc"].unique().sort().to_list() == [0, 1]
    assert maps.height == 2 * BLOCKS * PROMPT_TOKENS and "token" not in maps.columns
    z = maps.sort("doc", "block", "pos")["attribution"].to_numpy()
    np.testing.assert_allclose(z, ig[:2].ravel(), rtol=1e-6)


def test_choice_igrad_section_in_the_report(
    choice_igrad: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The choice section beside the text one: its gap over 5% said (the text's are not), its
    depth table over instances, its figures drawn."""
    from layerdiv.analyze.report import write_report

    root, _ = choice_igrad
    results = analyze(root)
    write_report(results, tmp_path / "report", "paper", str(root), "md,html")
    text = (tmp_path / "report" / "report.md").read_text()
    assert f"## {igrad.TITLE}" in text
    section = text[text.index(f"## {igrad.CHOICE_TITLE}") :].split("\n## ")[0]
    assert f"M = {STEPS} steps is too small for synth/attrib on pick" in section
    assert text.count("steps is too small") == 1
    assert "| Model | Task | Site | Instances | Depth score |" in section
    assert "gold option's probability" in section
    for figure in ("share", "maps"):
        assert f"figures/choice_igrad_{figure}.png" in section
        png = tmp_path / "report" / "figures" / f"choice_igrad_{figure}.png"
        assert png.stat().st_size > 10_000


def test_a_choice_partition_without_igrad_gets_no_section(mixed: tuple[Path, np.ndarray]) -> None:
    """A choice partition without ``igrad`` (the text one has it) gets no choice section, no
    note (most choice tasks are extracted without ``--igrad``) and no made-up tables."""
    root, _ = mixed
    results = analyze(root)
    assert not any(n.startswith(igrad.CHOICE_TITLE) for n in results.notes), results.notes
    assert "choice_igrad" not in results.analyses and "igrad" in results.analyses
