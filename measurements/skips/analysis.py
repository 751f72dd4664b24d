"""The layer-skip effects of ``extract --skips`` at the last prompt token (methods §7), from the
cache alone.

Table ``skip_effects`` (one row per model, task and skipped block b): accuracy without b, the KL
divergence over the options, and the total, direct and indirect effects TE = DE + IE. Table
``skip_halves`` (one row per model, task and instance): the instance's mean KL over the skips of
the first half's blocks ((b + 1) / L <= 0.5, ``kl_first``) and of the second half's
(``kl_second``), and their difference: the unit the verdict resamples (instances are independent,
blocks of one instance are not).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import by_model, listing, selected, tag
from layerdiv.analyze.markdown import fmt, markdown_table, verdict
from layerdiv.analyze.overlap import lone_subsets, one_verdict
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
    partition_engine,
)
from layerdiv.analyze.stats import MIN_INTERVAL_N, unit_mean
from layerdiv.errors import LayerdivError
from layerdiv.store import PartitionInfo, Store
from layerdiv.store.key import KEY

SKIP_COLUMNS = (
    "accuracy_without",
    "kl",
    "total_effect",
    "direct_effect",
    "indirect_effect",
    "indirect_share",
)
"""Per-block skip effects (``extract --skips``)."""


class SkipsError(LayerdivError, ValueError):
    """Skip effects were asked for partitions extracted without ``--skips``."""


def _log_softmax(logit: str, by: list[str]) -> pl.Expr:
    top = pl.col(logit).max().over(by)
    return pl.col(logit) - top - (pl.col(logit) - top).exp().sum().over(by).log()


def skip_rows(info: PartitionInfo) -> pl.DataFrame:
    """Per (instance, skipped block b): whether the model is still right without b, the KL
    divergence sum_k p_k log(p_k / q_k) of q = softmax(skip_logits_b) from p = softmax(logits), and
    the means over options of |TE|, |DE| and |IE| (methods §7): TE_b = logits -
    skip_logits_b, DE_b = sum over b's components (every call) of u_c, IE_b = TE_b - DE_b."""
    full = (
        info.scan("instances")
        .select("instance", "gold", "model_logits")
        .explode("model_logits")
        .with_columns(pl.int_range(pl.len()).over("instance").cast(pl.Int8).alias("option"))
        .rename({"model_logits": "full"})
    )
    direct = (
        info.scan("components")
        .filter(pl.col("kind").cast(pl.String).is_in(["attn", "mlp"]))
        .group_by("instance", "layer", "option")
        .agg(pl.col("logit").cast(pl.Float64).sum().alias("de"))
    )
    by = ["instance", "layer"]
    te = pl.col("full") - pl.col("skip")
    return (
        info.scan("skips")
        .rename({"logit": "skip"})
        .join(full, on=["instance", "option"])
        .join(direct, on=["instance", "layer", "option"])
        .with_columns(pl.col("full", "skip").cast(pl.Float64))
        .with_columns(
            _log_softmax("full", by).alias("log_p"), _log_softmax("skip", by).alias("log_q")
        )
        .group_by(by)
        .agg(
            (pl.col("option").get(pl.col("full").arg_max()) == pl.col("gold").first())
            .cast(pl.Float64)
            .alias("correct"),
            (pl.col("option").get(pl.col("skip").arg_max()) == pl.col("gold").first())
            .cast(pl.Float64)
            .alias("correct_without"),
            (pl.col("log_p").exp() * (pl.col("log_p") - pl.col("log_q"))).sum().alias("kl"),
            te.abs().mean().alias("te"),
            pl.col("de").abs().mean().alias("de"),
            (te - pl.col("de")).abs().mean().alias("ie"),
        )
        .sort(by)
        .collect()
    )


def _skip_summary(rows: pl.DataFrame, n_layers: int) -> pl.DataFrame:
    """Per block: accuracy with all blocks and without this one, mean KL, mean |TE|, |DE|, |IE|
    over instances and options, and the indirect share |IE| / (|DE| + |IE|) of the means
    (methods §7)."""
    return (
        rows.group_by("layer")
        .agg(
            pl.len().cast(pl.Int64).alias("n_instances"),
            pl.col("correct").mean().alias("accuracy"),
            pl.col("correct_without").mean().alias("accuracy_without"),
            pl.col("kl").mean(),
            pl.col("te").mean().alias("total_effect"),
            pl.col("de").mean().alias("direct_effect"),
            pl.col("ie").mean().alias("indirect_effect"),
        )
        .with_columns(
            ((pl.col("layer") + 1) / n_layers).alias("relative_depth"),
            (
                pl.col("indirect_effect") / (pl.col("direct_effect") + pl.col("indirect_effect"))
            ).alias("indirect_share"),
        )
        .select("layer", "relative_depth", "n_instances", "accuracy", *SKIP_COLUMNS)
        .sort("layer")
    )


