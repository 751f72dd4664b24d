"""Running text, logit lens (``extract --lens``, methods §9): per (model, task, layer),
how far the lens distribution p_l at block input l is from the model's output.

Table ``text_lens``: per (model, task, layer l = 0..L; l = L is the model's own output):
``relative_depth`` l / L, ``n_documents``, and the means of ``kl`` = KL(p_l || p_L),
``top5_overlap`` = |top5(p_l) & top5(p_L)| / 5 and ``ce`` = -log p_l(next token): the mean over
the positions of a document first, then over documents (a document's last position has no ``ce``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.markdown import fmt, markdown_table
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
    register,
)
from layerdiv.analyze.text import TEXT_KIND, batches, combine, sums, tag, with_table
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

LENS = ("kl", "top5_overlap", "ce")
"""Per-token lens columns of ``token_lens``."""

LENS_ROWS = 1 << 20
"""Rows of ``token_lens`` read at once."""


def document_means(frames: Iterable[pl.DataFrame]) -> pl.DataFrame:
    """Per (doc, layer): the mean of each lens column over the document's positions (methods
    §9: first over positions within a document), from batches of ``token_lens`` rows (a
    document may span batches: their sums and counts add up)."""
    return combine((sums(f, ["doc", "layer"], LENS) for f in frames), ["doc", "layer"], LENS)


def lens_table(doc_means: pl.DataFrame, blocks: int) -> pl.DataFrame:
    """Per layer: the means over documents of the per-document means (methods §9: then
    over documents), ``n_documents`` and ``relative_depth`` l / L."""
    return (
        doc_means.group_by("layer")
        .agg(
            pl.col("doc").n_unique().alias("n_documents"),
            *(pl.col(f"{c}_mean").mean().alias(c) for c in LENS),
        )
        .with_columns(
            pl.col("layer").cast(pl.Int16), (pl.col("layer") / blocks).alias("relative_depth")
        )
        .select("layer", "relative_depth", "n_documents", *LENS)
        .sort("layer")
    )


def partition_lens(info: PartitionInfo) -> pl.DataFrame:
    """``text_lens`` of one text partition, read batch by batch."""
    frames = batches(info, "token_lens", ["doc", "layer", *LENS], LENS_ROWS)
    return tag(lens_table(document_means(frames), info.manifest.n_blocks), info)


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: ``text_lens`` of the text partitions extracted with
    ``--lens``; a note names the others."""
    parts = with_table(ctx.parts, "token_lens", ctx.notes, "logit lens")
    if not parts:
        return {}
    return {"text_lens": pl.concat(list(map_partitions(partition_lens, parts)))}


# --- report ----------------------------------------------------------------------------------

PANELS = (
    ("kl", "KL(p_l || p_L) (nats)"),
    ("top5_overlap", "top-5 overlap with the output"),
    ("ce", "cross-entropy on the next token (nats)"),
)


def _by_model(table: pl.DataFrame) -> pl.DataFrame:
    """Means over a model's tasks, per layer."""
    return (
        table.group_by("model", "layer", "relative_depth")
        .agg(pl.col(c).mean() for c in LENS)
        .sort("model", "layer")
    )


def lens_figure(
    table: pl.DataFrame, last: pl.DataFrame | None, path: Path, names: dict[str, str]
) -> Path:
    """KL, top-5 overlap and cross-entropy of the lens against relative depth (mean over a
    model's text tasks), models overlaid; dashed, where the model has choice tasks extracted with
    ``--lens``: the same at their last prompt token (``lens_curves``)."""
    return plots.text_vs_last_token(
        [(column, column, label) for column, label in PANELS],
        _by_model(table),
        None if last is None else _by_model(last),
        path,
        names,
        "relative depth l / L",
        "Logit lens at every block input (methods §9): every token of running text (solid), "
        "the last prompt token of the choice tasks (dashed)",
    )


def report(ctx: ReportContext) -> str:
    """The logit-lens section: per (model, task) the lens at mid-depth and the output's
    cross-entropy, and the lens figure."""
    if "text_lens" not in ctx.tables:
        return "No text partition was extracted with `--lens` (see the notes above)."
    table = ctx.tables["text_lens"]
    names = plots.short_names(ctx.names)
    rows = []
    for _key, sub in table.sort(*KEY, "layer").group_by(*KEY, maintain_order=True):
        model, task = sub["model"][0], sub["task"][0]
        mid = sub.filter(pl.col("layer") == sub["layer"].max() // 2)  # type: ignore[operator]
        out = sub.tail(1)
        rows.append(
            [
                ctx.names.get(str(model), str(model)),
                str(task),
                str(out["n_documents"][0]),
                fmt(mid["kl"][0], digits=3),
                fmt(mid["top5_overlap"][0], digits=3),
                fmt(mid["ce"][0], digits=3),
                fmt(out["ce"][0], digits=3),
            ]
        )
    header = [
        "Model",
        "Task",
        "Documents",
        "KL at L/2 (nats)",
        "top-5 overlap at L/2",
        "CE at L/2 (nats)",
        "CE of the model (nats)",
    ]
    return "\n\n".join(
        p
        for p in [
            "The model's own final norm and unembedding read at every block input h_l (layer L is "
            "the model's output). Means over the positions of each "
            "document, then over documents; where the same model has choice tasks extracted "
            "with `--lens`, the figure draws their last prompt token beside (dashed: where the "
            "answer is decided against the average token).",
            markdown_table(header, rows),
            plots.figure_link(
                ctx,
                "text_lens.png",
                "Logit lens",
                lambda p: lens_figure(table, ctx.tables.get("lens_curves"), p, names),
            ),
        ]
        if p
    )


register(
    Analysis(
        name="text_lens",
        title="Running text: logit lens",
        methods=("logit-lens",),
        tables=tables,
        report=report,
        kinds=(TEXT_KIND,),
    )
)
