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
  axes, l = 1..L (block index + 1): ``a``, ``beta``, ``beta_se``, ``r2``, ``n_fitted``.
- ``text_depth_score`` (partitions extracted with ``--skips``): per (model, task, sublayer,
  group): ``n_documents``, the mean and standard deviation of the per-document depth score
  sum_l l out_change(l) / sum_l out_change(l) (l the skipped block, 0-based; out_change(l) of a
  document the maximum over its split points) and ``relative_depth_score`` = (mean + 1) / L;
  ``group`` is the documents' ``group`` column (the task's ``group_field``, null when it has none).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.markdown import DASH, fmt, markdown_table
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    register,
    with_data,
)
from layerdiv.analyze.stats import POWER_FIT_SCHEMA, power_law_fit
from layerdiv.analyze.text import (
    EARLY_STOP_FRACTION,
    TEXT_KIND,
    ProfileMoments,
    batches,
    combine,
    sums,
    tag,
    text_passes,
    with_table,
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


def update_fit(geometry: pl.DataFrame) -> pl.DataFrame:
    """``text_update_fit``: per (model, task, metric), mean update size of block l = a * l^(-beta)
    on log-log axes (methods §9), l = block + 1."""
    rows = []
    for key, sub in geometry.sort("block").group_by(*KEY, maintain_order=True):
        depth = sub["block"].to_numpy().astype(float) + 1
        for metric in FIT_METRICS:
            fit = power_law_fit(depth, sub[f"{metric}_mean"].cast(pl.Float64).to_numpy())
            rows.append({**dict(zip(KEY, key, strict=True)), "metric": metric, **fit})
    schema = {**dict.fromkeys(KEY, pl.String), "metric": pl.String, **POWER_FIT_SCHEMA}
    return pl.DataFrame(rows, schema=schema).sort(*KEY, "metric")


def depth_scores(out_max: pl.DataFrame) -> pl.DataFrame:
    """Per (sublayer, doc) from per (sublayer, doc, skipped) maxima over split points of
    out_change: the depth score sum_l l out_change(l) / sum_l out_change(l) (methods §9)."""
    block, change = pl.col("skipped").cast(pl.Float64), pl.col("out_change_max")
    return out_max.group_by("sublayer", "doc").agg(  # sum_l l out_change(l) / sum_l out_change(l)
        ((block * change).sum() / change.sum()).alias("depth_score")
    )


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
    result["text_update_fit"] = update_fit(prior["text_geometry"])
    with_skips = with_table(ctx.parts, "future_output")
    scores = with_data(depth_score_table, with_skips, ctx.notes, "text_depth_score")
    if scores:
        result["text_depth_score"] = pl.concat(scores)
    return result


# --- report ----------------------------------------------------------------------------------


def profiles_figure(tables: Mapping[str, pl.DataFrame], path: Path, names: dict[str, str]) -> Path:
    """The mean theta_state profile with the first two principal components (mean ± 2 sd along
    each), the share of early-stopping tokens by position, and the update-size fits on log-log
    axes; models overlaid (first task of each model for the PCA)."""
    loadings = tables["text_profile_loadings"]
    pca = tables["text_profile_pca"]
    early = tables["text_early_stop"]
    geometry = tables["text_geometry"]
    fits = tables["text_update_fit"].filter(pl.col("metric") == "theta_state")
    models = sorted(loadings["model"].unique())
    colors = dict(zip(models, plots.colors(len(models)), strict=False))
    fig = plots.new_figure(figsize=(13, 4.2), layout="constrained")
    ax_pca, ax_early, ax_fit = fig.subplots(1, 3)
    for model in models:
        color, label = colors[model], names.get(model, model)
        task = sorted(loadings.filter(pl.col("model") == model)["task"].unique())[0]
        mine = loadings.filter((pl.col("model") == model) & (pl.col("task") == task))
        variances = pca.filter((pl.col("model") == model) & (pl.col("task") == task))
        first = mine.filter(pl.col("component") == 1)
        x, mean = first["relative_depth"].to_numpy(), first["mean_theta"].to_numpy()
        ax_pca.plot(x, mean, color=color, label=f"{label} mean")
        for k, style in ((1, "--"), (2, ":")):
            comp = mine.filter(pl.col("component") == k)
            var = variances.filter(pl.col("component") == k)
            if not comp.height or not var.height:
                continue
            sd = float(np.sqrt(var["explained_variance"][0]))
            ratio = var["explained_ratio"][0]
            ax_pca.plot(
                x,
                mean + 2 * sd * comp["loading"].to_numpy(),
                style,
                color=color,
                label=f"{label} +2 sd PC{k} ({fmt(ratio, 100)}%)",
            )
        shares = (
            early.filter(pl.col("model") == model)
            .group_by("position_from")
            .agg(pl.col("n_early").sum() / pl.col("n_tokens").sum())
            .sort("position_from")
        )
        ax_early.plot(
            shares["position_from"] + 1, shares["n_early"], marker="o", color=color, label=label
        )
        blocks = (
            geometry.filter(pl.col("model") == model)
            .group_by("block")
            .agg(pl.col("theta_state_mean").mean())
            .sort("block")
        )
        depth = blocks["block"].to_numpy() + 1
        ax_fit.loglog(
            depth, blocks["theta_state_mean"], "o", markersize=3, color=color, label=label
        )
        fit = fits.filter(pl.col("model") == model)
        if fit.height and fit["beta"][0] is not None:
            ax_fit.loglog(
                depth,
                fit["a"][0] * depth ** (-fit["beta"][0]),
                "--",
                color=color,
                label=f"β = {fit['beta'][0]:.2f} ± {fit['beta_se'][0]:.2f}",
            )
    ax_pca.set_title("θ(h_l, h_l+1) profiles: mean and principal components", fontsize=10)
    ax_pca.set_xlabel("relative depth (l + 1) / L")
    ax_pca.set_ylabel("degrees")
    ax_early.set_xscale("log", base=2)
    ax_early.set_title("Share of tokens that stop updating early", fontsize=10)
    ax_early.set_xlabel("position + 1 (ranges 2^k)")
    ax_fit.set_title("Mean θ(h_l, h_l+1) against block l (dashed: a·l^−β)", fontsize=10)
    ax_fit.set_xlabel("block l")
    for ax in (ax_pca, ax_early, ax_fit):
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=6)
    fig.suptitle("Running text: update profiles (methods §9, inverse-depth paper Fig. 2)")
    return plots.save(fig, path)