def _blocks(info: PartitionInfo) -> int:
    """The partition's blocks L (its components' layers 0..L-1)."""
    return 1 + max(c.layer for c in info.manifest.components)


def partition_skips(info: PartitionInfo) -> pl.DataFrame:
    """``skip_effects`` of one partition (extracted with ``--skips``)."""
    return tag(_skip_summary(skip_rows(info), _blocks(info)), info)


def instance_halves(rows: pl.DataFrame, n_layers: int) -> pl.DataFrame:
    """Per instance of :func:`skip_rows`' ``rows``: its mean KL over the skipped blocks of the
    first half ((b + 1) / L <= 0.5), over those of the second half, and first minus second."""
    first = (pl.col("layer") + 1) / n_layers <= 0.5
    return (
        rows.group_by("instance")
        .agg(
            pl.col("kl").filter(first).mean().alias("kl_first"),
            pl.col("kl").filter(~first).mean().alias("kl_second"),
        )
        .with_columns((pl.col("kl_first") - pl.col("kl_second")).alias("kl_difference"))
        .sort("instance")
    )


def _partition_tables(info: PartitionInfo) -> dict[str, pl.DataFrame]:
    """``skip_effects`` and ``skip_halves`` of one partition."""
    rows, n_layers = skip_rows(info), _blocks(info)
    return {
        "skip_effects": tag(_skip_summary(rows, n_layers), info),
        "skip_halves": tag(instance_halves(rows, n_layers), info),
    }


def skip_tables(parts: list[PartitionInfo]) -> dict[str, pl.DataFrame]:
    """``skip_effects`` and ``skip_halves`` of ``parts`` (each extracted with ``--skips``;
    none: no table)."""
    frames = list(map_partitions(_partition_tables, parts))
    if not frames:
        return {}
    return {name: pl.concat([f[name] for f in frames]) for name in frames[0]}


@partition_engine
def skip_effects(
    store: Store | str | Path, models: Iterable[str] = (), tasks: Iterable[str] = ()
) -> pl.DataFrame:
    """Per (model, task, block): accuracy without the block, KL, |TE|, |DE|, |IE| and the
    indirect share (methods §7). Raises :class:`SkipsError` when a selected partition
    was extracted without ``--skips``."""
    parts = selected(store, models, tasks)
    missing = [p for p in parts if "skips" not in p.tables]
    if missing:
        raise SkipsError(
            f"no complete skips table for {listing(missing)}: run "
            + "; ".join(f"`{p.extract_command('skips')}`" for p in missing)
        )
    return pl.concat([partition_skips(info) for info in parts])


# --- report section -------------------------------------------------------------------------------


def skip_spec(tables: Mapping[str, pl.DataFrame], names: dict[str, str]) -> plots.Figure:
    """Accuracy without each block (dotted: with every block), and the mean |total| and |direct|
    effect of each block on the option logits; mean over the model's tasks."""
    skips = by_model(
        tables["skip_effects"],
        tables["manifests"],
        ["layer", "relative_depth"],
        ["accuracy", "accuracy_without", "direct_effect", "total_effect"],
    )
    xlabel = "relative depth (b + 1) / blocks"
    acc = plots.Panel(
        "Skipping one block (dotted: no block skipped)",
        xlabel=xlabel,
        ylabel="accuracy without the block (%)",
    )
    effect = plots.Panel(
        "Total vs direct effect of each block",
        xlabel=xlabel,
        ylabel="mean |effect| on an option logit (logits)",
    )
    for model, color in plots.model_colors(sorted(skips["model"].unique())).items():
        sub, label = skips.filter(pl.col("model") == model), names.get(model, model)
        x = sub["relative_depth"].to_list()
        hover = [f"block {b} skipped" for b in sub["layer"]]
        acc.series.append(  # its own marker: the effects' series share the colour
            plots.Series(
                f"{label} accuracy",
                x,
                (100 * sub["accuracy_without"]).to_list(),
                color=color,
                hover=hover,
                marker="^",
            )
        )
        whole = float(sub["accuracy"].cast(pl.Float64).fill_null(0).to_numpy().mean())
        acc.lines.append(plots.RefLine(100 * whole, color=color, dash="dot"))
        effects: tuple[tuple[str, plots.Dash, str, str], ...] = (
            ("total_effect", "solid", "o", "TE"),
            ("direct_effect", "dash", "s", "DE"),
        )
        for column, dash, marker, short in effects:
            effect.series.append(
                plots.Series(
                    f"{label} |{short}|",
                    x,
                    sub[column].to_list(),
                    color=color,
                    dash=dash,
                    marker=marker,
                    hover=hover,
                )
            )
    return plots.Figure(
        "Layer skips (methods §7), mean over tasks, at the last prompt token",
        [acc, effect],
        panel_size=(6.0, 3.8),
        caption=lone_subsets(tables["skip_effects"], tables["manifests"]),
    )


