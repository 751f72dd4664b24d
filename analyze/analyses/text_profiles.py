"""Running text, profiles and depth (methods §9; the inverse-depth paper's Fig. 2 and the
depth-efficiency paper's depth score).

Tables:

- ``text_profile_pca``: per (model, task, principal component k = 1..5) of the tokens' theta_state
  profiles (each token's vector (theta_state_l)_l over blocks, degrees): ``explained_variance``,
  ``explained_ratio`` and ``cumulative_ratio``. The covariance is accumulated batch by batch (the
  sum of the profiles and of their outer products), never from a table of every token.
- ``text_profile_loadings``: per (model, task, component k, block l): ``loading`` (unit vector,
  signed so that its largest entry is positive) and ``mean_theta`` (the mean profile), with
  ``relative_depth`` (l + 1) / L.
- ``text_early_stop``: per (model, task, position range): ``n_tokens``, ``n_early`` and
  ``share_early``, the tokens that stop updating early
  (:class:`~layerdiv.analyze.text.ProfileMoments`). Position ranges 0, 1, 2-3, 4-7, ... show where
  in a document they are (the inverse-depth paper: mostly the first tokens).
- ``text_update_fit``: per (model, task, metric): the mean update size of block l (token-weighted
  mean ``theta_state`` or ``layer_rel`` of ``text_geometry``) fitted as a * l^(-beta) on log-log
  axes, l = 1..L (block index + 1): ``a``, ``beta``, ``beta_se``, ``r2``, ``n_fitted``, and
  beta's bootstrap interval over documents (``beta_low``, ``beta_high``, ``n_units``: the
  documents resampled and the token-weighted mean profile refitted, never the blocks).
- ``text_depth_score`` (partitions extracted with ``--skips``): per (model, task, sublayer,
  group): ``n_documents``, the mean and standard deviation of the per-document depth score
  sum_l l out_change(l) / sum_l out_change(l) (l the skipped block, 0-based; out_change(l) of a
  document the maximum over its split points) and ``relative_depth_score`` = (mean + 1) / L;
  ``group`` is the documents' ``group`` column (the task's ``group_field``, null when it has none).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.analyses.depth import decay_verdict
from layerdiv.analyze.frames import tag, with_table
from layerdiv.analyze.markdown import DASH, fmt, markdown_table
from layerdiv.analyze.overlap import independent, one_verdict
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    with_data,
)
from layerdiv.analyze.stats import (
    POWER_FIT_SCHEMA,
    depth_score,
    power_law_fit,
    resampled_power_law,
)
from layerdiv.analyze.text import (
    EARLY_STOP_FRACTION,
    TEXT_KIND,
    DocumentSums,
    ProfileMoments,
    batches,
    combine,
    sums,
    text_passes,
)
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

PCA_COMPONENTS = 5
"""Principal components of the theta_state profiles kept per partition."""

FIT_METRICS = ("theta_state", "layer_rel")
"""Update sizes fitted against depth (methods §9)."""

OUTPUT_ROWS = 1 << 20
"""Rows of ``future_output`` read at once."""


def pca_tables(moments: ProfileMoments) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``text_profile_pca`` and ``text_profile_loadings`` rows of one partition (untagged)."""
    mean, variances, components = moments.pca()
    blocks, k = len(mean), min(PCA_COMPONENTS, len(mean))
    ratio = variances / variances.sum() if variances.sum() > 0 else np.full_like(variances, np.nan)
    pca = pl.DataFrame(
        {
            "component": np.arange(1, k + 1, dtype=np.int16),
            "n_tokens": np.full(k, moments.n),
            "explained_variance": variances[:k],
            "explained_ratio": ratio[:k],
            "cumulative_ratio": np.cumsum(ratio)[:k],
        }
    )
    loadings = pl.DataFrame(
        {
            "component": np.repeat(np.arange(1, k + 1, dtype=np.int16), blocks),
            "block": np.tile(np.arange(blocks, dtype=np.int16), k),
            "relative_depth": np.tile(np.arange(1, blocks + 1) / blocks, k),
            "loading": components[:k].reshape(-1),
            "mean_theta": np.tile(mean, k),
        }
    )
    return pca, loadings


