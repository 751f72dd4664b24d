"""Running-text analyses (methods §9) against numpy on raw residual vectors."""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import polars as pl
import pytest

from layerdiv.analyze.analyses.text_geometry import geometry_table
from layerdiv.analyze.analyses.text_profiles import depth_scores, pca_tables
from layerdiv.analyze.synthetic import text_dots
from layerdiv.analyze.text import (
    DOTS,
    EARLY_STOP_FRACTION,
    GEOMETRY,
    THETA_STATE,
    BlockStats,
    ProfileMoments,
    document_means,
    token_dots,
    token_geometry,
)
from layerdiv.measurements.lens.text_lens import lens_table
from layerdiv.store import StoreError
from layerdiv.store.key import KEY

TOL = 1e-6


def raw_vectors(
    rng: np.random.Generator, lengths: list[int], blocks: int, d: int = 12
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(doc, pos, h0, attn, mlp) of documents of the given lengths: random vectors whose
    updates shrink with depth, so the angles cover a useful range; the first token of each
    document stops updating in the second half of the blocks."""
    n = sum(lengths)
    doc = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.concatenate([np.arange(t) for t in lengths])
    scale = 1.0 / np.arange(1, blocks + 1)[None, :, None]
    h0 = rng.normal(size=(n, d))
    attn = rng.normal(size=(n, blocks, d)) * scale
    mlp = rng.normal(size=(n, blocks, d)) * scale
    attn[pos == 0, blocks // 2 :] *= 1e-3
    mlp[pos == 0, blocks // 2 :] *= 1e-3
    return doc, pos, h0, attn, mlp


def token_blocks(doc: np.ndarray, pos: np.ndarray, dots: dict[str, np.ndarray]) -> pl.DataFrame:
    """The ``token_blocks`` rows of the contract (float64 here, float32 in a store)."""
    n, blocks = dots["hh"].shape
    return pl.DataFrame(
        {
            "doc": np.repeat(doc, blocks).astype(np.int32),
            "pos": np.repeat(pos, blocks).astype(np.int32),
            "block": np.tile(np.arange(blocks, dtype=np.int16), n),
            **{c: dots[c].reshape(-1) for c in DOTS},
        }
    ).with_columns(pl.col(DOTS).fill_nan(None))


def reference_geometry(h0: np.ndarray, attn: np.ndarray, mlp: np.ndarray) -> dict[str, np.ndarray]:
    """Every geometry column per (token, block), straight from the vectors (NaN: undefined)."""
    update = attn + mlp
    h = h0[:, None, :] + np.cumsum(update, axis=1) - update
    h_next = h + update
    h_last = h_next[:, -1:, :]

    def norm(x: np.ndarray) -> np.ndarray:
        return np.linalg.norm(x, axis=-1)

    def cos(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.sum(x * y, axis=-1) / (norm(x) * norm(y))

    def deg(c: np.ndarray) -> np.ndarray:
        return np.degrees(np.arccos(np.clip(c, -1, 1)))

    theta_update = np.full(update.shape[:2], np.nan)
    theta_update[:, :-1] = deg(cos(update[:, :-1], update[:, 1:]))
    return {
        "attn_rel": norm(attn) / np.maximum(norm(h), 1e-6),
        "mlp_rel": norm(mlp) / np.maximum(norm(h + attn), 1e-6),
        "layer_rel": norm(update) / np.maximum(norm(h), 1e-6),
        "cos_attn": cos(attn, h),
        "cos_mlp": cos(mlp, h + attn),
        "cos_layer": cos(update, h),
        "cos_io": cos(h_next, h),
        "theta_state": deg(cos(h, h_next)),
        "theta_update": theta_update,
        "angle_final": deg(cos(h, np.broadcast_to(h_last, h.shape))),
        # methods §10: <h_l - h_0, h_L - h_0> / ||h_L - h_0||^2
        "proj": np.sum((h - h0[:, None]) * (h_last - h0[:, None]), axis=-1)
        / np.sum((h_last - h0[:, None]) ** 2, axis=-1),
    }


def geometry_of(frame: pl.DataFrame, blocks: int) -> np.ndarray:
    """:func:`token_geometry` of ``token_blocks`` rows held in a frame."""
    return token_geometry(token_dots(frame.to_arrow(), blocks)[1])


def stats_of(*frames: pl.DataFrame, blocks: int) -> BlockStats:
    """The :class:`BlockStats` of batches of ``token_blocks`` rows."""
    stats = BlockStats.empty(blocks)
    for frame in frames:
        stats.add(geometry_of(frame, blocks))
    return stats


@pytest.fixture
def text() -> tuple[pl.DataFrame, dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    doc, pos, h0, attn, mlp = raw_vectors(rng, [7, 3, 11, 5], blocks=6)
    frame = token_blocks(doc, pos, text_dots(h0, attn, mlp))
    return frame, reference_geometry(h0, attn, mlp), pos


def test_token_geometry_matches_the_vectors(text) -> None:
    frame, ref, _ = text
    geo = geometry_of(frame, 6)
    for i, column in enumerate(GEOMETRY):
        np.testing.assert_allclose(geo[i].T, ref[column], atol=TOL, rtol=TOL, err_msg=column)


@pytest.mark.filterwarnings("ignore:Mean of empty slice", "ignore:All-NaN slice")
def test_geometry_table_is_token_weighted_means_and_maxima(text) -> None:
    frame, ref, _ = text
    table = geometry_table(stats_of(frame, blocks=6), 6)
    assert table["n_tokens"].to_list() == [26] * 6
    np.testing.assert_allclose(table["relative_depth"], np.arange(1, 7) / 6)
    for column in GEOMETRY:
        np.testing.assert_allclose(
            table[f"{column}_mean"].fill_null(np.nan),
            np.nanmean(ref[column], axis=0),
            rtol=TOL,
            atol=1e-12,  # proj is 0 at block 0, the reference 0 to rounding
        )
        np.testing.assert_allclose(
            table[f"{column}_max"].fill_null(np.nan),
            np.nanmax(ref[column], axis=0),
            rtol=TOL,
            atol=1e-12,
        )


def test_batched_geometry_equals_one_shot(text) -> None:
    frame, _, _ = text
    one = geometry_table(stats_of(frame, blocks=6), 6)
    cuts = [0, 6 * 5, 6 * 12, 6 * 13, frame.height]  # whole tokens, across document boundaries
    many = geometry_table(stats_of(*(frame[a:b] for a, b in itertools.pairwise(cuts)), blocks=6), 6)
    for column in one.columns:
        np.testing.assert_allclose(many[column].to_numpy(), one[column].to_numpy(), rtol=1e-12)


def test_token_geometry_refuses_unsorted_rows(text) -> None:
    frame, _, _ = text
    with pytest.raises(StoreError, match="sorted"):
        token_dots(frame.reverse().to_arrow(), 6)
    with pytest.raises(StoreError, match="whole tokens"):
        token_dots(frame[:-1].to_arrow(), 6)


def test_lens_means_over_positions_then_documents() -> None:
    rng = np.random.default_rng(1)
    lengths, layers = [4, 9, 2], 5
    rows = []
    for doc, t in enumerate(lengths):
        for pos in range(t):
            for layer in range(layers):
                ce = None if pos == t - 1 else float(rng.random())
                rows.append((doc, pos, layer, float(rng.random()), float(rng.random()), ce))
    frame = pl.DataFrame(
        rows, schema=["doc", "pos", "layer", "kl", "top5_overlap", "ce"], orient="row"
    )
    table = lens_table(document_means([frame[:17], frame[17:60], frame[60:]]), layers - 1)
    for column in ("kl", "top5_overlap", "ce"):
        per_doc = frame.group_by("doc", "layer").agg(pl.col(column).mean())
        expect = per_doc.group_by("layer").agg(pl.col(column).mean()).sort("layer")
        np.testing.assert_allclose(table[column], expect[column], rtol=TOL)
    assert table["n_documents"].to_list() == [3] * layers
    np.testing.assert_allclose(table["relative_depth"], np.arange(layers) / (layers - 1))


def test_profile_pca_from_moments_equals_numpy(text) -> None:
    frame, ref, pos = text
    theta = ref["theta_state"]
    moments = ProfileMoments.empty(6)
    for part in (frame[: 6 * 9], frame[6 * 9 :]):  # two batches
        positions, dots = token_dots(part.to_arrow(), 6)
        moments.add(token_geometry(dots)[THETA_STATE], positions)
    pca, loadings = pca_tables(moments)
    values, vectors = np.linalg.eigh(np.cov(theta, rowvar=False))
    order = np.argsort(values)[::-1]
    np.testing.assert_allclose(pca["explained_variance"], values[order][:5], rtol=1e-6, atol=1e-9)
    ratio = (values / values.sum())[order][:5]
    np.testing.assert_allclose(pca["explained_ratio"], ratio, rtol=1e-6)
    first = loadings.filter(pl.col("component") == 1)
    assert abs(abs(first["loading"].to_numpy() @ vectors[:, order[0]]) - 1) < 1e-6
    np.testing.assert_allclose(first["mean_theta"], theta.mean(axis=0), rtol=1e-9)
    one = ProfileMoments.empty(6)
    one.add(theta.T, pos)
    assert one.early == moments.early and one.n == moments.n == len(theta)
    # blocks 1-2 against blocks 3-4 of 6 (block 0 and the last block left out)
    early = theta[:, 3:5].mean(axis=1) < EARLY_STOP_FRACTION * theta[:, 1:3].mean(axis=1)
    assert early[pos == 0].all() and early.sum() < len(early)
    for r, (lo, hi) in enumerate([(0, 0), (1, 1), (2, 3), (4, 7), (8, 15)]):
        at = (pos >= lo) & (pos <= hi)
        assert moments.early.get(r, (0, 0)) == (int(at.sum()), int(early[at].sum()))


def test_depth_score_is_centre_of_mass_of_out_change() -> None:
    change = {0: [0.1, 0.5, 0.2], 1: [0.0, 0.0, 2.0]}
    rows = [
        {"sublayer": "block", "doc": d, "skipped": b, "out_change_max": v}
        for d, values in change.items()
        for b, v in enumerate(values)
    ]
    scores = depth_scores(pl.DataFrame(rows)).sort("doc")
    expect = [sum(i * v for i, v in enumerate(vs)) / sum(vs) for vs in change.values()]
    np.testing.assert_allclose(scores["depth_score"], expect, rtol=TOL)


def test_report_sections_draw_their_figures(text, tmp_path) -> None:
    from layerdiv.analyze.analyses import text_geometry, text_profiles
    from layerdiv.analyze.registry import ReportContext
    from layerdiv.measurements.future import analysis as text_skips
    from layerdiv.measurements.lens import text_lens

    frame, ref, pos = text
    moments = ProfileMoments.empty(6)
    moments.add(ref["theta_state"].T, pos)
    pca, loadings = pca_tables(moments)
    names = {"m": "org/model"}

    def tagged(f: pl.DataFrame) -> pl.DataFrame:
        key = {"model": "m", "revision": "main", "task": "fineweb"}
        return f.select(*(pl.lit(key[c]).alias(c) for c in KEY), pl.all())

    geometry = tagged(geometry_table(stats_of(frame, blocks=6), 6))
    lens_rows = (
        frame.select("doc", "pos").unique().join(pl.DataFrame({"layer": range(7)}), how="cross")
    )
    lens = lens_rows.with_columns(kl=pl.lit(0.5), top5_overlap=pl.lit(0.4), ce=pl.lit(2.0))
    skips = pl.DataFrame(
        {"sublayer": ["block"] * 36, "mode": ["total"] * 36, "skipped": [i // 6 for i in range(36)],
         "block": [i % 6 for i in range(36)], "rel_change_max": np.linspace(0, 1, 36),
         "rel_change_mean": np.linspace(0, 0.5, 36), "n": [4] * 36}
    )  # fmt: skip
    output = pl.DataFrame(
        {"sublayer": ["block"] * 6, "skipped": list(range(6)), "out_change_max": np.ones(6),
         "out_change_mean": np.ones(6) / 2, "n": [4] * 6}
    )  # fmt: skip
    scores = pl.DataFrame(
        {"sublayer": ["block"] * 2, "group": ["1", "2"], "n_documents": [2, 2],
         "depth_score": [1.5, 3.0], "depth_score_std": [0.1, 0.2],
         "relative_depth_score": [0.4, 0.6]}
    )  # fmt: skip
    tables = {
        "manifests": tagged(pl.DataFrame({"kind": ["text"]})),  # no subset_of: nothing overlaps
        "text_geometry": geometry,
        "text_lens": tagged(lens_table(document_means([lens]), 6)).with_columns(
            lens=pl.lit("final"), uniform_ce=pl.lit(np.log(400))
        ),
        # the choice tasks' lens
        "lens_curves": tagged(lens_table(document_means([lens]), 6)).with_columns(
            lens=pl.lit("final"), uniform_ce=pl.lit(np.log(400))
        ),
        "text_skips": tagged(skips),
        "text_skip_output": tagged(output),
        "text_profile_pca": tagged(pca),
        "text_profile_loadings": tagged(loadings),
        "text_early_stop": tagged(text_profiles.early_table(moments)),
        "text_update_fit": text_profiles.update_fit(geometry),
        "text_depth_score": tagged(scores),
        "geometry_blocks": tagged(
            geometry.select(
                (pl.col("block") + 1).alias("block"),
                pl.col("layer_rel_mean").alias("rel_contribution"),
                pl.col("theta_state_mean").alias("angle_deg"),
                pl.col("cos_layer_mean").alias("cos_residual"),
            )
        ),
    }
    ctx = ReportContext(
        tables=tables, estimator="paper", names=names, figures=tmp_path, formats=("md", "html")
    )
    text_md = "\n".join(
        module.report(ctx) for module in (text_geometry, text_lens, text_skips, text_profiles)
    )
    drawn = sorted(p.name for p in ctx.figures.iterdir())
    assert drawn == [
        "text_geometry.png",
        "text_lens.png",
        "text_profiles.png",
        "text_skips.png",
        "text_vs_last_token.png",
    ]
    assert all(f"figures/{name}" in text_md for name in drawn)
    # Every figure is interactive too, from the same spec.
    assert sorted(ctx.interactive) == drawn
    lens_figure = ctx.interactive["text_lens.png"]
    traces = {t["name"] for t in lens_figure["data"]}
    assert traces == {"model text", "model last prompt token"}
    # The uniform baseline log V on the cross-entropy panel.
    lines = [s["y0"] for s in lens_figure["layout"]["shapes"]]
    assert lines == [pytest.approx(np.log(400))]


def test_analyses_get_only_the_partitions_of_their_kinds(tmp_path) -> None:
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.synthetic import (
        random_partition,
        synthesize_text_store,
        write_partition,
    )

    logits, gold, rms, kinds = random_partition(np.random.default_rng(0), 20, 3, 2)
    write_partition(tmp_path, "org/choice", "task", logits, gold, kinds, rms)
    alone = analyze(tmp_path)
    assert "paper" in alone.analyses and "text_geometry" not in alone.analyses
    assert not [name for name in alone.names() if name.startswith("text_")]
    synthesize_text_store(tmp_path, 1, 6, 20, 3, chunk=4, lens=True, skips=True, progress=False)
    mixed = analyze(tmp_path)
    text = {"effective_depth", "decided_depth", "decided_depth_hist", "decided_lens", "bos_norm"}
    for name, table in mixed.tables().items():
        if "model" in table.columns and table.height and name != "manifests":
            is_text = name.startswith("text_") or name in text
            want = "synth--text-model-00" if is_text else "org--choice"
            assert set(table["model"].to_list()) - {None} == {want}, name
    assert mixed.text_geometry.height == 3 and mixed.text_lens.height == 4


def write_vectors(root, lengths: list[int], h0, attn, mlp, chunk: int) -> None:
    """A text partition of documents of ``lengths`` tokens from residual vectors, written through
    the store's writer in chunks of ``chunk`` documents."""
    from layerdiv.analyze.synthetic import text_manifest, write_text_partition
    from layerdiv.store.tables import (
        TOKEN_BLOCK_VALUES,
        documents_table,
        token_blocks_table,
        tokens_table,
    )

    dots = text_dots(h0, attn, mlp)
    values = np.stack([dots[c] for c in TOKEN_BLOCK_VALUES], axis=-1)
    doc = np.repeat(np.arange(len(lengths)), lengths)

    def chunks():
        for start in range(0, len(lengths), chunk):
            docs = range(start, min(len(lengths), start + chunk))
            mine = [lengths[i] for i in docs]
            yield (
                start,
                len(docs),
                {
                    "documents": documents_table(docs, mine, [False] * len(docs)),
                    "tokens": tokens_table(docs, [list(range(t)) for t in mine]),
                    "token_blocks": token_blocks_table(docs, mine, values[np.isin(doc, docs)]),
                },
            )

    blocks, d = attn.shape[1], attn.shape[2]
    manifest = text_manifest(
        "org/tiny", "doc", len(lengths), blocks, max(lengths), chunk, hidden_size=d
    )
    write_text_partition(root, manifest, chunks())


def test_store_tables_match_numpy_and_batching(tmp_path, monkeypatch) -> None:
    from layerdiv.analyze import text as text_module
    from layerdiv.analyze.api import analyze

    rng = np.random.default_rng(7)
    lengths, blocks = [9, 14, 4, 11, 7], 5
    n = sum(lengths)
    # small integers: every dot product is exact in float32
    h0 = rng.integers(-4, 5, (n, 6)).astype(float)
    attn = rng.integers(-3, 4, (n, blocks, 6)).astype(float)
    mlp = rng.integers(-3, 4, (n, blocks, 6)).astype(float)
    write_vectors(tmp_path, lengths, h0, attn, mlp, chunk=2)
    results = analyze(tmp_path)
    assert results.analyses == [  # those that need the lens or the skips do not run
        "text_geometry",
        "text_profiles",
        "effective_depth",
        "bos_norm",
        "depth_law",  # it runs on text tasks, and says why it fits nothing on one model
        "maps",
        "compare",  # its table is empty: one model
    ]
    for what, flag in (("Running text: logit lens", "--lens"), ("Running text: future", "--skips")):
        assert any(n.startswith(what) and f"`layerdiv extract {flag}" in n for n in results.notes)
    ref = reference_geometry(h0, attn, mlp)
    geo = results.text_geometry.sort("block")
    assert geo["n_tokens"].to_list() == [n] * blocks
    for column in GEOMETRY:
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mean, top = np.nanmean(ref[column], axis=0), np.nanmax(ref[column], axis=0)
        np.testing.assert_allclose(
            geo[f"{column}_mean"].fill_null(np.nan), mean, rtol=TOL, atol=TOL
        )
        np.testing.assert_allclose(geo[f"{column}_max"].fill_null(np.nan), top, rtol=TOL, atol=TOL)
    values_pca, _ = np.linalg.eigh(np.cov(ref["theta_state"], rowvar=False))
    ratio = np.sort(values_pca / values_pca.sum())[::-1]
    np.testing.assert_allclose(results.text_profile_pca["explained_ratio"], ratio[:5], rtol=1e-6)
    # batches of 3 tokens (crossing documents and part files) give the same tables
    monkeypatch.setattr(text_module, "BATCH_TOKENS", 3)
    small = analyze(tmp_path)
    for name in ("text_geometry", "text_profile_pca", "text_early_stop", "text_update_fit"):
        a, b = results.tables()[name], small.tables()[name]
        assert a.columns == b.columns and a.height == b.height
        for column in a.columns:
            if a[column].dtype.is_float():
                np.testing.assert_allclose(
                    a[column].fill_null(np.nan), b[column].fill_null(np.nan), rtol=1e-9
                )
            else:
                assert a[column].to_list() == b[column].to_list()


@pytest.mark.filterwarnings("ignore:Mean of empty slice", "ignore:All-NaN slice")
def test_undefined_quantities_are_left_out_of_counts_means_and_profiles(tmp_path) -> None:
    from layerdiv.analyze.api import analyze

    rng = np.random.default_rng(3)
    lengths, blocks = [1, 40, 3, 17], 6  # very different lengths
    n = sum(lengths)
    # small integers: every dot product is exact in float32
    h0 = rng.integers(-4, 5, (n, 5)).astype(float)
    attn = rng.integers(-3, 4, (n, blocks, 5)).astype(float)
    mlp = rng.integers(-3, 4, (n, blocks, 5)).astype(float)
    attn[:, 2] = 0.0  # no attention update in block 2: cos_attn undefined for every token
    attn[::3, 4] = mlp[::3, 4] = 0.0  # no update of block 4 for a third of the tokens
    h0[5], attn[5, 0], mlp[5, 0] = 0.0, 0.0, 0.0  # h_0 = h_1 = 0: theta_state undefined
    with np.errstate(all="ignore"):
        ref = reference_geometry(h0, attn, mlp)
    assert np.isnan(ref["cos_attn"][:, 2]).all() and np.isnan(ref["theta_state"][5, 0])
    runs = []
    for chunk in (1, len(lengths)):  # one document per part file, and every document in one
        root = tmp_path / f"chunk{chunk}"
        write_vectors(root, lengths, h0, attn, mlp, chunk)
        runs.append(analyze(root))
    for results in runs:
        geo = results.text_geometry.sort("block")
        assert geo["n_tokens"].to_list() == [n] * blocks
        assert geo["cos_attn_mean"][2] is None and geo["cos_attn_max"][2] is None
        for column in GEOMETRY:
            with np.errstate(all="ignore"), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mean, top = np.nanmean(ref[column], axis=0), np.nanmax(ref[column], axis=0)
            got = geo[f"{column}_mean"].fill_null(np.nan)
            np.testing.assert_allclose(got, mean, rtol=TOL, atol=TOL, err_msg=column)
            got = geo[f"{column}_max"].fill_null(np.nan)
            np.testing.assert_allclose(got, top, rtol=TOL, atol=TOL, err_msg=column)
        # the token without a theta_state profile is left out of the PCA and the early stops
        kept = np.isfinite(ref["theta_state"]).all(axis=1)
        assert kept.sum() == n - 1
        pca = results.text_profile_pca
        assert pca["n_tokens"].to_list() == [n - 1] * len(pca)
        values = np.sort(np.linalg.eigvalsh(np.cov(ref["theta_state"][kept], rowvar=False)))
        np.testing.assert_allclose(pca["explained_variance"], values[::-1][:5], rtol=1e-6)
        assert results.text_early_stop["n_tokens"].sum() == n - 1