def skip_summary(skip_effects: pl.DataFrame) -> pl.DataFrame:
    """Per (model, task): accuracy, mean accuracy without a block of the first / second half
    (``acc_1``, ``acc_2``), mean KL by half (``kl_1``, ``kl_2``), and the indirect share of all
    blocks' effects, sum |IE| / sum (|DE| + |IE|) (``share``, methods §7)."""
    second = pl.col("relative_depth") > 0.5
    return (
        skip_effects.group_by(*KEY)
        .agg(
            pl.col("accuracy").first(),
            pl.col("accuracy_without").filter(~second).mean().alias("acc_1"),
            pl.col("accuracy_without").filter(second).mean().alias("acc_2"),
            pl.col("kl").filter(~second).mean().alias("kl_1"),
            pl.col("kl").filter(second).mean().alias("kl_2"),
            (
                pl.col("indirect_effect").sum()
                / (pl.col("direct_effect") + pl.col("indirect_effect")).sum()
            ).alias("share"),
        )
        .sort(*KEY)
    )


def skip_table(tables: Mapping[str, pl.DataFrame], names: dict[str, str]) -> str:
    """The :func:`skip_summary` of every (model, task) as Markdown."""
    summary = skip_summary(tables["skip_effects"])
    rows = [
        [
            names.get(r["model"], r["model"]),
            r["task"],
            fmt(r["accuracy"], 100),
            f"{fmt(r['acc_1'], 100)} / {fmt(r['acc_2'], 100)}",
            f"{fmt(r['kl_1'], digits=3)} / {fmt(r['kl_2'], digits=3)}",
            fmt(r["share"], 100),
        ]
        for r in summary.iter_rows(named=True)
    ]
    header = [
        "Model",
        "Task",
        "Accuracy (%)",
        "Acc. without a block, 1st / 2nd half (%)",
        "KL, 1st / 2nd half (nats)",
        "Indirect share |IE| / (|DE| + |IE|) (%)",
    ]
    return markdown_table(header, rows)


def skip_verdicts(tables: Mapping[str, pl.DataFrame], names: dict[str, str]) -> str:
    """Per (model, task), one per set of tasks with the same instances
    (:func:`~layerdiv.analyze.overlap.one_verdict`): the verdict on the depth-efficiency paper's
    second finding (skipping a block of the second half changes the output less): the mean over
    instances of each one's mean KL of the first half's skips minus the second's
    (``skip_halves``), its bootstrap interval over instances (the independent units; not over
    blocks, :func:`~layerdiv.analyze.stats.unit_mean`)."""
    judged, note = one_verdict(tables["skip_halves"], tables["manifests"])
    lines = []
    for key, sub in judged.group_by(*KEY, maintain_order=True):
        row = dict(zip(KEY, key, strict=True))
        diff, interval, n = unit_mean([sub["kl_difference"].fill_null(np.nan).to_numpy()])
        lines.append("- " + verdict(
            f"{names.get(row['model'], row['model'])}, {row['task']}: skipping a block of the "
            "second half changes the output less",
            "mean over instances of the KL, 1st − 2nd half (nats)", diff, interval, n,
            0.0, min_n=MIN_INTERVAL_N, unit="instances", digits=3))  # fmt: skip
    return "\n".join([*lines, *([note] if note else [])])


def report(ctx: ReportContext) -> str:
    """The layer skips section: what the effects are, their table, verdicts and figure."""
    tables = ctx.tables
    lone = lone_subsets(tables["skip_effects"], tables["manifests"])
    names = plots.short_names(ctx.names)
    parts = [
        "Skipping block b (`extract --skips`): the model's own option logits with the block "
        "replaced by the identity on every call. TE = logits − skip logits, DE = the block's "
        "own logit contributions (methods §1, final scale frozen), IE = TE − DE: what the "
        "block does through later blocks and the final norm, which the layer-addition curves "
        "do not see. Effects are mean absolute values over instances and options, in logit "
        "units; KL of the skipped model's option distribution from the full one's, in nats. "
        + (f"They rest on {lone}" if lone else ""),
        skip_table(tables, ctx.names),
        skip_verdicts(tables, ctx.names),
        plots.figure_link(ctx, "depth_skips.png", "Layer skips", lambda: skip_spec(tables, names)),
    ]
    return "\n\n".join(p for p in parts if p)


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: :func:`skip_tables` of the partitions extracted with
    ``--skips``."""
    return skip_tables(ctx.parts)


ANALYSIS = Analysis(
    name="skips",
    title="Layer skips",
    tables=tables,
    report=report,
    methods=(7,),
    needs=("skips",),
    order=40,
)
