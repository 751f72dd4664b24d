"""Integrated gradients per block and position (methods §13; ``extract --igrad``), on running
text and on choice tasks: one section each.

With L blocks, l = 0..L-1 (0-based, as the ``igrad`` table), t the position, and per document
(a choice task: instance; its positions the prompt's), site (``block``, ``attn``, ``mlp``) and
block the attribution IG(l, t) and the target at the path's ends f(x), f(b) (running text: the
sum of the answer's tokens' probabilities; a choice task: the gold option's probability among
the options at the last prompt token):

- share of |IG| at block l: S(l) = sum_t |IG(l, t)| / sum_(l', t) |IG(l', t)|, per document, then
  the mean over documents; on relative depth (l + 1) / L;
- depth score of a document's profile v(l) = sum_t |IG(l, t)| (methods §10):
  sum_l l v(l) / sum_l v(l), the mean over documents with its bootstrap 95% interval over
  documents (instances), and the relative score (score + 1) / L;
- completeness gap g(l) = sum_t IG(l, t) - (f(x) - f(b)) per document; per block the mean of g,
  of |g| and of |f(x) - f(b)|, and ``rel_gap`` = mean |g| / mean |f(x) - f(b)|. The rule of M
  steps (the partition's ``igrad_steps`` and ``igrad_rule``: the left Riemann sum, or
  Gauss-Legendre) closes the gap as M grows: a ``rel_gap`` over :data:`GAP_LEVEL` says M is too
  small.

Tables (running text; a choice task's are named ``choice_igrad_*`` and key the instance as
``doc``): ``igrad_share`` per (model, revision, task, ``sublayer``, ``block``): ``relative_depth``,
``n_documents``, ``share``; ``igrad_depth`` per (model, revision, task, ``sublayer``):
``n_blocks``, ``n_documents``, ``n_scored``, ``score``, ``ci_low``, ``ci_high``, ``relative``,
``relative_low``, ``relative_high``; ``igrad_completeness`` per (model, revision, task,
``sublayer``, ``block``): ``steps`` M, ``rule``, ``n_documents``, ``gap_mean``, ``abs_gap_mean``,
``delta_mean``, ``rel_gap``; ``igrad_maps``: the rows of the first documents' maps
(:data:`~layerdiv.analyze.analyses.attribution.DOCUMENTS_OPTION`, by default 2 per partition),
with their ``token`` ids and ``piece`` (a choice task: the prompt's pieces from
``instances.pieces``, no ids; by position alone before schema version 10) and, running text,
``answer_start``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.analyses.attribution import (
    CHOICE,
    SITE_ORDER,
    depth_frame,
    depth_row,
    depth_rows,
    depth_verdicts,
    first_documents,
    labelled,
    maps_link,
    profiles,
    section_analysis,
    with_answer,
)
from layerdiv.analyze.frames import tag
from layerdiv.analyze.markdown import fmt, key_rows, markdown_table
from layerdiv.analyze.registry import (
    Analysis,
    NoData,
    ReportContext,
)
from layerdiv.analyze.stats import LEVEL, MIN_INTERVAL_N, RESAMPLES
from layerdiv.analyze.text import TEXT_KIND
from layerdiv.measurements.igrad import rule_of
from layerdiv.schemas import SUBLAYERS
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY, SERIES

MEASUREMENT = "igrad"
"""The measurement whose settings name the steps (``igrad_steps``, M) and the rule
(``igrad_rule``)."""
GAP_LEVEL = 0.05
"""A completeness gap above this share of |f(x) - f(b)| says M is too small (methods §13)."""

TITLE = "Running text: integrated gradients per block and token"
"""The heading of its report section."""
CHOICE_TITLE = "Choice tasks: integrated gradients per block and prompt token"
"""The heading of the choice tasks' report section."""


def steps_of(info: PartitionInfo) -> int | None:
    """M, the steps ``info`` was extracted with (its ``igrad_steps`` setting)."""
    value = info.manifest.settings.get(MEASUREMENT, {}).get("igrad_steps")
    return None if value is None else int(value)


