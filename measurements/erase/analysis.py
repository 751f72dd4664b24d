"""Residual erasure per state and token (methods §14; ``extract --erase``), on running text and on
choice tasks: one section each.

With L blocks, states l = 0..L (0: the embeddings; l: block l-1's output) and per document
(instance) the effect(l, t) of replacing h_l at position t alone by the reference mean mu_l, T its
tokens and a an anchor position (running text: the answer's start s,
:func:`~layerdiv.analyze.analyses.attribution.answer_starts`; a choice task: the readout position
T - 1, the last prompt token, whose option probabilities the effect compares):

- the positions computed: running text t = 0..T-2 (effect(l, T-1) is 0 by construction: not
  computed); a choice task every t = 0..T-1 (t = T-1 is the readout position itself; the last
  state's effect elsewhere is 0 by construction and counts as the 0 it is);
- per-state profile of a document v(l) = sum_t effect(l, t); ``*_layers`` the mean over documents
  of the mean over the computed positions per state, on relative depth l / L, with its bootstrap
  95% interval over documents;
- depth score (methods §10) of v: sum_l l v(l) / sum_l v(l) over l = 0..L, the mean over
  documents with its bootstrap 95% interval, and the relative score / L (state l is block l-1's
  output: (block + 1) / L, as the blocks' relative score);
- effect against the distance to the anchor d = a - t (tokens; running text: negative inside the
  answer; a choice task: 0 at the readout position): per document and position e(t) = the mean
  over states of effect(l, t); per d the mean over the documents holding it (a document holds
  one position per d) with its bootstrap 95% interval over documents (1,000 seeded resamples;
  none from fewer than 5 documents).

Tables (running text; a choice task's are named ``choice_erasure_*`` and key the instance as
``doc``): ``erasure_layers`` per (model, revision, task, ``layer``): ``relative_depth``,
``n_documents``, ``effect``, ``ci_low``, ``ci_high``; ``erasure_depth`` per (model, revision,
task): ``n_blocks``, ``n_documents``, ``n_scored``, ``score``, ``ci_low``, ``ci_high``,
``relative``, ``relative_low``, ``relative_high``; ``erasure_distance`` per (model, revision,
task, ``distance``): ``n_documents``, ``effect``, ``ci_low``, ``ci_high``; ``erasure_maps``: the
rows of the first documents' maps with their ``token`` ids and ``piece`` (a choice task: the
prompt's pieces from ``instances.pieces``, no ids; by position alone before schema version 10)
and, running text, ``answer_start``.
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
    answer_starts,
    choice,
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
from layerdiv.analyze.frames import tag, unit_lengths
from layerdiv.analyze.markdown import fmt, markdown_table
from layerdiv.analyze.registry import (
    Analysis,
    NoData,
    ReportContext,
)
from layerdiv.analyze.stats import (
    LEVEL,
    MIN_INTERVAL_N,
    RESAMPLES,
    bootstrap_mean,
    percentile_interval,
    resample_weights,
)
from layerdiv.analyze.text import TEXT_KIND
from layerdiv.measurements.erase import RECORDED_BEFORE, describe_reference
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY, SERIES

TITLE = "Running text: residual erasure per state and token"
"""The heading of its report section."""
CHOICE_TITLE = "Choice tasks: residual erasure per state and token"
"""The heading of the choice tasks' report section."""


def anchors(info: PartitionInfo) -> pl.DataFrame:
    """Per document (instance, as ``doc``) of ``info`` its ``anchor`` a: the answer's start s
    (none for a document without one), a choice task's readout position T - 1."""
    if choice(info):
        rows = unit_lengths(info).select("doc", anchor=pl.col("n_tokens") - 1).collect()
        return rows.sort("doc")
    return answer_starts(info).rename({"answer_start": "anchor"})


def computed(info: PartitionInfo) -> pl.LazyFrame:
    """``info``'s erasure rows at the positions computed (running text t = 0..T-2: effect(l, T-1)
    is 0 by construction, not computed; a choice task every t = 0..T-1: methods §14),
    ``effect`` as float64; a document without a measurable answer (its effects null:
    ``max_tokens`` cut the answer off) has none, and is in no mean or count."""
    last = pl.col("n_tokens") - (0 if choice(info) else 1)
    return (
        info.scan("erasure")
        .filter(pl.col("effect").is_not_null())
        .join(unit_lengths(info), on="doc", how="inner")
        .filter(pl.col("pos") < last)
        .with_columns(pl.col("effect").cast(pl.Float64))
    )


