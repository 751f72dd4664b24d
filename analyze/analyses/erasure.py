"""Running text, residual erasure (methods §14; ``extract --erase``).

With L blocks, states l = 0..L (0: the embeddings; l: block l-1's output) and per document the
effect(l, t) of replacing h_l at position t alone by the reference mean mu_l, s the answer's
start (:func:`~layerdiv.analyze.analyses.attribution.answer_starts`) and T the document's tokens:

- per-layer profile of a document v(l) = sum_t effect(l, t); ``erasure_layers`` the mean over
  documents of the mean over positions 0..T-2 (effect(l, T-1) is 0 by construction: not computed)
  per state, on relative depth l / L;
- depth score (methods §10) of v: sum_l l v(l) / sum_l v(l) over l = 0..L, the mean over
  documents with its bootstrap 95% interval, and the relative score / L (state l is block l-1's
  output: (block + 1) / L, as the blocks' relative score);
- effect against the distance to the answer d = s - t (tokens; negative inside the answer): per
  document and position e(t) = the mean over states of effect(l, t), t = 0..T-2; per d the mean
  over the documents holding it (a document holds one position per d) with its bootstrap 95%
  interval over documents (1,000 seeded resamples; none from fewer than 5 documents).

Tables: ``erasure_layers`` per (model, revision, task, ``layer``): ``relative_depth``,
``n_documents``, ``effect``; ``erasure_depth`` per (model, revision, task): ``n_blocks``,
``n_documents``, ``n_scored``, ``score``, ``ci_low``, ``ci_high``, ``relative``,
``relative_low``, ``relative_high``; ``erasure_distance`` per (model, revision, task,
``distance``): ``n_documents``, ``effect``, ``ci_low``, ``ci_high``; ``erasure_maps``: the rows
of the first documents' maps with their ``token`` ids and ``answer_start``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.analyses.attribution import (
    OPTIONS,
    answer_starts,
    depth_frame,
    depth_row,
    depth_rows,
    document_tokens,
    first_documents,
    maps_link,
    partition_tables,
    profiles,
    with_answer,
)
from layerdiv.analyze.analyses.effective_depth import interval_ends
from layerdiv.analyze.frames import tag
from layerdiv.analyze.markdown import markdown_table
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    NoData,
    ReportContext,
    register,
)
from layerdiv.analyze.stats import (
    LEVEL,
    MIN_INTERVAL_N,
    RESAMPLES,
    percentile_interval,
    resample_weights,
)
from layerdiv.analyze.text import TEXT_KIND
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY, SERIES

TITLE = "Running text: residual erasure per state and token"
"""The heading of its report section."""


def computed(info: PartitionInfo) -> pl.LazyFrame:
    """``info``'s erasure rows at the positions t = 0..T-2 (effect(l, T-1) is 0 by construction,
    not computed: methods §14), ``effect`` as float64."""
    lengths = info.scan("documents").select("doc", "n_tokens")
    return (
        info.scan("erasure")
        .join(lengths, on="doc", how="inner")
        .filter(pl.col("pos") < pl.col("n_tokens") - 1)
        .with_columns(pl.col("effect").cast(pl.Float64))
    )


def layer_tables(info: PartitionInfo) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``erasure_layers`` and ``erasure_depth`` (without the key) of one partition."""
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
    depth = depth_frame([depth_row(v, blocks, 0)])  # methods §10 over the states l = 0..L
    layers = (
        per_doc.group_by("layer")
        .agg(n_documents=pl.len(), effect=pl.col("mean").mean())
        .with_columns(relative_depth=pl.col("layer") / blocks)
        .select("layer", "relative_depth", "n_documents", "effect")
        .sort("layer")
    )
    return layers, depth


