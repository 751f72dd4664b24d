"""Depth use (methods §7) from synthetic stores whose vectors we know.

Each partition is made from random component vectors z (N, C, d): the stored columns (out_norm,
prefix_rms, cos_residual, cos_prev) are computed from them as extraction does, and every table is
compared with a direct numpy computation on the vectors themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from scipy import stats as sps

from layerdiv.analyze import analyze
from layerdiv.analyze.analyses import depth
from layerdiv.analyze.report import write_report
from layerdiv.analyze.stats import resample_weights
from layerdiv.analyze.synthetic import decoder_kinds, write_partition
from layerdiv.measurements.skips import analysis as skips
from layerdiv.schemas import gram_index
from layerdiv.store import Store, StoreError

EPS = 1e-5


@dataclass
class Vectors:
    z: np.ndarray  # (N, C, d) component outputs at the last token, embedding first
    gold: np.ndarray
    logits: np.ndarray  # (N, C, K)

    @property
    def prefix(self) -> np.ndarray:
        return np.cumsum(self.z, axis=1)


def make_vectors(rng: np.random.Generator, n: int, n_blocks: int, d: int, k: int) -> Vectors:
    c = 1 + 2 * n_blocks
    # updates shrink with depth, with some alignment to the stream so cosines are not all ~0
    z = rng.normal(0.0, 1.0, (n, c, d)) / np.arange(1, c + 1)[None, :, None] ** 0.7
    z[:, 1:] += 0.3 * np.cumsum(z, axis=1)[:, :-1] / np.arange(1, c)[None, :, None]
    logits = rng.normal(0.0, 1.0, (n, c, k)).astype(np.float32)
    return Vectors(z, rng.integers(0, k, n), logits)


def cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def write(root: Path, model: str, task: str, v: Vectors, norm_eps: float | None = EPS) -> None:
    n, c, d = v.z.shape
    r = v.prefix
    prefix_rms = np.sqrt((r**2).mean(-1) + EPS)
    cos_residual = np.full((n, c), np.nan)
    cos_residual[:, 1:] = cos(v.z[:, 1:], r[:, :-1])
    cos_prev = np.full((n, c), np.nan)
    cos_prev[:, 1:] = cos(v.z[:, 1:], v.z[:, :-1])
    write_partition(
        root,
        model,
        task,
        v.logits,
        v.gold,
        decoder_kinds((c - 1) // 2),
        prefix_rms.astype(np.float32),
        chunk=5,
        columns={
            "out_norm": np.linalg.norm(v.z, axis=-1),
            "cos_residual": cos_residual,
            "cos_prev": cos_prev,
        },
        hidden_size=d,
        norm_eps=norm_eps,
    )


@pytest.fixture(scope="module")
def vectors() -> dict[str, Vectors]:
    rng = np.random.default_rng(5)
    return {
        "org/deep": make_vectors(rng, 12, 6, 16, 3),
        "org/shallow": make_vectors(rng, 9, 3, 8, 2),
    }


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, vectors: dict[str, Vectors]) -> Path:
    root = tmp_path_factory.mktemp("depth")
    for model, v in vectors.items():
        write(root, model, "t", v)
    return root


@pytest.fixture(scope="module")
def tables(store: Path) -> dict[str, pl.DataFrame]:
    return depth.geometry(store)


def _slug(model: str) -> str:
    return model.replace("/", "--")


def close(got: object, want: object, rtol: float = 2e-5) -> None:
    np.testing.assert_allclose(np.asarray(got, dtype=float), np.asarray(want), rtol=rtol, atol=2e-6)


def test_component_geometry_equals_direct_computation(
    tables: dict[str, pl.DataFrame], vectors: dict[str, Vectors]
) -> None:
    for model, v in vectors.items():
        got = tables["geometry"].filter(pl.col("model") == _slug(model)).sort("component")
        r, z = v.prefix, v.z
        n_comp = z.shape[1]
        rel = np.linalg.norm(z[:, 1:], axis=-1) / np.linalg.norm(r[:, :-1], axis=-1)
        angle = np.degrees(np.arccos(np.clip(cos(r[:, :-1], r[:, 1:]), -1, 1)))
        assert got["component"].to_list() == list(range(1, n_comp))
        close(got["relative_depth"], np.arange(1, n_comp) / n_comp)
        close(got["rel_contribution"], rel.mean(0))
        close(got["rel_contribution_std"], rel.std(0, ddof=1), rtol=1e-4)
        close(got["cos_residual"], cos(z[:, 1:], r[:, :-1]).mean(0))
        close(got["angle_deg"], angle.mean(0), rtol=1e-4)
        close(got["cos_prev"], cos(z[:, 1:], z[:, :-1]).mean(0))
        assert got["name"].to_list()[:2] == ["attn.0", "mlp.0"]


def block_reference(v: Vectors) -> dict[str, np.ndarray]:
    """Per (instance, block) directly from the vectors: z_l = z_a + z_m."""
    r, z = v.prefix, v.z
    a = np.arange(1, z.shape[1], 2)  # attention components; MLP = a + 1
    zb, before, after = z[:, a] + z[:, a + 1], r[:, a - 1], r[:, a + 1]
    return {
        "rel_contribution": np.linalg.norm(zb, axis=-1) / np.linalg.norm(before, axis=-1),
        "cos_residual": cos(zb, before),
        "angle_deg": np.degrees(np.arccos(np.clip(cos(before, after), -1, 1))),
        "cos_attn_mlp": cos(z[:, a], z[:, a + 1]),
    }


def test_block_geometry_is_exact_from_lag_one_terms(
    tables: dict[str, pl.DataFrame], vectors: dict[str, Vectors]
) -> None:
    for model, v in vectors.items():
        got = tables["geometry_blocks"].filter(pl.col("model") == _slug(model)).sort("block")
        want = block_reference(v)
        n_blocks = want["rel_contribution"].shape[1]
        assert got["block"].to_list() == list(range(1, n_blocks + 1))
        assert got["layer"].to_list() == list(range(n_blocks))
        close(got["relative_depth"], np.arange(1, n_blocks + 1) / n_blocks)
        for column, values in want.items():
            close(got[column], values.mean(0), rtol=1e-4)


def test_depth_decay_fit_and_halves(
    tables: dict[str, pl.DataFrame], vectors: dict[str, Vectors]
) -> None:
    for model, v in vectors.items():
        row = tables["depth_decay"].filter(pl.col("model") == _slug(model)).row(0, named=True)
        size = block_reference(v)["rel_contribution"].mean(0)
        line = sps.linregress(np.log(np.arange(1, len(size) + 1)), np.log(size))
        close(row["beta"], -line.slope, rtol=1e-4)
        close(row["beta_se"], line.stderr, rtol=1e-3)
        geo = tables["geometry"].filter(pl.col("model") == _slug(model))
        first = geo.filter(pl.col("relative_depth") <= 0.5)["cos_prev"].mean()
        second = geo.filter(pl.col("relative_depth") > 0.5)["cos_prev"].mean()
        close(row["cos_prev_first_half"], first, rtol=1e-9)
        close(row["cos_prev_second_half"], second, rtol=1e-9)
        # beta's interval resamples instances (rows of the reference), never blocks
        units = block_reference(v)["rel_contribution"]
        depth_l = np.log(np.arange(1, units.shape[1] + 1))
        betas = [-np.polyfit(depth_l, np.log(w @ units / len(units)), 1)[0]
                 for w in resample_weights(len(units))]  # fmt: skip
        assert row["n_units"] == len(units)
        close(row["beta_low"], np.percentile(betas, 2.5), rtol=1e-4)
        close(row["beta_high"], np.percentile(betas, 97.5), rtol=1e-4)
        halves = tables["geometry_halves"].filter(pl.col("model") == _slug(model))
        assert halves.height == len(units)
        want = row["rel_contribution_first_half_after_block0"] - row["rel_contribution_second_half"]
        close(halves["rel_difference"].mean(), want, rtol=1e-9)
    assert (tables["depth_decay"]["beta"] > 0).all()  # updates were made to shrink with depth


def test_tables_not_extracted_are_left_out_and_explicit_skip_request_fails(store: Path) -> None:
    tables = depth.geometry(store)
    assert {"geometry", "geometry_blocks", "depth_decay"} <= set(tables)
    assert "skip_effects" not in tables and "gram_blocks" not in tables
    with pytest.raises(skips.SkipsError, match=r"no complete skips table for .*extract .*--skips"):
        skips.skip_effects(store)


def test_layernorm_leaves_norm_columns_empty(tmp_path: Path) -> None:
    v = make_vectors(np.random.default_rng(1), 6, 2, 8, 2)
    write(tmp_path, "org/ln", "t", v)
    path = next(tmp_path.glob("manifests/**/manifest.json"))
    path.write_text(path.read_text().replace('"norm": "rms"', '"norm": "layer"'))
    notes: list[str] = []
    tables = depth.depth_tables(Store(tmp_path).select(), notes)
    geo = tables["geometry"]
    assert geo["rel_contribution"].null_count() == geo.height
    close(geo.sort("component")["cos_prev"], cos(v.z[:, 1:], v.z[:, :-1]).mean(0))
    assert any("LayerNorm" in n for n in notes)


def test_analyze_and_report_include_depth(store: Path, tmp_path: Path) -> None:
    results = analyze(store)
    assert {"geometry", "geometry_blocks", "depth_decay"} <= set(results.tables())
    assert {"gram", "skips"}.isdisjoint(results.analyses)  # no partition holds their tables
    path, _ = write_report(results, tmp_path / "report")
    text = path.read_text()
    section = text[text.index("## How depth is used") :]
    # what was not extracted is one note (the registry's, from the measurement's flag)
    for table, what in (("skips", "Layer skips"), ("gram", "Gram-matrix angles")):
        line = f"{what}: not extracted for any partition (`layerdiv extract --{table}` adds it)."
        assert results.notes.count(line) == 1 and line in text[: text.index("## ")]
        assert f"## {what}" not in text
    assert depth.POSITION_NOTE in section
    assert "](figures/depth_geometry.png)" in section
    assert (tmp_path / "report" / "figures" / "depth_geometry.png").stat().st_size > 10_000
    beta = results.depth_decay.filter(pl.col("model") == "org--deep")["beta"][0]
    assert f"{beta:.2f} ±" in section


def test_a_table_some_partitions_lack_is_said_in_its_section_not_as_a_warning(
    tmp_path: Path,
) -> None:
    """Gram angles of one of two tasks: the section says which partition lacks them and how to
    add them; the report's warnings (its notes) do not repeat it."""
    v = make_vectors(np.random.default_rng(1), 6, 2, 8, 2)
    gram = np.einsum("icd,ied->ice", v.z, v.z)
    upper = np.triu_indices(v.z.shape[1])
    flat = gram[:, upper[0], upper[1]].astype(np.float32)
    write_partition(tmp_path, "m", "a", v.logits, v.gold, decoder_kinds(2), chunk=3,
                    optional={"gram": flat})  # fmt: skip
    write_partition(tmp_path, "m", "b", v.logits, v.gold, decoder_kinds(2), chunk=3)
    results = analyze(tmp_path)
    line = "Gram-matrix angles: not extracted for m/main/b (`layerdiv extract --gram` adds it)."
    assert "gram" in results.analyses and results.coverage["gram"] == [line]
    assert line not in results.notes
    path, notes = write_report(results, tmp_path / "report")
    text = path.read_text()
    assert line not in notes and line not in text[: text.index("## ")]
    section = text[text.index("## Gram-matrix angles") :]
    assert section[: section.index("\n## ")].count(line) == 1


@pytest.mark.parametrize(
    ("value", "refusal"),
    [
        (float("nan"), "part-0000003-000003.parquet: gram.gram holds a NaN or an infinite value"),
        (float("inf"), "part-0000003-000003.parquet: gram.gram holds a NaN or an infinite value"),
        (-1.0, "the gram row of instance 3 holds a negative squared norm"),
    ],
)
def test_impossible_gram_values_are_never_averaged(
    tmp_path: Path, value: float, refusal: str
) -> None:
    v = make_vectors(np.random.default_rng(1), 6, 2, 8, 2)
    gram = np.einsum("icd,ied->ice", v.z, v.z)  # z_a . z_b of every component (no bias)
    n = v.z.shape[1]
    upper = np.triu_indices(n)  # row by row, as gram_index orders them
    flat = gram[:, upper[0], upper[1]].astype(np.float32)
    flat[3, gram_index(2, 2, n)] = value  # instance 3: the squared norm of component 2
    write_partition(
        tmp_path, "m", "t", v.logits, v.gold, decoder_kinds(2), chunk=3, optional={"gram": flat}
    )
    with pytest.raises(StoreError, match=refusal):
        analyze(tmp_path)