def depth_score_figure(table: pl.DataFrame, path: Path, names: dict[str, str]) -> Path:
    """Mean relative depth score per document group (whole blocks skipped), a bar per model."""
    rows = table.filter(pl.col("sublayer") == "block").with_columns(
        pl.col("group").fill_null("all")
    )
    groups = sorted(rows["group"].unique())
    models = sorted(rows["model"].unique())
    colors = plots.colors(len(models))
    fig = plots.new_figure(figsize=(max(5, 1.2 * len(groups) + 3), 4), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(models)
    for i, model in enumerate(models):
        sub = (
            rows.filter(pl.col("model") == model)
            .group_by("group")
            .agg(pl.col("relative_depth_score").mean())
        )
        value = dict(sub.iter_rows())
        ax.bar(
            np.arange(len(groups)) + i * width,
            [value.get(g, np.nan) for g in groups],
            width,
            color=colors[i],
            label=names.get(model, model),
        )
    ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, groups)
    ax.set_xlabel("document group")
    ax.set_ylabel("relative depth score (l + 1) / L")
    ax.set_title("Where skipping a block changes the output, by document group", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return plots.save(fig, path)


def report(ctx: ReportContext) -> str:
    """The profiles section: the PCA and fit table, the profile figure and the depth scores."""
    tables = ctx.tables
    names = plots.short_names(ctx.names)
    pca, fits, early = (
        tables["text_profile_pca"],
        tables["text_update_fit"],
        tables["text_early_stop"],
    )
    rows = []
    for _key, sub in pca.group_by(*KEY, maintain_order=True):
        model, task = sub["model"][0], sub["task"][0]
        ratios = sub.sort("component")["explained_ratio"].to_list()
        fit = fits.join(sub.select(*KEY).head(1), on=[*KEY], how="semi").filter(
            pl.col("metric") == "theta_state"
        )
        stops = early.join(sub.select(*KEY).head(1), on=[*KEY], how="semi")
        share = int(stops["n_early"].sum()) / max(int(stops["n_tokens"].sum()), 1)
        beta = (
            f"{fmt(fit['beta'][0], digits=2)} ± {fmt(fit['beta_se'][0], digits=2)}"
            if fit.height
            else DASH
        )
        rows.append(
            [
                ctx.names.get(str(model), str(model)),
                str(task),
                " / ".join(fmt(r, 100) for r in ratios[:3]),
                fmt(share, 100, digits=2),
                beta,
            ]
        )
    header = ["Model", "Task", "Explained by PC1 / PC2 / PC3 (%)", "Stop early (%)", "β of θ state"]
    parts = [
        "Each token's profile of θ(h_l, h_l+1) over the blocks (methods §9): principal "
        "components over tokens, the share of tokens that stop updating early (their mean θ over "
        "the second half of the blocks, last block left out, below "
        f"{EARLY_STOP_FRACTION:g} of their own mean over the first half, block 0 left out) and "
        "the fit of the mean θ of block l to a·l^−β.",
        markdown_table(header, rows),
        plots.figure_link(
            ctx,
            "text_profiles.png",
            "Update profiles",
            lambda p: profiles_figure(tables, p, names),
        ),
    ]
    if "text_depth_score" in tables:
        scores = tables["text_depth_score"].filter(pl.col("sublayer") == "block")
        parts += [
            "Depth score of a document, sum_l l·out_change(l) / sum_l out_change(l) over the "
            "skipped blocks l (`--skips`, whole blocks, out_change the maximum over its split "
            "points), as a relative depth, by the task's document group.",
            markdown_table(
                ["Model", "Task", "Group", "Documents", "Depth score", "Relative"],
                [
                    [
                        ctx.names.get(r["model"], r["model"]),
                        r["task"],
                        r["group"] or "all",
                        str(r["n_documents"]),
                        f"{fmt(r['depth_score'], digits=2)} "
                        f"± {fmt(r['depth_score_std'], digits=2)}",
                        fmt(r["relative_depth_score"], digits=3),
                    ]
                    for r in scores.iter_rows(named=True)
                ],
            ),
            plots.figure_link(
                ctx,
                "text_depth_score.png",
                "Depth score by group",
                lambda p: depth_score_figure(tables["text_depth_score"], p, names),
            ),
        ]
    return "\n\n".join(p for p in parts if p)


register(
    Analysis(
        name="text_profiles",
        title="Running text: update profiles and depth scores",
        methods=(9,),
        tables=tables,
        report=report,
        kinds=(TEXT_KIND,),
    )
)