def per_document(info: PartitionInfo) -> pl.DataFrame:
    """Per (doc, sublayer, block) of ``info``: ``abs_sum`` sum_t |IG(l, t)|, ``ig_sum``
    sum_t IG(l, t), and ``f_input``, ``f_baseline`` (methods §13); a document without a
    measurable answer (its values null: ``max_tokens`` cut the answer off) has none, and is in
    no mean or count."""
    sums = (
        info.scan("igrad")
        .filter(pl.col("attribution").is_not_null())
        .group_by("doc", "sublayer", "block")
        .agg(
            abs_sum=pl.col("attribution").cast(pl.Float64).abs().sum(),
            ig_sum=pl.col("attribution").cast(pl.Float64).sum(),
        )
        .with_columns(pl.col("sublayer").cast(pl.String))
    )
    ends = (
        info.scan("igrad_ends")
        .filter(pl.col("f_input").is_not_null())
        .with_columns(
            pl.col("sublayer").cast(pl.String), pl.col("f_input", "f_baseline").cast(pl.Float64)
        )
    )
    frame = sums.join(ends, on=["doc", "sublayer", "block"], how="inner").collect()
    if not frame.height:
        raise NoData(f"{info.where} has no igrad rows")
    return frame.sort("sublayer", "doc", "block")


def shares_and_depth(docs: pl.DataFrame, blocks: int) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``igrad_share`` and ``igrad_depth`` (without the key) of one partition's
    :func:`per_document` rows."""
    share_rows, depth_rows = [], []
    for (sublayer,), rows in docs.group_by("sublayer", maintain_order=True):
        _, v = profiles(rows, "block", "abs_sum", blocks)  # v(l) = sum_t |IG(l, t)| per document
        total = v.sum(1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = v / total  # S(l) per document; a document without attribution: NaN
        scored = total[:, 0] > 0
        for block in range(blocks):
            share_rows.append(
                {
                    "sublayer": sublayer,
                    "block": block,
                    "relative_depth": (block + 1) / blocks,
                    "n_documents": int(scored.sum()),
                    "share": float(share[scored, block].mean()) if scored.any() else None,
                }
            )
        # methods §10: the depth score of each document's profile, mean and bootstrap interval
        depth_rows.append({"sublayer": sublayer, **depth_row(v, blocks, 1)})
    return pl.DataFrame(share_rows, schema_overrides={"share": pl.Float64}), depth_frame(depth_rows)


def completeness(docs: pl.DataFrame, steps: int | None, rule: str) -> pl.DataFrame:
    """``igrad_completeness`` (without the key) of one partition's :func:`per_document` rows,
    extracted with ``steps`` M of ``rule``: g = sum_t IG(l, t) - (f(x) - f(b)) per document
    (methods §13), its means per block."""
    delta = pl.col("f_input") - pl.col("f_baseline")
    gap = pl.col("ig_sum") - delta
    return (
        docs.group_by("sublayer", "block")
        .agg(
            n_documents=pl.len(),
            gap_mean=gap.mean(),
            abs_gap_mean=gap.abs().mean(),
            delta_mean=delta.abs().mean(),
        )
        .with_columns(
            steps=pl.lit(steps, pl.Int64),
            rule=pl.lit(rule, pl.String),
            rel_gap=pl.when(pl.col("delta_mean") > 0).then(
                pl.col("abs_gap_mean") / pl.col("delta_mean")
            ),
        )
        .select(
            "sublayer",
            "block",
            "steps",
            "rule",
            "n_documents",
            "gap_mean",
            "abs_gap_mean",
            "delta_mean",
            "rel_gap",
        )
        .sort(SITE_ORDER, "block")
    )


def maps(info: PartitionInfo, count: int) -> pl.DataFrame:
    """The ``igrad_maps`` rows of ``info``'s first ``count`` documents: every (sublayer, block,
    pos), with its token where stored and, running text, the document's ``answer_start``
    (:func:`labelled`)."""
    docs = first_documents(info, "igrad", count, "attribution")
    rows = (
        info.scan("igrad")
        .filter(pl.col("doc").is_in(docs))
        .with_columns(pl.col("sublayer").cast(pl.String))
        .collect()
    )
    return labelled(info, rows, docs).sort("doc", "sublayer", "block", "pos")


def tables_of(prefix: str, info: PartitionInfo, count: int) -> dict[str, pl.DataFrame]:
    """The four tables (names starting ``prefix``) of one partition holding ``igrad`` and
    ``igrad_ends``."""
    docs = per_document(info)
    rule = rule_of(info.manifest.settings.get(MEASUREMENT, {}))  # none recorded: riemann
    share, depth = shares_and_depth(docs, info.manifest.n_blocks)
    return {
        f"{prefix}_share": tag(share, info),
        f"{prefix}_depth": tag(depth, info),
        f"{prefix}_completeness": tag(completeness(docs, steps_of(info), rule), info),
        f"{prefix}_maps": tag(maps(info, count), info),
    }


# --- report ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """What the running-text and the choice sections say and draw differently."""

    kind: str
    title: str
    prefix: str
    """The start of its tables' and figures' names."""
    target: str
    """What f is and where the positions are, for the section's first sentence."""
    units: str
    note: str
    """The maps' caption's addition."""


