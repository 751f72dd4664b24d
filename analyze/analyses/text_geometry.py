"""Running text, geometry of the residual stream (methods §9): per (model, task, block),
token-weighted means and maxima of every per-token quantity, from the stored dot products.

Table ``text_geometry``: per (model, task, block l = 0..L-1): ``relative_depth`` (l + 1) / L,
``n_tokens``, and for each of attn_rel, mlp_rel, layer_rel, cos_attn, cos_mlp, cos_layer, cos_io,
theta_state, theta_update, angle_final and proj (the progress <h_l - h_0, h_L - h_0> /
||h_L - h_0||^2, methods §10; null for stores without ``h_embed``)
(:data:`~layerdiv.analyze.text.GEOMETRY`) its mean
``<c>_mean`` (the sum over every token of every document divided by the token count, as the
depth-efficiency paper's code does; a token where the quantity is undefined, e.g. a cosine of a
zero vector, is left out of its count) and its maximum ``<c>_max``. Angles are in degrees.
"""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import by_model, tag
from layerdiv.analyze.markdown import fmt, markdown_table
from layerdiv.analyze.overlap import independent
from layerdiv.analyze.registry import Analysis, Context, ReportContext
from layerdiv.analyze.text import TEXT_KIND, BlockStats, text_passes, text_vs_last_token
from layerdiv.store.key import KEY


def geometry_table(stats: BlockStats, blocks: int) -> pl.DataFrame:
    """Per block, from the sums over every batch of tokens: ``relative_depth``, ``n_tokens``,
    ``<c>_mean`` (token-weighted: sum over every token / token count, methods §9) and
    ``<c>_max`` of every geometry column."""
    return (
        stats.table()
        .rename({"n": "n_tokens"})
        .with_columns(
            pl.col("block").cast(pl.Int16),
            ((pl.col("block") + 1) / blocks).alias("relative_depth"),
        )
        .select("block", "relative_depth", pl.exclude("block", "relative_depth"))
    )


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: ``text_geometry`` of every selected text partition, from one
    pass over its tokens (:func:`~layerdiv.analyze.text.text_passes`)."""
    passes = text_passes(ctx)
    frames = [tag(geometry_table(passes[p.where].stats, p.manifest.n_blocks), p) for p in ctx.parts]
    return {"text_geometry": pl.concat(frames)}


# --- report ----------------------------------------------------------------------------------

PANELS = (
    ("attn_rel", "||a|| / ||h||"),
    ("mlp_rel", "||m|| / ||h + a||"),
    ("layer_rel", "||a + m|| / ||h||"),
    ("cos_layer", "cos(a + m, h)"),
    ("theta_state", "θ(h_l, h_l+1) (°)"),
    ("theta_update", "θ(d_l, d_l+1) (°)"),
    ("proj", "progress proj_l (0: h_0, 1: h_L)"),
)
"""The geometry figure's panels: column and axis label (``proj``: methods §10)."""


def geometry_spec(
    table: pl.DataFrame, manifests: pl.DataFrame, names: dict[str, str]
) -> plots.Figure:
    """Seven panels of token-weighted means (solid) and maxima (dotted, sizes only) against relative
    depth, models overlaid; sizes on a log axis, angles in plain degrees with 90° marked."""
    columns = [f"{c}_mean" for c, _ in PANELS] + [f"{c}_max" for c, _ in PANELS[:3]]
    means = by_model(table, manifests, ["block", "relative_depth"], columns, weight="n_tokens")
    panels = []
    for column, label in PANELS:
        panel = plots.Panel(
            label,
            xlabel="relative depth (l + 1) / L",
            yscale="log" if column.endswith("_rel") else "linear",
        )
        if column.startswith("theta"):
            panel.lines.append(plots.RefLine(90, label="90°"))
        for model, color in plots.model_colors(sorted(means["model"].unique())).items():
            sub, name = means.filter(pl.col("model") == model), names.get(model, model)
            x = sub["relative_depth"].to_list()
            panel.series.append(plots.Series(name, x, sub[f"{column}_mean"].to_list(), color=color))
            if f"{column}_max" in columns:
                panel.series.append(
                    plots.Series(
                        f"{name} maximum",
                        x,
                        sub[f"{column}_max"].to_list(),
                        color=color,
                        dash="dot",
                        marker=None,
                    )
                )
        panels.append(panel)
    return plots.Figure(
        "Running text: token-weighted means over every token (dotted: maxima), methods §9",
        panels,
        cols=4,
        panel_size=(4.4, 3.4),
    )


SIDE_BY_SIDE = (
    ("layer_rel_mean", "rel_contribution", "||a + m|| / ||h||"),
    ("theta_state_mean", "angle_deg", "θ(h_l, h_l+1) (°)"),
    ("cos_layer_mean", "cos_residual", "cos(a + m, h)"),
)
"""(running-text column, last-token column of ``geometry_blocks``, label): the same quantity at
every token and at the last prompt token of a choice task (methods §9, §7)."""