def early_table(moments: ProfileMoments) -> pl.DataFrame:
    """``text_early_stop`` rows of one partition (untagged)."""
    ranges = sorted(moments.early)
    counts = [moments.early[r] for r in ranges]
    return pl.DataFrame(
        {
            "position_from": [0 if r == 0 else 2 ** (r - 1) for r in ranges],
            "position_to": [0 if r == 0 else 2**r - 1 for r in ranges],
            "n_tokens": [n for n, _ in counts],
            "n_early": [k for _, k in counts],
        },
        schema={
            "position_from": pl.Int64,
            "position_to": pl.Int64,
            "n_tokens": pl.Int64,
            "n_early": pl.Int64,
        },
    ).with_columns((pl.col("n_early") / pl.col("n_tokens")).alias("share_early"))


def fit_intervals(info: PartitionInfo, documents: DocumentSums) -> pl.DataFrame:
    """Per metric of :data:`FIT_METRICS`: beta's bootstrap interval over the partition's
    documents (``beta_low``, ``beta_high``) and the documents counted (``n_units``)."""
    rows = []
    for metric in FIT_METRICS:
        totals, counts = documents.column(metric)
        depth = np.arange(1, documents.blocks + 1, dtype=float)
        (low, high), n = resampled_power_law(depth, totals, counts)
        rows.append({"metric": metric, "beta_low": low, "beta_high": high, "n_units": n})
    schema = {"metric": pl.String, "beta_low": pl.Float64, "beta_high": pl.Float64,
              "n_units": pl.Int64}  # fmt: skip
    return tag(pl.DataFrame(rows, schema=schema), info)


def update_fit(geometry: pl.DataFrame, intervals: pl.DataFrame | None = None) -> pl.DataFrame:
    """``text_update_fit``: per (model, task, metric), mean update size of block l = a * l^(-beta)
    on log-log axes (methods §9), l = block + 1, with beta's interval over documents from
    ``intervals`` (of :func:`fit_intervals`) where given."""
    rows = []
    for key, sub in geometry.sort("block").group_by(*KEY, maintain_order=True):
        depth = sub["block"].to_numpy().astype(float) + 1
        for metric in FIT_METRICS:
            fit = power_law_fit(depth, sub[f"{metric}_mean"].cast(pl.Float64).to_numpy())
            rows.append({**dict(zip(KEY, key, strict=True)), "metric": metric, **fit})
    schema = {**dict.fromkeys(KEY, pl.String), "metric": pl.String, **POWER_FIT_SCHEMA}
    fits = pl.DataFrame(rows, schema=schema)
    if intervals is not None:
        fits = fits.join(intervals, on=[*KEY, "metric"], how="left")
    return fits.sort(*KEY, "metric")


def depth_scores(out_max: pl.DataFrame) -> pl.DataFrame:
    """Per (sublayer, doc) from per (sublayer, doc, skipped) maxima over split points of
    out_change: the depth score sum_l l out_change(l) / sum_l out_change(l) (methods §10,
    ``layerdiv.analyze.stats.depth_score``; a block not skipped counts 0)."""
    index = out_max.select("sublayer", "doc").unique(maintain_order=True).with_row_index("row")
    rows = out_max.join(index, on=["sublayer", "doc"])
    row, skipped = rows["row"].to_numpy(), rows["skipped"].to_numpy()
    profiles = np.zeros((index.height, int(skipped.max(initial=0)) + 1))
    profiles[row, skipped] = rows["out_change_max"].to_numpy()
    return index.drop("row").with_columns(pl.Series("depth_score", depth_score(profiles)))


def depth_score_table(info: PartitionInfo) -> pl.DataFrame:
    """``text_depth_score`` of one partition, its ``future_output`` read batch by batch."""
    keys = ["sublayer", "doc", "skipped"]
    frames = batches(info, "future_output", [*keys, "out_change"], OUTPUT_ROWS)
    out_max = combine(
        (
            sums(f.with_columns(pl.col("sublayer").cast(pl.String)), keys, ["out_change"])
            for f in frames
        ),
        keys,
        ["out_change"],
    )
    groups = info.scan("documents").select("doc", "group").collect()
    return tag(
        depth_scores(out_max)
        .join(groups, on="doc", how="left")
        .group_by("sublayer", "group")
        .agg(
            pl.len().alias("n_documents"),
            pl.col("depth_score").mean(),
            pl.col("depth_score").std().alias("depth_score_std"),
        )
        .with_columns(
            ((pl.col("depth_score") + 1) / info.manifest.n_blocks).alias("relative_depth_score")
        )
        .sort("sublayer", "group", nulls_last=True),
        info,
    )