TEXT = Section(
    TEXT_KIND,
    TITLE,
    "igrad",
    "the model's probability of the answer's tokens (teacher forcing); baseline: the site's "
    "mean over the document's positions",
    "documents",
    "",
)
CHOICES = Section(
    CHOICE,
    CHOICE_TITLE,
    "choice_igrad",
    "the gold option's probability among the options (the softmax over the option logits) at "
    "the last prompt token T − 1, at each position t of the prompt; baseline: the site's mean "
    "over the prompt's positions",
    "instances",
    "; the last position is the readout position T − 1",
)


def too_few_steps(table: pl.DataFrame, names: dict[str, str]) -> list[str]:
    """One sentence per partition whose completeness gap exceeds :data:`GAP_LEVEL` of
    |f(x) - f(b)| at some block (methods §13): how many (site, block) pairs, and the worst;
    what to redo (under the left Riemann sum, also the Gauss-Legendre rule at as many steps)."""
    lines = []
    for key, rows in table.group_by(*KEY, maintain_order=True):
        over = rows.filter(pl.col("rel_gap") > GAP_LEVEL).sort("rel_gap", descending=True)
        if not over.height:
            continue
        worst = over.row(0, named=True)
        model = names.get(str(key[0]), str(key[0]))
        steps, rule = worst["steps"], worst["rule"]
        m = f"M = {steps} steps" if steps is not None else "the number of steps M"
        more = f"{2 * steps}" if steps is not None else "M"
        redo = f"`layerdiv extract --model ... --task {key[2]} --redo igrad"
        gauss = (
            f", or with the Gauss-Legendre rule (methods §13), whose gap falls far faster with "
            f"M where the integrand is smooth at its nodes' spacing: {redo} --igrad-rule gauss "
            f"--igrad-steps {steps or 'M'}`"
            if rule == "riemann"
            else ""
        )
        lines.append(
            f"{m} is too small for {model} on {key[2]} ({rule} rule): the completeness gap exceeds "
            f"{GAP_LEVEL:.0%} of |f(x) − f(b)| at {over.height} of {rows.height} (site, block) "
            f"pairs, the worst at block {worst['block']} of site {worst['sublayer']} "
            f"({worst['rel_gap']:.1%}); redo it alone with more steps, the other measurements "
            f"kept: {redo}{' --igrad-rule gauss' if rule == 'gauss' else ''} --igrad-steps "
            f"{more}`{gauss}."
        )
    return lines


