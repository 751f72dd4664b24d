"""The report section of the heads analysis (:mod:`.heads`, methods §8): the parts that beat the
whole, a heatmap of every head per model, and the top heads per task.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.markdown import DASH, fmt, markdown_table, verdict
from layerdiv.analyze.overlap import one_verdict
from layerdiv.analyze.registry import ReportContext
from layerdiv.store.key import KEY

TOP_HEADS = 5
"""Heads per (model, task) in the report's top heads table."""


def _pct(value: float | None) -> str:
    return fmt(value, 100)


def heatmap_spec(
    scores: pl.DataFrame, summary: pl.DataFrame, model: str, title: str
) -> plots.Figure:
    """Calibrated accuracy of every head of ``model``: one panel per task, attention components
    (execution order) by head, coloured around the calibrated full model's accuracy (like with
    like; the panel's title names it and the uncalibrated full model's): red heads beat the
    calibrated whole. Hover names the head (``attn.<layer>`` and head index), its plain and
    calibrated accuracy and the full model's, both."""
    frame = scores.filter(pl.col("model") == model)
    full = {
        task: (acc, cal)
        for task, acc, cal in summary.filter(pl.col("model") == model)
        .select("task", "accuracy", "calibrated_accuracy")
        .iter_rows()
    }
    panels = []
    for task in sorted(frame["task"].unique()):
        sub = frame.filter(pl.col("task") == task)
        comps = sorted(sub["component"].unique())
        heads = sorted(sub["head"].unique())
        cal = {
            (c, h): 100 * v
            for c, h, v in sub.select("component", "head", "calibrated_accuracy").iter_rows()
        }
        acc = {
            (c, h): 100 * v for c, h, v in sub.select("component", "head", "accuracy").iter_rows()
        }
        layers = dict(sub.select("component", "layer").unique().iter_rows())
        z = plots.grid(cal, comps, heads)
        plain, whole = (100 * v for v in full[task])
        values = [v for row in z for v in row if v is not None]
        hover = [
            [
                f"{task}: layer {layers[c]} head {h}<br>calibrated accuracy {cal[c, h]:.1f}%<br>"
                f"accuracy {acc[c, h]:.1f}%<br>full model {plain:.1f}%, calibrated {whole:.1f}%"
                if (c, h) in cal
                else ""
                for h in heads
            ]
            for c in comps
        ]
        # Diverging colours centred on the calibrated full model: red heads beat it.
        heat = plots.Heatmap(
            z,
            heads,
            [layers[c] for c in comps],
            "calibrated accuracy (%)",
            cmap="RdBu_r",
            zmin=min(min(values), whole - 0.5),
            zmax=max(max(values), whole + 0.5),
            zmid=whole,
            hover=hover,
        )
        panels.append(
            plots.Panel(
                f"{task} (full {plain:.1f}%, calibrated {whole:.1f}%)",
                heatmap=heat,
                xlabel="head",
                ylabel="layer",
            )
        )
    return plots.Figure(title, panels, cols=min(3, len(panels)), panel_size=(4.6, 3.6))


MIN_INSTANCES = 30
"""Instances below which the accuracy of a part against the whole's cannot tell."""


def beat_verdicts(
    summary: pl.DataFrame, names: dict[str, str], manifests: pl.DataFrame | None = None
) -> str:
    """Per (model, task) with heads, one per set of tasks with the same instances
    (:func:`~layerdiv.analyze.overlap.one_verdict`, with ``manifests``): the verdict on "a head
    beats the whole", like with like: the best calibrated head's accuracy minus the calibrated
    full model's (points), with the normal interval of two proportions over the n instances
    (optimistic: the best of many heads, chosen on the same instances)."""
    lines = []
    with_heads = summary.filter(pl.col("n_heads").is_not_null())
    judged, note = one_verdict(with_heads, pl.DataFrame() if manifests is None else manifests)
    for r in judged.sort(*KEY).iter_rows(named=True):
        n, head, whole = r["n_instances"], r["best_head_calibrated_accuracy"], r[
            "calibrated_accuracy"]  # fmt: skip
        diff = 100 * (head - whole)
        se = 100 * np.sqrt((head * (1 - head) + whole * (1 - whole)) / max(n, 1))
        lines.append("- " + verdict(
            f"{names.get(r['model'], r['model'])}, {r['task']}: a head beats the whole "
            f"(calibrated; best of {r['n_heads']} heads, chosen on the same instances)",
            "best calibrated head − calibrated full model (points)", diff,
            (diff - 1.96 * se, diff + 1.96 * se), n, 0.0, min_n=MIN_INSTANCES,
            unit="instances", digits=1))  # fmt: skip
    return "\n".join([*lines, *([note] if note else [])])