def distances(info: PartitionInfo) -> pl.DataFrame:
    """``erasure_distance`` (without the key) of one partition: the mean over documents of
    e(t) at each d = s - t, with its bootstrap interval over documents."""
    rows = computed(info)
    starts = answer_starts(info)
    per_token = (
        rows.group_by("doc", "pos")
        .agg(pl.col("effect").mean())
        .collect()
        .join(starts, on="doc", how="inner")
        .with_columns(distance=pl.col("answer_start") - pl.col("pos"))
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
    """The ``erasure_maps`` rows of ``info``'s first ``count`` documents: every (layer, pos)
    with its ``token`` id and the document's ``answer_start``."""
    docs = first_documents(info, "erasure", count)
    rows = info.scan("erasure").filter(pl.col("doc").is_in(docs)).collect()
    starts = answer_starts(info)
    return (
        rows.join(document_tokens(info, docs), on=["doc", "pos"], how="left")
        .join(starts, on="doc", how="left")
        .sort("doc", "layer", "pos")
    )


def tables_of(info: PartitionInfo, count: int) -> dict[str, pl.DataFrame]:
    """The four tables of one text partition holding ``erasure``."""
    layers, depth = layer_tables(info)
    return {
        "erasure_layers": tag(layers, info),
        "erasure_depth": tag(depth, info),
        "erasure_distance": tag(distances(info), info),
        "erasure_maps": tag(maps(info, count), info),
    }


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: the tables of every partition it gets."""
    return partition_tables(ctx, tables_of, TITLE)


# --- report ------------------------------------------------------------------------------------


def profile_figure(
    layers: pl.DataFrame, distance: pl.DataFrame, names: dict[str, str]
) -> plots.Figure:
    """Two panels: the mean effect per state on relative depth, and the mean effect against the
    distance to the answer with its bootstrap interval; a line per model and task."""
    keys = layers.select(*SERIES).unique(maintain_order=True).rows()
    color = dict(zip(keys, plots.colors(len(keys)), strict=False))
    depth = plots.Panel(
        "Effect per state", xlabel="relative depth l / L", ylabel="mean effect ||p' − p||₂"
    )
    near = plots.Panel(
        "Effect against the distance to the answer",
        xlabel="distance s − t (tokens)",
        ylabel="mean effect ||p' − p||₂",
    )
    for key in keys:
        name = f"{names.get(key[0], key[0])} · {key[1]}"
        mine = [pl.col(c) == v for c, v in zip(SERIES, key, strict=True)]
        rows = layers.filter(*mine).sort("layer")
        depth.series.append(
            plots.Series(
                name, rows["relative_depth"].to_list(), rows["effect"].to_list(), color=color[key]
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
                interval=interval_ends(rows, "effect"),
            )
        )
    near.lines.append(plots.RefLine(0.5, axis="x", label="answer starts", dash="dot", color="gray"))
    return plots.Figure(
        "Residual erasure (methods §14)",
        [depth, near],
        caption="effect: the largest change of the next-token distribution over the positions "
        "predicting the answer; right: the mean over states l = 0..L of each position's effect, "
        f"bars the bootstrap {LEVEL:g}% interval over documents",
    )


def report(ctx: ReportContext) -> str:
    """The residual-erasure section: the depth scores and both figures."""
    names = plots.short_names(ctx.names)
    head = [
        "Model",
        "Task",
        "Documents",
        "Depth score",
        f"{LEVEL:g}% CI",
        "score / L",
        f"{LEVEL:g}% CI",
    ]
    return "\n\n".join(
        [
            "The effect of replacing one position's residual state h_l alone by its mean over "
            "reference documents: the largest L2 change of the next-token distribution over the "
            "positions that predict the answer's tokens. Depth score (methods §10) of each "
            "document's profile sum_t effect(l, t) over the states l = 0..L, the mean over "
            f"documents with its bootstrap {LEVEL:g}% interval ({RESAMPLES} resamples).",
            markdown_table(head, depth_rows(ctx.tables["erasure_depth"].sort(*KEY), ctx.names)),
            plots.figure_link(
                ctx,
                "erasure_profile.png",
                "Residual erasure per state and by distance",
                lambda: profile_figure(
                    ctx.tables["erasure_layers"], ctx.tables["erasure_distance"], names
                ),
            ),
            *maps_link(
                ctx,
                "erasure_maps",
                "Residual erasure per state and token (methods §14)",
                row="layer",
                value="effect",
                colorbar="effect(l, t)",
                signed=False,
                note="; the last position is 0 by construction",
            ),
        ]
    )


register(
    Analysis(
        name="erasure",
        title=TITLE,
        methods=(14, 10),
        tables=tables,
        report=report,
        kinds=(TEXT_KIND,),
        among=with_answer,
        options=OPTIONS,
        needs=("erasure",),
    )
)