def unreliable(table: pl.DataFrame) -> dict[tuple[Any, ...], str]:
    """Per (model, revision, task, site) whose completeness gap exceeds :data:`GAP_LEVEL` of
    |f(x) - f(b)| at some block: why its depth score, verdict and maps are unreliable."""
    over = (
        table.group_by(*KEY, "sublayer")
        .agg(
            (pl.col("rel_gap") > GAP_LEVEL).sum().alias("over"),
            pl.len().alias("blocks"),
            pl.col("rel_gap").max().alias("worst"),
            pl.col("steps").first(),
            pl.col("rule").first(),
        )
        .filter(pl.col("over") > 0)
    )
    return {
        (*(r[k] for k in KEY), r["sublayer"]): (
            f"the completeness gap exceeds {GAP_LEVEL:.0%} of |f(x) − f(b)| at {r['over']} of "
            f"{r['blocks']} blocks (up to {r['worst']:.0%}, M = {r['steps']}, {r['rule']}), so "
            "the attributions do not add up to the change they explain; extract again with "
            "a larger `--igrad-steps`"
            + (" or with `--igrad-rule gauss`" if r["rule"] == "riemann" else "")
        )
        for r in over.iter_rows(named=True)
    }


def share_figure(
    share: pl.DataFrame, names: dict[str, str], units: str = "documents"
) -> plots.Figure:
    """One panel per site: each model and task's mean share of |IG| per block against the
    relative depth (l + 1) / L, the mean over ``units``."""
    keys = share.select(*SERIES).unique(maintain_order=True).rows()
    color = dict(zip(keys, plots.colors(len(keys)), strict=False))
    panels = []
    for sublayer in [s for s in SUBLAYERS if s in set(share["sublayer"])]:
        panel = plots.Panel(
            f"Site: {sublayer}", xlabel="relative depth (l + 1) / L", ylabel="share of |IG|"
        )
        for key in keys:
            rows = share.filter(
                pl.col("sublayer") == sublayer,
                *(pl.col(c) == v for c, v in zip(SERIES, key, strict=True)),
            ).sort("block")
            if rows.height:
                panel.series.append(
                    plots.Series(
                        f"{names.get(key[0], key[0])} · {key[1]}",
                        rows["relative_depth"].to_list(),
                        rows["share"].to_list(),
                        color=color[key],
                    )
                )
        panels.append(panel)
    return plots.Figure(
        "Share of |integrated gradients| per block (methods §13)",
        panels,
        cols=min(3, len(panels)),
        panel_size=(4.5, 3.4),
        caption=f"per {units[:-1]} sum_t |IG(l, t)| over its sum over blocks, then the mean over "
        f"{units}",
    )


def gap_rows(table: pl.DataFrame, names: dict[str, str]) -> list[list[str]]:
    """Per partition and site: M and the rule, the blocks, the largest ``rel_gap`` and its block,
    and the blocks over :data:`GAP_LEVEL`."""
    summary = (
        table.sort("rel_gap", descending=True, nulls_last=True)
        .group_by(*KEY, "sublayer", maintain_order=True)
        .agg(
            pl.col("steps", "rule").first(),
            pl.len().alias("blocks"),
            pl.col("rel_gap").first().alias("worst"),
            pl.col("block").first().alias("worst_block"),
            (pl.col("rel_gap") > GAP_LEVEL).sum().alias("over"),
            pl.col("abs_gap_mean").mean().alias("abs_gap"),
        )
        .sort(*KEY, SITE_ORDER)
    )
    return key_rows(
        summary,
        names,
        lambda r: [
            r["sublayer"],
            f"{r['steps']} ({r['rule']})",
            f"{r['abs_gap']:.3g}",
            fmt(r["worst"], 100, 1) + "%",
            str(r["worst_block"]),
            f"{r['over']} of {r['blocks']}",
        ],
    )