def profile_tables(info: PartitionInfo, moments: ProfileMoments) -> dict[str, pl.DataFrame]:
    """The PCA, loadings and early-stop rows of one partition from its accumulated moments."""
    pca, loadings = pca_tables(moments)
    return {
        "text_profile_pca": tag(pca, info),
        "text_profile_loadings": tag(loadings, info),
        "text_early_stop": tag(early_table(moments), info),
    }


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point (after ``text_geometry``, whose table and pass over the tokens
    it uses: :func:`~layerdiv.analyze.text.text_passes`)."""
    passes = text_passes(ctx)
    found: dict[str, list[pl.DataFrame]] = {}
    for info in ctx.parts:
        for name, frame in profile_tables(info, passes[info.where].moments).items():
            found.setdefault(name, []).append(frame)
    result = {name: pl.concat(frames) for name, frames in found.items()}
    intervals = pl.concat([fit_intervals(p, passes[p.where].documents) for p in ctx.parts])
    result["text_update_fit"] = update_fit(prior["text_geometry"], intervals)
    with_skips = with_table(ctx.parts, "future_output")
    scores = with_data(depth_score_table, with_skips, ctx.notes, "text_depth_score")
    if scores:
        result["text_depth_score"] = pl.concat(scores)
    return result


# --- report ----------------------------------------------------------------------------------


def profiles_spec(tables: Mapping[str, pl.DataFrame], names: dict[str, str]) -> plots.Figure:
    """The mean theta_state profile with the first two principal components (mean ± 2 sd along
    each), the share of early-stopping tokens by position, and the update-size fits on log-log
    axes (β, its s.e. and R² in the notes); models overlaid (first task of each model for the
    PCA)."""
    loadings = tables["text_profile_loadings"]
    pca = tables["text_profile_pca"]
    early = independent(tables["text_early_stop"], tables["manifests"])  # pooled over tasks
    geometry = independent(tables["text_geometry"], tables["manifests"])
    fits = tables["text_update_fit"].filter(pl.col("metric") == "theta_state")
    ax_pca = plots.Panel(
        "θ(h_l, h_l+1) profiles: mean and principal components",
        xlabel="relative depth (l + 1) / L",
        ylabel="degrees",
    )
    ax_early = plots.Panel(
        "Share of tokens that stop updating early",
        xlabel="position + 1 (ranges 2^k)",
        ylabel="share of tokens",
        xscale="log2",
    )
    ax_fit = plots.Panel(
        "Mean θ(h_l, h_l+1) against block l (dashed: a·l^−β)",
        xlabel="block l",
        ylabel="degrees",
        xscale="log",
        yscale="log",
    )
    for model, color in plots.model_colors(sorted(loadings["model"].unique())).items():
        label = names.get(model, model)
        task = sorted(loadings.filter(pl.col("model") == model)["task"].unique())[0]
        mine = loadings.filter((pl.col("model") == model) & (pl.col("task") == task))
        variances = pca.filter((pl.col("model") == model) & (pl.col("task") == task))
        first = mine.filter(pl.col("component") == 1)
        x, mean = first["relative_depth"].to_numpy(), first["mean_theta"].to_numpy()
        ax_pca.series.append(
            plots.Series(
                f"{label} mean profile", x.tolist(), mean.tolist(), color=color, marker=None
            )
        )
        pcs: tuple[tuple[int, plots.Dash], ...] = ((1, "dash"), (2, "dot"))
        for k, dash in pcs:
            comp = mine.filter(pl.col("component") == k)
            var = variances.filter(pl.col("component") == k)
            if not comp.height or not var.height:
                continue
            sd = float(np.sqrt(var["explained_variance"][0]))
            ax_pca.series.append(
                plots.Series(
                    f"{label} +2 sd PC{k} ({fmt(var['explained_ratio'][0], 100)}%)",
                    x.tolist(),
                    (mean + 2 * sd * comp["loading"].to_numpy()).tolist(),
                    color=color,
                    dash=dash,
                    marker=None,
                )
            )
        shares = (
            early.filter(pl.col("model") == model)
            .group_by("position_from")
            .agg(pl.col("n_early").sum() / pl.col("n_tokens").sum())
            .sort("position_from")
        )
        ax_early.series.append(
            plots.Series(
                f"{label} share stopping early",
                (shares["position_from"] + 1).to_list(),
                shares["n_early"].to_list(),
                color=color,
                marker="s",
            )
        )
        blocks = (
            geometry.filter(pl.col("model") == model)
            .group_by("block")
            .agg(pl.col("theta_state_mean").mean())
            .sort("block")
        )
        depth = blocks["block"].to_numpy() + 1
        per_block = f"{label} mean θ of block l"
        ax_fit.series.append(
            plots.Series(
                per_block,
                depth.tolist(),
                blocks["theta_state_mean"].to_list(),
                color=color,
                line=False,
                marker="^",
            )
        )
        fit = fits.filter(pl.col("model") == model)
        plots.power_law_overlay(ax_fit, per_block, depth.tolist(), fit, label, color)
    return plots.Figure(
        "Running text: update profiles (methods §9, inverse-depth paper Fig. 2)",
        [ax_pca, ax_early, ax_fit],
        cols=3,
        panel_size=(4.6, 3.8),
        caption=f"poor fit: R² < {plots.POOR_FIT_R2:g}",
    )


def report(ctx: ReportContext) -> str:
    """The profiles section: the PCA and fit table, the profile figure and the depth scores."""
    tables = ctx.tables
    names = plots.short_names(ctx.names)
    pca, fits, early = (
        tables["text_profile_pca"],
        tables["text_update_fit"],
        tables["text_early_stop"],
    )
    rows, verdicts = [], []
    judged, overlap = one_verdict(fits, tables["manifests"])
    for _key, sub in pca.group_by(*KEY, maintain_order=True):
        model, task = sub["model"][0], sub["task"][0]
        ratios = sub.sort("component")["explained_ratio"].to_list()
        fit = fits.join(sub.select(*KEY).head(1), on=[*KEY], how="semi").filter(
            pl.col("metric") == "theta_state"
        )
        stops = early.join(sub.select(*KEY).head(1), on=[*KEY], how="semi")
        sink = pl.col("position_from") == 0  # the first token: an attention sink

        def share(where: pl.Expr, stops: pl.DataFrame = stops) -> float | None:
            n = stops.filter(where).select(pl.col("n_early", "n_tokens").sum())
            return n["n_early"][0] / n["n_tokens"][0] if n["n_tokens"][0] else None

        beta = (
            plots.fit_note("", fit["beta"][0], fit["beta_se"][0], fit["r2"][0])
            if fit.height
            else ""
        ) or DASH
        if fit.join(judged, on=[*KEY, "metric"], how="semi").height:
            who = f"{ctx.names.get(str(model), str(model))}, {task}"
            finding = f"{who}: the mean update θ(h_l, h_l+1) falls roughly as 1/l"
            verdicts.append("- " + decay_verdict(finding, fit.row(0, named=True), "documents"))
        rows.append(
            [
                ctx.names.get(str(model), str(model)),
                str(task),
                " / ".join(fmt(r, 100) for r in ratios[:3]),
                fmt(share(~sink), 100, digits=2),
                fmt(share(sink), 100, digits=2),
                beta,
            ]
        )
    header = [
        "Model",
        "Task",
        "Explained by PC1 / PC2 / PC3 (%)",
        "Stop early, positions ≥ 1 (%)",
        "Stop early, position 0 (%)",
        "β of θ state (R²)",
    ]
    parts = [
        "Each token's profile of θ(h_l, h_l+1) over the blocks (methods §9): principal "
        "components over tokens, the share of tokens that stop updating early (their mean θ over "
        "the second half of the blocks, last block left out, below "
        f"{EARLY_STOP_FRACTION:g} of their own mean over the first half, block 0 left out) and "
        "the fit of the mean θ of block l to a·l^−β. The first token of a document (position 0) "
        "is an attention sink: its share is given apart from that of every other position.",
        markdown_table(header, rows),
        "\n".join([*verdicts, *([overlap] if overlap else [])]),
        plots.figure_link(
            ctx,
            "text_profiles.png",
            "Update profiles",
            lambda: profiles_spec(tables, names),
        ),
    ]
    return "\n\n".join(p for p in parts if p)


ANALYSIS = Analysis(
    name="text_profiles",
    title="Running text: update profiles and depth scores",
    methods=(9,),
    tables=tables,
    report=report,
    kinds=(TEXT_KIND,),
    after=("text_geometry",),
    order=110,
)
