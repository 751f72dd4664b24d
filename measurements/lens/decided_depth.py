"""Running text, decided-at depth (methods §16): the block from which the final logit lens
(``extract --lens``), or a learned lens (``--lens-ls``, ``--lens-tuned``, methods §17), already
ranks the model's own prediction first, and stays so.

Per token p < T-1, y_p the model's own top-1 next token (``top1`` at layer L) and rank_l(p) its
``final_rank`` under p_l: decided(p) = the smallest block l in 0..L-1 with rank_k(p) = 1 for every
k in l..L-1, and L when rank_(L-1)(p) > 1; relative (decided + 1) / L.

Tables:

- ``decided_depth``: per (model, revision, task, ``lens``, ``group``), ``lens`` the lens read
  (``logit``, ``ls``, ``tuned``; :func:`~layerdiv.measurements.lens.stored_lenses`):
  ``n_tokens``, ``n_documents``,
  ``mean`` relative decided depth over the group's tokens (token-weighted), ``ci_low``/
  ``ci_high`` (bootstrap 95% percentile interval over documents, 1,000 seeded resamples, the
  mean recomputed from the resampled documents' tokens; none from fewer than
  :data:`~layerdiv.analyze.stats.MIN_INTERVAL_N` documents). Groups: ``all``; ``correct`` /
  ``incorrect`` (y_p is / is not the actual next token); ``q1``..``q4``, the frequency quartile
  of y_p: the predictions ordered by y_p's count among the partition's tokens (ties by token id)
  and cut into four of equal size (q1 the rarest).
- ``decided_depth_hist``: per (model, revision, task, ``lens``, ``decided`` = 0..L): ``n_tokens``,
  ``share`` and ``relative`` (decided + 1) / L, the distribution.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import tag
from layerdiv.analyze.markdown import fmt, key_rows, markdown_table
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    NoData,
    ReportContext,
    map_partitions,
)
from layerdiv.analyze.stats import (
    LEVEL,
    MIN_INTERVAL_N,
    RESAMPLES,
    percentile_interval,
    resample_weights,
)
from layerdiv.analyze.text import BATCH_TOKENS, TEXT_KIND, batches
from layerdiv.measurements import tables_of
from layerdiv.measurements.lens import readout_of, stored_lenses
from layerdiv.store import PartitionInfo, StoreError
from layerdiv.store.key import KEY, SERIES

GROUPS = ("all", "correct", "incorrect", "q1", "q2", "q3", "q4")
"""The token groups of ``decided_depth``, in table and figure order."""

SCHEMA = {
    **dict.fromkeys(KEY, pl.String),
    "lens": pl.String,
    "group": pl.String,
    "n_tokens": pl.Int64,
    "n_documents": pl.Int64,
    "mean": pl.Float64,
    "ci_low": pl.Float64,
    "ci_high": pl.Float64,
}
"""The columns of ``decided_depth``."""


def decided(rank: np.ndarray) -> np.ndarray:
    """decided(p) of ranks (tokens, L) at the block inputs l = 0..L-1 (methods §16): the
    smallest l from which every rank is 1, L where the last one is not."""
    blocks = rank.shape[1]
    off = rank != 1
    last_off = np.where(off.any(axis=1), blocks - 1 - off[:, ::-1].argmax(axis=1), -1)
    return last_off + 1


def predictions(info: PartitionInfo, table: str = "token_lens") -> pl.DataFrame:
    """Per token p < T-1 of ``info`` (a text partition with the final lens's ``final_rank``):
    ``doc``, ``pos``, ``decided`` (methods §16) and ``top1`` y_p, read from its lens ``table``
    in batches of whole tokens."""
    blocks = info.manifest.n_blocks
    layers = blocks + 1
    frames = []
    columns = ["doc", "pos", "layer", "final_rank", "top1", "ce"]
    for frame in batches(info, table, columns, BATCH_TOKENS * layers):
        layer = frame["layer"].to_numpy().reshape(-1, layers)
        if (layer != np.arange(layers)).any():
            raise StoreError(
                f"{info.where}: {table} rows are not sorted by (doc, pos, layer) with every "
                "layer of every token; re-extract it with --overwrite"
            )
        rank = frame["final_rank"].to_numpy().reshape(-1, layers)[:, :blocks]
        last = frame[layers - 1 :: layers]  # layer L: the model's own output
        frames.append(
            last.select("doc", "pos", "top1", has_next=pl.col("ce").is_not_null()).with_columns(
                decided=pl.Series(decided(rank), dtype=pl.Int32)
            )
        )
    return pl.concat(frames).filter("has_next").drop("has_next")


def token_groups(info: PartitionInfo, table: str = "token_lens") -> pl.DataFrame:
    """:func:`predictions` with ``relative`` (decided + 1) / L, ``correct`` (y_p is the token at
    p + 1) and ``quartile`` 1..4 of y_p's count among the partition's tokens."""
    blocks = info.manifest.n_blocks
    tokens = info.scan("tokens").select("doc", "pos", "token").collect()
    counts = tokens.group_by("token").agg(pl.len().alias("count"))
    following = tokens.select(
        "doc", (pl.col("pos") - 1).alias("pos"), pl.col("token").alias("next")
    )
    out = (
        predictions(info, table)
        .join(following, on=["doc", "pos"], how="left")
        .join(counts, left_on="top1", right_on="token", how="left")
        .with_columns(
            relative=(pl.col("decided") + 1) / blocks,
            correct=pl.col("top1") == pl.col("next"),
            count=pl.col("count").fill_null(0),
        )
    )
    # quartiles of equal size: predictions ordered by the count of their token (then by the token,
    # so that a token's predictions stay together but at a quartile's edge)
    order = pl.struct("count", "top1").rank("ordinal") - 1
    return out.with_columns(quartile=(1 + 4 * order // pl.len()).cast(pl.Int8))


FILTERS = {
    "all": pl.lit(True),
    "correct": pl.col("correct"),
    "incorrect": ~pl.col("correct"),
    **{f"q{q}": pl.col("quartile") == q for q in range(1, 5)},
}
"""Each group of :data:`GROUPS` as a filter of :func:`token_groups`' rows."""


def partition_decided(info: PartitionInfo) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``decided_depth`` and ``decided_depth_hist`` of one text partition, under each lens it
    holds (:func:`~layerdiv.measurements.lens.stored_lenses`)."""
    pairs = [lens_decided(info, lens, table) for lens, table in stored_lenses(info)]
    return pl.concat([t for t, _ in pairs]), pl.concat([h for _, h in pairs])


def lens_decided(info: PartitionInfo, lens: str, source: str) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``decided_depth`` and ``decided_depth_hist`` of one text partition under one lens, read
    from its table ``source``."""
    blocks = info.manifest.n_blocks
    tokens = token_groups(info, source)
    if not tokens.height:
        raise NoData(f"{info.where} has no token with a next token")
    docs = np.unique(tokens["doc"].to_numpy())
    index = np.searchsorted(docs, tokens["doc"].to_numpy())
    weights = resample_weights(len(docs))
    rows = []
    for group, mask in FILTERS.items():
        keep = tokens.with_columns(keep=mask)["keep"].fill_null(False).to_numpy()
        # per document: the sum of the group's relative decided depths and their count, so that
        # a resample's mean is token-weighted: W @ sums / W @ counts
        sums = np.bincount(index[keep], tokens["relative"].to_numpy()[keep], minlength=len(docs))
        counts = np.bincount(index[keep], minlength=len(docs)).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            means = (weights @ sums) / (weights @ counts)
        n_docs = int((counts > 0).sum())
        low, high = percentile_interval(means if n_docs >= MIN_INTERVAL_N else np.full(1, np.nan))
        n = int(counts.sum())
        rows.append(
            {
                "group": group,
                "n_tokens": n,
                "n_documents": n_docs,
                "mean": float(sums.sum() / n) if n else None,
                "ci_low": None if np.isnan(low) else float(low),
                "ci_high": None if np.isnan(high) else float(high),
            }
        )
    table = pl.DataFrame(
        [{"lens": lens, **r} for r in rows],
        schema={k: v for k, v in SCHEMA.items() if k not in KEY},
    )
    hist = (
        pl.DataFrame({"decided": np.arange(blocks + 1, dtype=np.int32)})
        .join(tokens.group_by("decided").agg(n_tokens=pl.len()), on="decided", how="left")
        .with_columns(pl.col("n_tokens").fill_null(0).cast(pl.Int64))
        .with_columns(
            share=pl.col("n_tokens") / tokens.height, relative=(pl.col("decided") + 1) / blocks
        )
        .select(pl.lit(lens).alias("lens"), pl.all())
    )
    return tag(table, info), tag(hist, info)


def has_ranks(info: PartitionInfo) -> bool:
    """Whether ``info``'s lens stores ``final_rank`` (schema version 6 on)."""
    return "final_rank" in tables_of(info.manifest.schema_version)["token_lens"].names


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: both tables of the text partitions holding the final lens
    with its ranks; notes name the others."""
    lensed = ctx.parts
    old = [p.key.label for p in lensed if not has_ranks(p)]
    if old:
        ctx.notes.append(
            f"No decided-at depth for {', '.join(old)}: their lens was stored before it kept "
            "final_rank (schema version 6); re-extract them with `--lens --overwrite`."
        )
    other = [p.key.label for p in lensed if has_ranks(p) and readout_of(p.manifest) != "final"]
    if other:
        ctx.notes.append(
            f"No decided-at depth for {', '.join(other)}: they hold the last-block lens; "
            "methods §16 reads the final one (`layerdiv extract --lens`)."
        )
    parts = [p for p in lensed if has_ranks(p) and readout_of(p.manifest) == "final"]
    if not parts:
        raise NoData("no text partition holds the final lens with final_rank")
    pairs = list(map_partitions(partition_decided, parts))
    return {
        "decided_depth": pl.concat([t for t, _ in pairs]),
        "decided_depth_hist": pl.concat([h for _, h in pairs]),
    }


# --- report ------------------------------------------------------------------------------------


def decided_figure(table: pl.DataFrame, hist: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """Two panels: the share of tokens decided at each relative depth (a line per model and
    task), and the mean relative decided depth per token group with its bootstrap interval."""
    # the key with the most groups first: the group axis takes its categories in order of
    # appearance, and a key may lack a group (no correct prediction)
    series = [*SERIES, "lens"]
    counts = table.filter(pl.col("mean").is_not_null()).group_by(*series).len()
    ranked = counts.sort("len", *series, descending=[True, False, False, False])
    keys = [(m, t, lens) for m, t, lens, _ in ranked.iter_rows()]
    color = dict(zip(keys, plots.colors(len(keys)), strict=False))
    lenses = table["lens"].n_unique() > 1
    share = plots.Panel(
        "Where the prediction is decided",
        xlabel="relative decided depth (decided + 1) / L",
        ylabel="share of tokens",
    )
    means = plots.Panel(
        f"Mean by token group, {LEVEL:g}% CI",
        xlabel="tokens",
        ylabel="mean (decided + 1) / L",
        yrange=(0, 1.1),
    )
    for model, task, lens in keys:
        name = f"{names.get(model, model)} · {task}" + (f" · {lens} lens" if lenses else "")
        key = (pl.col("model") == model, pl.col("task") == task, pl.col("lens") == lens)
        sub = hist.filter(*key).sort("decided")
        share.series.append(
            plots.Series(
                name,
                sub["relative"].to_list(),
                sub["share"].to_list(),
                color=color[(model, task, lens)],
            )
        )
        rows = table.filter(*key)
        rows = rows.filter(pl.col("mean").is_not_null())
        rows = rows.sort(pl.col("group").replace_strict(GROUPS, range(len(GROUPS))))
        means.series.append(
            plots.Series(
                name,
                rows["group"].to_list(),
                rows["mean"].to_list(),
                color=color[(model, task, lens)],
                line=False,
                interval=plots.interval_ends(rows),
            )
        )
    share.lines.append(plots.RefLine(1.0, axis="x", label="last block", dash="dot", color="gray"))
    return plots.Figure(
        "Decided-at depth of the model's own prediction (methods §16)",
        [share, means],
        caption="q1..q4: frequency quartile of the predicted token among the task's tokens "
        "(q1 the rarest); beyond 1: decided only at the output",
    )


def report(ctx: ReportContext) -> str:
    """The decided-at depth section: the means per token group with their intervals, and the
    figure."""
    table = ctx.tables.get("decided_depth")
    if table is None or not table.height:
        return ""
    hist = ctx.tables["decided_depth_hist"]
    order = pl.col("group").replace_strict(GROUPS, range(len(GROUPS)))
    rows = key_rows(
        table.sort(*KEY, "lens", order),
        ctx.names,
        lambda r: [
            r["lens"],
            r["group"],
            str(r["n_tokens"]),
            fmt(r["mean"], digits=3),
            f"[{fmt(r['ci_low'], digits=3)}, {fmt(r['ci_high'], digits=3)}]",
        ],
    )
    header = [
        "Model",
        "Task",
        "Lens",
        "Group",
        "Tokens",
        "Mean (decided + 1) / L",
        f"{LEVEL:g}% CI",
    ]
    return "\n\n".join(
        [
            "For every token with a next token, the block from which the lens (the final logit "
            "lens, and each learned lens stored: methods §17) already "
            "ranks the model's own prediction first and keeps it there (L: only at the output). "
            "Means over tokens of the relative depth (decided + 1) / L, for all tokens, split by "
            "whether the prediction is the actual next token, and by the frequency quartile of "
            "the predicted token among the task's tokens; intervals: bootstrap over documents "
            f"({RESAMPLES} resamples).",
            markdown_table(header, rows),
            plots.figure_link(
                ctx,
                "decided_depth.png",
                "Decided-at depth",
                lambda: decided_figure(table, hist, plots.short_names(ctx.names)),
            ),
        ]
    )


ANALYSIS = Analysis(
    name="decided_depth",
    title="Running text: decided-at depth",
    methods=(16,),
    tables=tables,
    report=report,
    kinds=(TEXT_KIND,),
    needs=("token_lens",),
    order=140,
)