def reference_columns(info: PartitionInfo) -> dict[str, Any]:
    """The reference means' settings of ``info`` (methods §14): ``reference`` in words,
    ``reference_positions`` (``after-first``, ``all``), ``reference_task`` (null: the task's
    own) and the partition's ``data_sha256`` (two partitions of the same documents share it)."""
    settings = info.manifest.settings.get("erase")
    if not settings:  # written by other means than extract --erase (a made-up store)
        return dict.fromkeys(("reference", "reference_positions", "reference_task"), None) | {
            "data_sha256": info.manifest.data_sha256
        }
    return {
        "reference": describe_reference(settings),
        "reference_positions": settings.get("erase_reference_positions") or RECORDED_BEFORE,
        "reference_task": settings.get("erase_reference_task"),
        "data_sha256": info.manifest.data_sha256,
    }


def layer_tables(info: PartitionInfo) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``erasure_layers`` and ``erasure_depth`` (without the key) of one partition; the depth
    table with the reference's settings (:func:`reference_columns`)."""
    blocks = info.manifest.n_blocks
    per_doc = (
        computed(info)
        .group_by("doc", "layer")
        .agg(total=pl.col("effect").sum(), mean=pl.col("effect").mean())
        .collect()
    )
    if not per_doc.height:
        raise NoData(f"{info.where} has no erasure rows")
    _, v = profiles(per_doc, "layer", "total", blocks + 1)  # v(l) = sum_t effect(l, t)
    # methods §10 over the states l = 0..L
    depth = depth_frame([depth_row(v, blocks, 0)]).with_columns(
        pl.lit(value, pl.String).alias(name) for name, value in reference_columns(info).items()
    )
    _, mean = profiles(per_doc, "layer", "mean", blocks + 1)  # per document: mean_t effect(l, t)
    held = np.unique(per_doc["layer"].to_numpy())
    # per state: the mean over documents with its bootstrap interval over them
    summary = [bootstrap_mean(mean[:, layer]) for layer in held]
    layers = pl.DataFrame(
        {
            "layer": held.astype(np.int64),
            "relative_depth": held / blocks,
            "n_documents": np.full(len(held), len(mean), np.int64),
            "effect": [m for m, _, _ in summary],
            "ci_low": [lo for _, lo, _ in summary],
            "ci_high": [hi for _, _, hi in summary],
        }
    ).with_columns(pl.col("ci_low", "ci_high").fill_nan(None))
    return layers, depth


def distances(info: PartitionInfo) -> pl.DataFrame:
    """``erasure_distance`` (without the key) of one partition: the mean over documents of
    e(t) at each d = a - t (:func:`anchors`), with its bootstrap interval over documents."""
    rows = computed(info)
    per_token = (
        rows.group_by("doc", "pos")
        .agg(pl.col("effect").mean())
        .collect()
        .join(anchors(info), on="doc", how="inner")
        .with_columns(distance=pl.col("anchor") - pl.col("pos"))
    )
    if not per_token.height:
        raise NoData(f"{info.where} has no erasure rows with an answer")
    ids, doc = np.unique(per_token["doc"].to_numpy(), return_inverse=True)
    dist, column = np.unique(per_token["distance"].to_numpy(), return_inverse=True)
    # a document holds each distance once: its e(t) there, and whether it holds it
    value = np.zeros((len(ids), len(dist)))
    held = np.zeros((len(ids), len(dist)))
    value[doc, column] = per_token["effect"].to_numpy()
    held[doc, column] = 1.0
    counts = held.sum(0)
    weights = resample_weights(len(ids))
    with np.errstate(invalid="ignore", divide="ignore"):
        means = (weights @ value) / (weights @ held)
    low, high = percentile_interval(means)
    enough = counts >= MIN_INTERVAL_N
    return pl.DataFrame(
        {
            "distance": dist.astype(np.int64),
            "n_documents": counts.astype(np.int64),
            "effect": value.sum(0) / counts,
            "ci_low": np.where(enough, low, np.nan),
            "ci_high": np.where(enough, high, np.nan),
        }
    ).with_columns(pl.col("ci_low", "ci_high").fill_nan(None))


def maps(info: PartitionInfo, count: int) -> pl.DataFrame:
    """The ``erasure_maps`` rows of ``info``'s first ``count`` documents: every (layer, pos),
    with its token where stored and, running text, the document's ``answer_start``
    (:func:`labelled`)."""
    docs = first_documents(info, "erasure", count, "effect")
    rows = info.scan("erasure").filter(pl.col("doc").is_in(docs)).collect()
    return labelled(info, rows, docs).sort("doc", "layer", "pos")