def heads_section(ctx: ReportContext) -> str:
    """The report's heads section: the parts that beat the whole, the heatmaps (drawn into
    ``ctx.figures``) and the top heads."""
    tables, names, estimator = ctx.tables, ctx.names, ctx.estimator
    summary, scores = tables["head_summary"], tables["head_scores"]
    scores = scores.filter(pl.col("estimator") == estimator)
    rows = []
    for r in summary.sort(*KEY).iter_rows(named=True):
        heads = (
            f"no heads stored {DASH} `extract --heads`"
            if r["n_heads"] is None
            else f"{r['heads_beat']} / {r['heads_beat_calibrated']} of {r['n_heads']}"
        )
        best = (
            "–"
            if r["best_calibrated_head"] is None
            else f"{r['best_calibrated_head']} ({_pct(r['best_head_calibrated_accuracy'])})"
        )
        rows.append(
            [
                names.get(r["model"], r["model"]),
                r["task"],
                str(r["n_instances"]),
                _pct(r["accuracy"]),
                _pct(r["calibrated_accuracy"]),
                heads,
                f"{r['components_beat']} / {r['components_beat_calibrated']} of "
                f"{r['n_components']}",
                best,
            ]
        )
    parts = [
        "A head (or a component: the embedding, an attention or MLP block) beats the whole when "
        "its accuracy alone is above the full model's. Calibrated: the argmax of its option "
        "logits minus their mean over the task's instances (label-free; a constant preference "
        "for one option is removed); the calibrated full model is the same calibration applied "
        "to the full logits. Like with like, counts are plain / calibrated: a part's accuracy "
        "against the full model's, its calibrated accuracy against the calibrated full "
        "model's.",
        markdown_table(
            [
                "Model",
                "Task",
                "n",
                "Full acc. (%)",
                "Calibrated full (%)",
                "Heads > full",
                "Components > full",
                "Best calibrated head (%)",
            ],
            rows,
        ),
        beat_verdicts(summary, names, tables.get("manifests")),
    ]
    for model in sorted(scores["model"].unique()) if scores.height else []:
        label = names.get(model, model)
        title = f"{label}: calibrated accuracy of every head (red: above the calibrated full model)"
        parts.append(
            plots.figure_link(
                ctx,
                f"heads_{model}.png",
                f"{label} heads",
                partial(heatmap_spec, scores, summary, model, title),
            )
        )
    if scores.height:
        top = (
            scores.sort("calibrated_accuracy", "accuracy", descending=True)
            .group_by(*KEY, maintain_order=True)
            .head(TOP_HEADS)
            .join(
                summary.select(
                    *KEY,
                    pl.col("accuracy").alias("full"),
                    pl.col("calibrated_accuracy").alias("full_calibrated"),
                ),
                on=[*KEY],
            )
            .sort(*KEY, "calibrated_accuracy", descending=[*(False for _ in KEY), True])
        )
        parts += [
            f"### Top {TOP_HEADS} heads per task by calibrated accuracy",
            f"Margin: mean of u[gold] − max of the other options' u (logits). Shares: the head's "
            f"share of its block's bias and diversity with the block's heads as the ensemble "
            f"(estimator `{estimator}`).",
            markdown_table(
                [
                    "Model",
                    "Task",
                    "Head",
                    "Acc. (%)",
                    "Calibrated (%)",
                    "Full (%)",
                    "Calibrated full (%)",
                    "Margin",
                    "Bias share (%)",
                    "Diversity share (%)",
                ],
                [
                    [
                        names.get(r["model"], r["model"]),
                        r["task"],
                        r["name"],
                        _pct(r["accuracy"]),
                        _pct(r["calibrated_accuracy"]),
                        _pct(r["full"]),
                        _pct(r["full_calibrated"]),
                        f"{r['margin']:.2f}",
                        _pct(r["bias_share"]),
                        _pct(r["diversity_share"]),
                    ]
                    for r in top.iter_rows(named=True)
                ],
            ),
        ]
    return "\n\n".join(parts)