def side_by_side(tables: Mapping[str, pl.DataFrame]) -> pl.DataFrame | None:
    """Per (model, block) of the models that have both kinds of partition: each
    :data:`SIDE_BY_SIDE` quantity over running text and at the last prompt token (means over
    tasks); None when no model has both."""
    if "geometry_blocks" not in tables:
        return None
    manifests = tables["manifests"]
    text = by_model(
        tables["text_geometry"],
        manifests,
        ["block", "relative_depth"],
        [c for c, _, _ in SIDE_BY_SIDE],
        weight="n_tokens",
    )
    last = (
        independent(tables["geometry_blocks"], manifests)
        .with_columns((pl.col("block") - 1).cast(pl.Int16))
        .group_by("model", "block")
        .agg(pl.col(c).mean().alias(f"{c}_last") for _, c, _ in SIDE_BY_SIDE)
    )
    both = text.join(last, on=["model", "block"], how="inner").sort("model", "block")
    return both if both.height else None


def side_by_side_spec(both: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """Running text (solid) against the last prompt token (dashed) per quantity and model."""
    spec = text_vs_last_token(
        [(text, f"{last}_last", label) for text, last, label in SIDE_BY_SIDE],
        both,
        both,
        names,
        "relative depth (l + 1) / L",
        "Every token of running text (solid) against the last prompt token of the choice tasks "
        "(dashed)",
    )
    spec.caption = "where the answer is decided against the average token"
    for panel, (column, _, _) in zip(spec.panels, SIDE_BY_SIDE, strict=True):
        if column.startswith("layer_rel"):  # a ratio, block 0's tens of times the others'
            panel.yscale = "log"
    return spec


def summary_rows(table: pl.DataFrame, names: dict[str, str]) -> list[list[str]]:
    """Per (model, task): tokens, and the token-weighted mean over blocks of the first half /
    second half of the stack of attn_rel, mlp_rel, theta_state and theta_update, and of the first
    half without block 0 (the embedding is small, so block 0's relative sizes are large)."""
    second = pl.col("relative_depth") > 0.5
    columns = ("attn_rel_mean", "mlp_rel_mean", "theta_state_mean", "theta_update_mean")
    halves = (
        table.group_by(*KEY)
        .agg(
            pl.col("n_tokens").first(),
            *(pl.col(c).filter(~second).mean().alias(f"{c}_1") for c in columns),
            *(pl.col(c).filter(second).mean().alias(f"{c}_2") for c in columns),
            *(
                pl.col(c).filter(~second & (pl.col("block") > 0)).mean().alias(f"{c}_1x")
                for c in columns
            ),
        )
        .sort(*KEY)
    )
    return [
        [
            names.get(r["model"], r["model"]),
            r["task"],
            str(r["n_tokens"]),
            *(
                f"{fmt(r[f'{c}_1'], digits=3)} / {fmt(r[f'{c}_2'], digits=3)} "
                f"({fmt(r[f'{c}_1x'], digits=3)})"
                for c in columns
            ),
        ]
        for r in halves.iter_rows(named=True)
    ]


def report(ctx: ReportContext) -> str:
    """The running-text geometry section: a summary table, the geometry figure and, for models
    with choice tasks too, running text against the last prompt token."""
    table = ctx.tables["text_geometry"]
    names = plots.short_names(ctx.names)
    header = [
        "Model",
        "Task",
        "Tokens",
        "attn_rel 1st / 2nd half (1st w/o block 0)",
        "mlp_rel 1st / 2nd half (1st w/o block 0)",
        "θ state 1st / 2nd half (°) (1st w/o block 0)",
        "θ update 1st / 2nd half (°) (1st w/o block 0)",
    ]
    parts = [
        "Every token of every document (methods §9): h is a block's input, a what its "
        "attention adds to the residual stream, m what its MLP adds. Means are token-weighted "
        "(sum over every token of every document / token count, as the depth-efficiency paper's "
        "code), halves split the blocks at relative depth 1/2 (in brackets: the first half without "
        "block 0, whose relative sizes are large because the embedding is small). θ update near "
        "90° means consecutive updates are uncorrelated.",
        markdown_table(header, summary_rows(table, ctx.names)),
        plots.figure_link(
            ctx,
            "text_geometry.png",
            "Running-text geometry",
            lambda: geometry_spec(table, ctx.tables["manifests"], names),
        ),
    ]
    both = side_by_side(ctx.tables)
    if both is not None:
        parts += [
            "The same model on running text and at the last prompt token of its choice tasks "
            "(the `geometry_blocks` table of methods §7): where the answer is decided against the "
            "average token.",
            plots.figure_link(
                ctx,
                "text_vs_last_token.png",
                "Running text against the last prompt token",
                lambda: side_by_side_spec(both, names),
            ),
        ]
    return "\n\n".join(p for p in parts if p)


ANALYSIS = Analysis(
    name="text_geometry",
    title="Running text: geometry of the residual stream",
    methods=(9, 7),
    tables=tables,
    report=report,
    kinds=(TEXT_KIND,),
    order=80,
)