def tables_of(prefix: str, info: PartitionInfo, count: int) -> dict[str, pl.DataFrame]:
    """The four tables (names starting ``prefix``) of one partition holding ``erasure``."""
    layers, depth = layer_tables(info)
    return {
        f"{prefix}_layers": tag(layers, info),
        f"{prefix}_depth": tag(depth, info),
        f"{prefix}_distance": tag(distances(info), info),
        f"{prefix}_maps": tag(maps(info, count), info),
    }


# --- report ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """What the running-text and the choice sections say and draw differently."""

    kind: str
    title: str
    prefix: str
    """The start of its tables' names."""
    effect: str
    """What an effect is, for the section's first sentence and the figure's caption."""
    units: str
    near: str
    """The profile figure's right panel's title."""
    distance: str
    """Its x label."""
    anchor: plots.RefLine | None
    note: str
    """The maps' caption's addition."""


TEXT = Section(
    TEXT_KIND,
    TITLE,
    "erasure",
    "the largest L2 change of the next-token distribution over the positions that predict the "
    "answer's tokens",
    "documents",
    "Effect against the distance to the answer",
    "distance s − t (tokens)",
    plots.RefLine(0.5, axis="x", label="answer starts", dash="dot", color="gray"),
    "; the last position is 0 by construction",
)
CHOICES = Section(
    CHOICE,
    CHOICE_TITLE,
    "choice_erasure",
    "the L2 change of the option probabilities (the softmax over the option logits) at the last "
    "prompt token T − 1",
    "instances",
    "Effect against the distance to the readout position",
    "distance T − 1 − t (tokens)",
    None,
    "; the last position is the readout position T − 1; the last state is 0 before it by "
    "construction",
)


def profile_figure(
    layers: pl.DataFrame, distance: pl.DataFrame, names: dict[str, str], section: Section = TEXT
) -> plots.Figure:
    """Two panels: the mean effect per state on relative depth, and the mean effect against the
    distance to the anchor (the answer's start, a choice task's readout position) with its
    bootstrap interval; a line per model and task."""
    keys = layers.select(*SERIES).unique(maintain_order=True).rows()
    color = dict(zip(keys, plots.colors(len(keys)), strict=False))
    depth = plots.Panel(
        "Effect per state", xlabel="relative depth l / L", ylabel="mean effect ||p' − p||₂"
    )
    near = plots.Panel(section.near, xlabel=section.distance, ylabel="mean effect ||p' − p||₂")
    for key in keys:
        name = f"{names.get(key[0], key[0])} · {key[1]}"
        mine = [pl.col(c) == v for c, v in zip(SERIES, key, strict=True)]
        rows = layers.filter(*mine).sort("layer")
        depth.series.append(
            plots.Series(
                name,
                rows["relative_depth"].to_list(),
                rows["effect"].to_list(),
                color=color[key],
                interval=plots.interval_ends(rows),
            )
        )
        rows = distance.filter(*mine).sort("distance")
        near.series.append(
            plots.Series(
                name,
                rows["distance"].to_list(),
                rows["effect"].to_list(),
                color=color[key],
                marker=None,
                interval=plots.interval_ends(rows),
            )
        )
    if section.anchor is not None:
        near.lines.append(section.anchor)
    return plots.Figure(
        "Residual erasure (methods §14)",
        [depth, near],
        caption=f"effect: {section.effect}; right: the mean over states l = 0..L of each "
        f"position's effect; bars the bootstrap {LEVEL:g}% interval over {section.units} "
        f"(none below {MIN_INTERVAL_N})",
    )


VARIANT = ("reference_positions", "reference_task")
"""The settings of the reference means that two partitions of the same documents can differ
in."""


def sensitivity_rows(depth: pl.DataFrame, layers: pl.DataFrame) -> pl.DataFrame:
    """Per partition whose model, revision and documents (``data_sha256``) another partition
    shares with another reference (:data:`VARIANT`): its depth score with its interval, the mean
    over states of the per-state mean effect, and the largest absolute difference of the
    per-state mean effect from the group's first partition (by key), at which ``state`` (l / L
    as ``relative_depth``); empty where no two such partitions are stored."""
    group = ["model", "revision", "data_sha256"]
    variants = depth.with_columns(pl.col(*VARIANT).fill_null("")).with_columns(
        n_variants=pl.struct(*VARIANT).n_unique().over(group)
    )
    shared = variants.filter(pl.col("n_variants") > 1).sort(*group, *KEY)
    out = []
    for _, rows in shared.group_by(group, maintain_order=True):
        base = None
        for r in rows.iter_rows(named=True):
            mine = layers.filter(*(pl.col(c) == r[c] for c in KEY)).sort("layer")
            effect = mine["effect"].to_numpy()
            diff = np.zeros_like(effect) if base is None else np.abs(effect - base)
            base = effect if base is None else base
            at = int(np.argmax(diff))
            kept = {c: r[c] for c in (*KEY, "reference", "n_scored", "score", "ci_low", "ci_high")}
            out.append(
                {
                    **kept,
                    "mean_effect": float(effect.mean()),
                    "largest_change": float(diff[at]),
                    "state": int(mine["layer"][at]),
                    "relative_depth": float(mine["relative_depth"][at]),
                }
            )
    return pl.DataFrame(out)