def report(ctx: ReportContext, section: Section = TEXT) -> str:
    """The integrated-gradients section: the completeness gap (and whether M is too small), the
    depth scores, the share figure and the first documents' (instances') maps."""
    p, units = section.prefix, section.units
    completeness_table = ctx.tables[f"{p}_completeness"]
    names = plots.short_names(ctx.names)
    steps = too_few_steps(completeness_table, ctx.names)
    depth = ctx.tables[f"{p}_depth"].sort(*KEY, SITE_ORDER)
    flagged = unreliable(completeness_table)
    reliable = [
        "no" if (*(r[k] for k in KEY), r["sublayer"]) in flagged else "yes"
        for r in depth.iter_rows(named=True)
    ]
    marked = sorted({f"{names.get(k[0], k[0])} · {k[2]} · {k[3]}" for k in flagged})
    note = section.note + (
        f"; UNRELIABLE (completeness gap over {GAP_LEVEL:.0%}): {', '.join(marked)}"
        if marked
        else ""
    )
    head = [
        "Model",
        "Task",
        "Site",
        units.capitalize(),
        "Depth score",
        f"{LEVEL:g}% CI",
        "(score + 1) / L",
        f"{LEVEL:g}% CI",
        f"Reliable (gap ≤ {GAP_LEVEL:.0%} at every block)",
    ]
    gaps = [
        "Model",
        "Task",
        "Site",
        "M (rule)",
        "Mean |gap|",
        "Largest gap / |f(x) − f(b)|",
        "at block",
        f"Blocks over {GAP_LEVEL:.0%}",
    ]
    return "\n\n".join(
        [
            "The attribution IG(l, t) of each block l and position t, at each site extracted "
            f"(block output, attention or MLP output), to {section.target}. Completeness: "
            "sum_t IG(l, t) should equal f(x) − f(b); the gap is what the rule of M steps "
            f"leaves (per block the mean |gap| over {units} against the mean |f(x) − f(b)|; "
            f"every block in the `{p}_completeness` table).",
            *steps,
            markdown_table(gaps, gap_rows(completeness_table, ctx.names)),
            f"Depth score (methods §10) of each {units[:-1]}'s profile sum_t |IG(l, t)| over "
            f"blocks, the mean over {units} with its bootstrap {LEVEL:g}% interval over {units} "
            f"({RESAMPLES} resamples; none below {MIN_INTERVAL_N} {units}). The verdict tests "
            "the depth-efficiency paper's reading of these maps, that what a position gives the "
            "answer comes mostly from the first half of the blocks: (score + 1) / L below 1/2. "
            f"A site whose completeness gap exceeds {GAP_LEVEL:.0%} at some block is marked "
            "unreliable (its depth score, verdict and maps): its attributions do not add up to "
            "the change they explain.",
            markdown_table(
                head,
                [
                    [*row, ok]
                    for row, ok in zip(depth_rows(depth, ctx.names), reliable, strict=True)
                ],
            ),
            depth_verdicts(
                depth,
                ctx.tables["manifests"],
                ctx.names,
                "the attribution to the answer lies mostly in the first half of the blocks",
                units,
                flagged,
            ),
            plots.figure_link(
                ctx,
                f"{p}_share.png",
                "Share of |IG| per block",
                lambda: share_figure(ctx.tables[f"{p}_share"], names, units),
            ),
            *maps_link(
                ctx,
                f"{p}_maps",
                "Integrated gradients per block and token (methods §13)",
                row="block",
                value="attribution",
                colorbar="IG(l, t)",
                signed=True,
                note=note,
                unit=units[:-1],
            ),
        ]
    )


def analysis(
    section: Section,
    among: Callable[[list[PartitionInfo]], list[PartitionInfo]] | None,
    order: int,
) -> Analysis:
    """The analysis of one :class:`Section` (``section_analysis``)."""
    return section_analysis(
        section, tables_of, report, (13, 10), ("igrad", "igrad_ends"), among, order
    )


ANALYSIS = analysis(TEXT, with_answer, order=150)


def with_igrad(parts: list[PartitionInfo]) -> list[PartitionInfo]:
    """The choice partitions of ``parts`` that hold ``igrad``: a choice task extracted without
    ``--igrad`` (most are: the demo's) gets no section and no note."""
    return [p for p in parts if "igrad" in p.tables]


CHOICE_ANALYSIS = analysis(CHOICES, with_igrad, order=155)
