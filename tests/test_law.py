"""The depth loss law (methods §12): recovery of known parameters, the protocol's
options, the output, and bad input refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner, Result

from layerdiv.analyze import law
from layerdiv.cli import main

TRUE = law.EXAMPLE
EXPONENTS = ("alpha_width", "alpha_depth", "alpha_tokens")
synthetic = law.synthetic_points


def estimates(fit: law.LawFit) -> dict[str, tuple[float, float]]:
    return {r["parameter"]: (r["estimate"], r["se"]) for r in fit.table.iter_rows(named=True)}


@pytest.mark.parametrize("seed", range(20))
def test_exponents_recovered_within_two_standard_errors(seed: int) -> None:
    fit = law.fit_law(synthetic(seed), bootstrap=0)
    found = estimates(fit)
    for name in EXPONENTS:
        value, se = found[name]
        assert 0 < se < 0.2, (name, se)
        assert abs(value - TRUE[name]) < 2 * se, (name, value, se)
    assert fit.gradient_norm < 1e-6  # the optimum, not a point on the way


def test_the_optimum_beats_every_start_and_nearby_points() -> None:
    points = synthetic(3)
    fit = law.fit_law(points, bootstrap=0)
    est = fit.table["estimate"].to_numpy()

    def objective(p: np.ndarray) -> float:
        w, d, t, loss = (points[c].to_numpy() for c in law.COLUMNS)
        fitted = p[0] * w ** -p[1] + p[2] * d ** -p[3] + p[4] * t ** -p[5] + p[6]
        return float(np.mean((np.log(loss) - np.log(fitted)) ** 2))

    assert objective(est) == pytest.approx(fit.objective, rel=1e-9)
    rng = np.random.default_rng(0)
    for _ in range(50):
        assert objective(est * (1 + 1e-3 * rng.standard_normal(7))) >= fit.objective


def test_coefficients_in_the_units_of_the_input() -> None:
    points = synthetic(5)
    base = estimates(law.fit_law(points, bootstrap=0))
    scaled = estimates(
        law.fit_law(points.with_columns(pl.col("tokens") / 1e9), bootstrap=0)
    )  # tokens in billions: c_tokens scales by 1e9^-alpha, nothing else changes
    alpha = base["alpha_tokens"][0]
    assert scaled["c_tokens"][0] == pytest.approx(base["c_tokens"][0] * 1e9**-alpha, rel=1e-5)
    for name in ("alpha_tokens", "c_width", "alpha_depth", "E"):
        assert scaled[name][0] == pytest.approx(base[name][0], rel=1e-5)
    assert scaled["alpha_tokens"][1] == pytest.approx(base["alpha_tokens"][1], rel=1e-4)


def test_bootstrap_intervals_and_heldout_error() -> None:
    fit = law.fit_law(synthetic(7, n=120), bootstrap=40, heldout=3, seed=1)
    table = fit.table
    assert fit.n_bootstrap == 40
    assert (table["ci_low"] < table["estimate"]).all()
    assert (table["estimate"] < table["ci_high"]).all()
    assert fit.heldout_error is not None and 0 < fit.heldout_error < 0.05
    again = law.fit_law(synthetic(7, n=120), bootstrap=40, heldout=3, seed=1)
    assert again.table.equals(table) and again.heldout_error == fit.heldout_error


def test_exclude_highest_keeps_points_strictly_below_the_nth_highest() -> None:
    points = synthetic(2, n=60)
    points = pl.concat([points, points.sort("loss").tail(1)])  # the highest loss twice
    fit = law.fit_law(points, exclude_highest=2, bootstrap=0)
    assert fit.n_fitted == points.height - 2
    fit = law.fit_law(points, exclude_highest=3, bootstrap=0)
    assert fit.n_fitted == points.height - 3
    assert fit.points["loss"].max() < points["loss"].sort(descending=True)[2]


def run(*args: str) -> Result:
    return CliRunner().invoke(main, ["fit-law", *args])


def test_cli_writes_the_table_the_summary_and_the_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    synthetic(1, n=80).write_parquet(tmp_path / "points.parquet")
    out = tmp_path / "law"
    result = run("--points", str(tmp_path / "points.parquet"), "--out", str(out),
                 "--bootstrap", "20", "--heldout", "2", "--format", "parquet")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "at the optimum (gradient norm" in result.output
    table = pl.read_parquet(out / "depth_law.parquet")
    assert table["parameter"].to_list() == list(law.PARAMETERS)
    assert table.columns == ["parameter", "estimate", "se", "ci_low", "ci_high"]
    summary = pl.read_parquet(out / "depth_law_fit.parquet")
    assert summary["n_heldout_splits"][0] == 2
    assert (out / "depth_law.png").stat().st_size > 10_000


def refusal(result: Result) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_bad_input_one_line_each(tmp_path: Path) -> None:
    good = synthetic(0, n=30)
    path = tmp_path / "p.csv"
    good.drop("tokens").write_csv(path)
    assert "lacks the column(s) tokens" in refusal(run("--points", str(path)))
    for column in law.COLUMNS:
        good.with_columns(pl.when(pl.int_range(pl.len()) == 4).then(0.0).otherwise(
            pl.col(column)).alias(column)).write_csv(path)  # fmt: skip
        line = refusal(run("--points", str(path)))
        assert f"{column} must be a positive number" in line and "row 5" in line
    least = f"give at least {law.MIN_POINTS} points"
    good.head(law.MIN_POINTS - 1).write_csv(path)  # more than the 7 parameters, but no margin
    assert least in refusal(run("--points", str(path)))
    good.write_csv(path)
    line = refusal(run("--points", str(path), "--exclude-highest", "30"))
    assert "leaves no point of 30" in line
    assert least in refusal(run("--points", str(path), "--exclude-highest", "25"))
    assert "give either --points" in CliRunner().invoke(main, ["fit-law"]).output


UNIDENTIFIABLE = {
    "one width": (
        lambda p: p.with_columns(pl.lit(576.0).alias("width")),
        "every point has width 576, so c_width and alpha_width cannot be told from E",
    ),
    "20 identical points": (
        lambda p: pl.concat([p.head(1)] * 20),
        "every point has width",
    ),
    "two widths": (
        lambda p: p.with_columns(
            pl.when(pl.int_range(pl.len()) % 2 == 0).then(256.0).otherwise(1024.0).alias("width")
        ),
        "the Jacobian at the optimum has rank 6 of 7",
    ),
    "width proportional to depth": (
        lambda p: p.with_columns((64 * pl.col("depth")).alias("width")),
        "the Jacobian at the optimum has rank 6 of 7",
    ),
}


@pytest.mark.parametrize("case", UNIDENTIFIABLE)
def test_points_that_cannot_identify_the_law_are_refused(case: str, tmp_path: Path) -> None:
    """One value of a variable, or a Jacobian without full rank at the optimum: one line naming
    why, no table (before, an estimate of 7.6e13 or standard errors of 1e-17, exit 0)."""
    change, why = UNIDENTIFIABLE[case]
    change(synthetic(0, n=40)).write_csv(tmp_path / "p.csv")
    line = refusal(run("--points", str(tmp_path / "p.csv"), "--out", str(tmp_path / "law")))
    assert "the law cannot be identified from these points" in line and why in line, line
    assert not (tmp_path / "law").exists()


def test_the_same_seed_gives_the_same_files_byte_for_byte(tmp_path: Path) -> None:
    """Two runs with one seed write the same table and summary, bootstrap and held-out splits
    included (resamples that cannot identify the law, whose fits the solver does not repeat,
    are left out of both)."""
    synthetic(4, n=14).write_csv(tmp_path / "p.csv")
    written = []
    for k in range(2):
        out = tmp_path / f"law{k}"
        result = run("--points", str(tmp_path / "p.csv"), "--out", str(out), "--seed", "5",
                     "--bootstrap", "60", "--heldout", "3")  # fmt: skip
        assert result.exit_code == 0, result.output
        files = [(out / f).read_bytes() for f in ("depth_law.csv", "depth_law_fit.csv")]
        written.append((result.output.replace(str(out), "OUT"), *files))
    assert written[0] == written[1]
    summary = pl.read_csv(tmp_path / "law0" / "depth_law_fit.csv")
    assert 0 < summary["n_bootstrap"][0] <= 60 and 0 < summary["n_heldout_splits"][0] <= 3


def test_a_store_with_one_model_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    one = synthetic(0, n=10).with_columns(
        pl.lit("m").alias("model"), pl.lit("main").alias("revision")
    )

    class Fake:
        root = Path("s")

    monkeypatch.setattr(law, "model_losses", lambda store, task, models: one)
    with pytest.raises(law.LawError, match="holds 1 model"):
        law.store_points(Fake(), "wiki")  # type: ignore[arg-type]


def test_within_model_power_fit() -> None:
    layers = np.arange(1, 24, dtype=float)
    c, a, r2 = law.power_fit(layers, 3.0 * layers**-1.1)
    assert (c, a, r2) == pytest.approx((3.0, 1.1, 1.0))
    assert np.isnan(law.power_fit(layers[:1], np.ones(1))[0])


def test_within_model_law_from_the_lens_table(tmp_path: Path) -> None:
    from layerdiv.measurements.lens.text_lens import delta_ce, lens_law, lens_law_figure

    blocks, own = 12, 2.5
    layer = np.arange(blocks + 1)
    ce = own + 4.0 * np.maximum(layer, 1) ** -0.9
    ce[-1] = own
    table = pl.DataFrame(
        {"model": "m", "revision": "main", "task": "fineweb", "layer": layer, "ce": ce,
         "lens": "last-block"}
    ).with_columns(pl.col("layer").cast(pl.Int16))  # fmt: skip
    deltas = delta_ce(table)
    assert deltas["layer"].to_list() == list(range(1, blocks))  # l = 1..L-1
    np.testing.assert_allclose(deltas["delta_ce"], ce[1:blocks] - own)
    fit = lens_law(table)
    assert fit.row(0, named=True) == pytest.approx(
        {
            "model": "m",
            "revision": "main",
            "task": "fineweb",
            "c": 4.0,
            "alpha": 0.9,
            "r2": 1.0,
            "n_layers": 11,
        }
    )
    from layerdiv.analyze import plots

    learned = table.with_columns(pl.col("ce") * 2, lens=pl.lit("ls"))
    spec = lens_law_figure(pl.concat([table, learned]), fit, {})  # only the last-block lens
    assert plots.to_matplotlib(spec, tmp_path / "f.png").stat().st_size > 5_000
    points, line = spec.panels[0].series
    assert points.y == pytest.approx(list(ce[1:blocks] - own))
    assert line.y[0] == pytest.approx(4.0)  # c l^-alpha at l = 1


def test_text_lens_law_only_for_last_block_partitions(tmp_path: Path) -> None:
    from dataclasses import replace

    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.synthetic import text_chunk, text_manifest, write_text_partition

    for name, kind in (("org/final", "final"), ("org/last", "last-block")):
        manifest = replace(
            text_manifest(name, "fineweb", 4, 6, 16, 4, True, False),
            settings={"lens": {"lens": kind}},
        )
        chunk = text_chunk(np.random.default_rng(0), range(4), 16, 6, lens=True)
        write_text_partition(tmp_path, manifest, [(0, 4, chunk)])
    results = analyze(tmp_path)
    assert set(results.text_lens["model"]) == {"org--final", "org--last"}
    table = results.text_lens_law
    assert table["model"].to_list() == ["org--last"]
    rows = results.text_lens.filter(pl.col("model") == "org--last")
    expect = law.power_fit(
        np.arange(1, 6, dtype=float), (rows["ce"][1:6] - rows["ce"][6]).to_numpy()
    )
    assert (table["c"][0], table["alpha"][0], table["r2"][0]) == pytest.approx(expect)


def test_points_from_a_store_of_text_extractions(tmp_path: Path, model_dirs: Any) -> None:
    """``fit-law --store``: the points come from the store's model facts and the model's own loss
    per (model, revision); a revision without its training tokens is named, and two models make
    too few points for the 7 parameters (refused in one line after reading them)."""
    from tests.test_text_extract import random_texts, text_task

    task = text_task(tmp_path / "task", random_texts(4), max_tokens=16)

    def extract(store: Path, family: str, *extra: str) -> None:
        args = ["extract", "--model", str(model_dirs(family)), "--task", str(task)]
        out = CliRunner().invoke(main, [*args, "--store", str(store), *extra])
        assert out.exit_code == 0, out.output

    def fit(store: Path) -> str:
        run = ["fit-law", "--store", str(store), "--task", "docs", "--out", str(tmp_path / "law")]
        return refusal(CliRunner().invoke(main, run))

    for store in (tmp_path / "a", tmp_path / "b"):
        extract(store, "llama", "--revision", "step1", "--tokens-seen", "1000")
    extract(tmp_path / "a", "gpt_neox")
    line = fit(tmp_path / "a")
    assert "no training tokens recorded" in line and "@main" in line
    extract(tmp_path / "b", "gpt_neox", "--revision", "step2", "--tokens-seen", "2000")
    points = law.model_losses(law.Store(str(tmp_path / "b")), "docs")
    assert points.height == 2 and (points["loss"] > 0).all()
    assert sorted(points["tokens"].to_list()) == [1000.0, 2000.0]
    assert points["depth"].to_list() == [2.0, 2.0] and points["width"].to_list() == [32.0, 32.0]
    assert f"give at least {law.MIN_POINTS} points" in fit(tmp_path / "b")