def sensitivity(ctx: ReportContext, section: Section) -> list[str]:
    """The reference's sensitivity, where the same documents are stored with two references
    (:func:`sensitivity_rows`): a sentence and a table; nothing otherwise."""
    p = section.prefix
    rows = sensitivity_rows(ctx.tables[f"{p}_depth"], ctx.tables[f"{p}_layers"])
    if not rows.height:
        return []
    head = ["Model", "Task", "Reference", section.units.capitalize(), "Depth score",
            f"{LEVEL:g}% CI", "mean effect", "largest change per state",
            "at state (l / L)"]  # fmt: skip
    body = [
        [
            ctx.names.get(r["model"], r["model"]),
            r["task"],
            r["reference"],
            str(r["n_scored"]),
            fmt(r["score"], digits=2),
            f"[{fmt(r['ci_low'], digits=2)}, {fmt(r['ci_high'], digits=2)}]",
            fmt(r["mean_effect"], digits=3),
            fmt(r["largest_change"], digits=3),
            f"{r['state']} ({r['relative_depth']:.2f})",
        ]
        for r in rows.iter_rows(named=True)
    ]
    return [
        "**Sensitivity to the reference.** The same model and "
        f"{section.units} are stored with other reference means (methods §14: positions "
        "1..T-1 by default; `all` takes in the first token, an attention sink's massive "
        "activation in most models, and writes it at the erased position): each row's depth "
        "score and mean effect, and the largest change of the per-state mean effect from the "
        "first row of its model.",
        markdown_table(head, body),
    ]


def report(ctx: ReportContext, section: Section = TEXT) -> str:
    """The residual-erasure section: the depth scores and both figures."""
    names = plots.short_names(ctx.names)
    p = section.prefix
    head = [
        "Model",
        "Task",
        section.units.capitalize(),
        "Depth score",
        f"{LEVEL:g}% CI",
        "score / L",
        f"{LEVEL:g}% CI",
    ]
    references = sorted(set(ctx.tables[f"{p}_depth"]["reference"].drop_nulls()))
    over = "; ".join(f"{r} {section.units}" for r in references) or "not recorded"
    return "\n\n".join(
        [
            "The effect of replacing one position's residual state h_l alone by its reference "
            f"mean ({over}): {section.effect}. Depth score "
            f"(methods §10) of each {section.units[:-1]}'s profile sum_t effect(l, t) over the "
            f"states l = 0..L, the mean over {section.units} with its bootstrap {LEVEL:g}% "
            f"interval ({RESAMPLES} resamples; none below {MIN_INTERVAL_N} {section.units}). "
            "The verdict tests the depth-efficiency paper's reading of these maps, that erasing "
            "a position matters mostly in the first half of the stack: score / L below 1/2 "
            "(a flat profile gives about 1/2).",
            markdown_table(head, depth_rows(ctx.tables[f"{p}_depth"].sort(*KEY), ctx.names)),
            depth_verdicts(
                ctx.tables[f"{p}_depth"].sort(*KEY),
                ctx.tables["manifests"],
                ctx.names,
                "erasing a position's state changes the output mostly in the first half of the "
                "states",
                section.units,
            ),
            *sensitivity(ctx, section),
            plots.figure_link(
                ctx,
                f"{p}_profile.png",
                "Residual erasure per state and by distance",
                lambda: profile_figure(
                    ctx.tables[f"{p}_layers"], ctx.tables[f"{p}_distance"], names, section
                ),
            ),
            *maps_link(
                ctx,
                f"{p}_maps",
                "Residual erasure per state and token (methods §14)",
                row="layer",
                value="effect",
                colorbar="effect(l, t)",
                signed=False,
                note=section.note,
                unit=section.units[:-1],
            ),
        ]
    )


def analysis(
    section: Section,
    among: Callable[[list[PartitionInfo]], list[PartitionInfo]] | None,
    order: int,
) -> Analysis:
    """The analysis of one :class:`Section` (``section_analysis``)."""
    return section_analysis(section, tables_of, report, (14, 10), ("erasure",), among, order)


ERASURE = analysis(TEXT, with_answer, order=160)
CHOICE_ERASURE = analysis(CHOICES, None, order=170)
