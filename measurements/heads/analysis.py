"""Heads and the parts that beat the whole (methods §8), from the cache alone.

Tables (one row per model and task unless said otherwise):

- ``head_scores``: per (model, task, estimator, attention component, head): the head's accuracy
  alone, its calibrated accuracy, its mean gold margin, and its bias and diversity shares within
  its block (the block's heads as an ensemble, methods §2 with the heads as members).
- ``component_scores``: per (model, task, component): the same three scores for every residual
  component (embedding, attention and MLP blocks), so that partitions without heads have them too.
- ``head_summary``: the full model's accuracy (and its label-free calibrated accuracy), how many
  heads and components beat the full model, like with like (a part's accuracy against the full
  model's, its calibrated accuracy against the calibrated full model's), and the best ones.

Component reweighting (option ``reweight``) is its own analysis, :mod:`.reweight`.

Partitions extracted without ``--heads`` get a note and their component-level rows; asking the
API for their head scores (:func:`head_scores`) is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from layerdiv.analyze.decomposition import argmax, load_wide, with_softmax
from layerdiv.analyze.frames import selected, tag
from layerdiv.analyze.options import ESTIMATORS
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    map_partitions,
    not_extracted,
    partition_engine,
)
from layerdiv.measurements.heads.report import heads_section
from layerdiv.schemas import GRIDS
from layerdiv.store import PartitionInfo, Store, StoreError
from layerdiv.store.key import KEY
from layerdiv.store.parts import dense, in_key_order


class NoHeadsError(StoreError):
    """Head scores were asked for a partition extracted without ``--heads``."""


def has_heads(info: PartitionInfo) -> bool:
    """Whether every complete chunk of the partition has its ``heads`` part (a partition being
    extended with ``--heads`` may lack some: ``PartitionInfo.incomplete``)."""
    return "heads" in info.tables


def require_heads(parts: Sequence[PartitionInfo]) -> None:
    """Refuse (one line, :func:`~layerdiv.analyze.registry.not_extracted`) partitions without a
    complete heads table."""
    lacking = [p for p in parts if not has_heads(p)]
    if lacking:
        raise NoHeadsError(
            not_extracted(parts, "heads", "Head scores")
            or f"Head scores: the heads table of {lacking[0].key.label} is incomplete "
            f"(`{lacking[0].extract_command('heads')}` completes it)."
        )


def _u(k_opts: int) -> list[pl.Expr]:
    return [pl.col(f"u{k}") for k in range(k_opts)]


def load_heads(info: PartitionInfo) -> pl.DataFrame:
    """The partition's heads as one row per (instance, attention component, head), sorted, with
    columns instance, pos (the instance's position 0..N-1), component, layer, head, gold and
    u0..u{K-1} (u_(b,h)[k] in float64; head -1 is the output projection's bias).

    Refuses (``StoreError``) rows that do not hold the same heads of every attention component
    for every instance, each option once (``layerdiv.store.parts.dense``)."""
    manifest = info.manifest
    k_opts = len(manifest.options)
    grid = GRIDS["heads"]
    keys = [*grid.units, *grid.cells]
    rows = in_key_order(info.scan("heads").select(*keys, "layer", "logit").collect(), keys)
    instances = info.scan("instances").select("instance", "gold").sort("instance").collect()
    first = rows.filter(pl.col("instance") == rows["instance"][0]) if rows.height else rows
    pairs = first.select("component", "head").unique(maintain_order=True)
    attn = {c for c, comp in enumerate(manifest.components) if comp.kind == "attn"}
    if set(pairs["component"]) != attn:  # every attention component, no other
        pairs = pairs.clear()
    cells = pairs.select(pl.all().repeat_by(k_opts).explode()).with_columns(
        option=pl.int_range(pl.len()) % k_opts
    )
    dense(rows, "heads", instances.select(grid.units), cells, info.where, "--heads ")
    groups = cells.height // k_opts
    wide = rows.select(
        *(pl.col(c).gather_every(k_opts) for c in ("instance", "component", "layer", "head")),
        *(
            pl.col("logit").gather_every(k_opts, offset=k).cast(pl.Float64).alias(f"u{k}")
            for k in range(k_opts)
        ),
    ).with_columns((pl.int_range(pl.len()) // groups).alias("pos"))
    return wide.hstack(instances.select("gold")[wide["pos"]])


def with_predictions(frame: pl.LazyFrame, k_opts: int, by: Sequence[str]) -> pl.LazyFrame:
    """Add, per row (one member of one instance), ``correct``: argmax_k u[k] is the gold option;
    ``calibrated_correct``: argmax_k of u[k] minus its mean over the task's instances (the mean
    taken within the member ``by``; methods §8, label-free); ``margin``: u[gold] -
    max_{k != gold} u[k] (positive when the member alone is right)."""
    u, gold = _u(k_opts), pl.col("gold")
    centred = [pl.col(f"_c{k}") for k in range(k_opts)]
    return (
        frame.with_columns((x - x.mean().over(by)).alias(f"_c{k}") for k, x in enumerate(u))
        .with_columns(
            (argmax(u) == gold).alias("correct"),
            (argmax(centred) == gold).alias("calibrated_correct"),
            (
                pl.coalesce([pl.when(gold == k).then(x) for k, x in enumerate(u)])
                - pl.max_horizontal([pl.when(gold != k).then(x) for k, x in enumerate(u)])
            ).alias("margin"),
        )
        .drop(f"_c{k}" for k in range(k_opts))
    )


_SCORES = (
    pl.col("correct").mean().alias("accuracy"),
    pl.col("calibrated_correct").mean().alias("calibrated_accuracy"),
    pl.col("margin").mean(),
)


def with_block_terms(frame: pl.LazyFrame, k_opts: int) -> pl.LazyFrame:
    """Add each head's member terms in its block's ensemble (methods §2 with the heads
    h >= 0 of one attention component and one instance as the members): ``bias`` = mean_k
    (y_k - p_h[k])^2 with p_h = softmax(u_h) (Eq. 14), and ``diversity_paper`` = mean_k
    (ubar_k - u_h[k])^2 (Eq. 8, logits) and ``diversity_ensemble`` = mean_k (pbar_k - p_h[k])^2
    (probabilities), ubar and pbar the means over the block's heads."""
    u = _u(k_opts)
    p = [pl.col(f"_p{k}") for k in range(k_opts)]
    block = ["instance", "component"]
    y = [(pl.col("gold") == k).cast(pl.Float64) for k in range(k_opts)]
    return (
        with_softmax(frame, u, "_p")
        .with_columns(
            (pl.sum_horizontal([(y[k] - p[k]) ** 2 for k in range(k_opts)]) / k_opts).alias("bias"),
            *(
                (
                    pl.sum_horizontal([(m.mean().over(block) - m) ** 2 for m in members]) / k_opts
                ).alias(f"diversity_{est}")
                for est, members in zip(ESTIMATORS, (u, p), strict=True)
            ),
        )
        .drop(f"_p{k}" for k in range(k_opts))
    )


def head_scores_of(info: PartitionInfo, heads: pl.DataFrame) -> pl.DataFrame:
    """Per (estimator, component, head h >= 0) of one partition (``heads`` from
    :func:`load_heads`): layer, head name, accuracy, calibrated_accuracy, margin (means over
    instances), bias and diversity (means over instances of the member terms of
    :func:`with_block_terms`) and their shares of the block's totals (paper Eqs. 9-10 with the
    heads as the members: share_h = sum_i term_(i,h) / sum_i sum_h' term_(i,h'))."""
    k_opts = len(info.manifest.options)
    members = heads.lazy().filter(pl.col("head") >= 0)
    per_head = (
        with_block_terms(with_predictions(members, k_opts, ["component", "head"]), k_opts)
        .group_by("component", "head")
        .agg(
            pl.col("layer").first(),
            *_SCORES,
            pl.col("bias", *(f"diversity_{e}" for e in ESTIMATORS)).mean(),
        )
        .collect()
    )
    names = pl.DataFrame(
        {"component": range(len(info.manifest.components))},
        schema={"component": pl.Int16},
    ).with_columns(pl.Series("block", [c.name for c in info.manifest.components]))
    share = (pl.col("bias") / pl.col("bias").sum().over("component")).alias("bias_share")
    frames = [
        per_head.select(
            pl.lit(est).alias("estimator"),
            "component",
            "layer",
            "head",
            "accuracy",
            "calibrated_accuracy",
            "margin",
            "bias",
            pl.col(f"diversity_{est}").alias("diversity"),
            share,
            (pl.col(f"diversity_{est}") / pl.col(f"diversity_{est}").sum().over("component")).alias(
                "diversity_share"
            ),
        )
        for est in ESTIMATORS
    ]
    return (
        pl.concat(frames)
        .join(names, on="component")
        .with_columns(
            pl.concat_str(pl.col("block"), pl.lit(".h"), pl.col("head").cast(pl.String)).alias(
                "name"
            )
        )
        .drop("block")
        .sort("estimator", "component", "head")
    )


def component_scores_of(info: PartitionInfo, wide: pl.DataFrame) -> pl.DataFrame:
    """Per component of one partition (``wide`` from ``load_wide``): name, kind, layer,
    accuracy, calibrated_accuracy and margin of the component alone (:func:`with_predictions`)."""
    k_opts = len(info.manifest.options)
    infos = info.manifest.components
    names = pl.DataFrame(
        {
            "component": range(len(infos)),
            "name": [c.name for c in infos],
            "layer": [c.layer for c in infos],
        },
        schema={"component": pl.Int16, "name": pl.String, "layer": pl.Int16},
    )
    return (
        with_predictions(wide.lazy(), k_opts, ["component"])
        .group_by("component")
        .agg(pl.col("kind").first(), *_SCORES)
        .collect()
        .with_columns(pl.col("component").cast(pl.Int16))
        .join(names, on="component")
        .select("component", "name", "kind", "layer", "accuracy", "calibrated_accuracy", "margin")
        .sort("component")
    )


def n_instances(wide: pl.DataFrame) -> int:
    """Instances of a partition's wide rows (:func:`~layerdiv.analyze.decomposition.load_wide`)."""
    return int(wide.select(pl.col("pos").max()).item()) + 1


def _best(frame: pl.DataFrame, column: str) -> tuple[str | None, float | None]:
    """Name and value of the row of ``frame`` with the largest ``column`` (first on ties)."""
    if frame.height == 0:
        return None, None
    row = frame.row(int(frame[column].arg_max() or 0), named=True)
    return row["name"], row[column]


def summary_row(
    full: tuple[float, float], components: pl.DataFrame, heads: pl.DataFrame | None
) -> dict[str, object]:
    """The ``head_summary`` row of one partition: ``full`` is the full model's (accuracy,
    calibrated accuracy); ``components`` and ``heads`` (one estimator's rows, or None without
    heads) their score tables. A part beats the whole when its accuracy is strictly above the
    full model's, and calibrated when its calibrated accuracy is strictly above the calibrated
    full model's (like with like). The constant ``bias`` component is left out."""
    accuracy, calibrated = full
    row: dict[str, object] = {"accuracy": accuracy, "calibrated_accuracy": calibrated}
    parts = {"components": components.filter(pl.col("kind") != "bias")}
    if heads is not None:
        parts["heads"] = heads
    for label in ("heads", "components"):
        frame = parts.get(label)
        singular = label[:-1]
        if frame is None:
            row.update(
                {
                    f"n_{label}": None,
                    f"{label}_beat": None,
                    f"{label}_beat_calibrated": None,
                    f"best_{singular}": None,
                    f"best_{singular}_accuracy": None,
                    f"best_calibrated_{singular}": None,
                    f"best_{singular}_calibrated_accuracy": None,
                }
            )
            continue
        best, best_acc = _best(frame, "accuracy")
        best_cal, best_cal_acc = _best(frame, "calibrated_accuracy")
        row.update(
            {
                f"n_{label}": frame.height,
                f"{label}_beat": int((frame["accuracy"] > accuracy).sum()),
                f"{label}_beat_calibrated": int((frame["calibrated_accuracy"] > calibrated).sum()),
                f"best_{singular}": best,
                f"best_{singular}_accuracy": best_acc,
                f"best_calibrated_{singular}": best_cal,
                f"best_{singular}_calibrated_accuracy": best_cal_acc,
            }
        )
    return row


def _full_scores(wide: pl.DataFrame, k_opts: int) -> tuple[float, float]:
    """The full model's accuracy (argmax of sum_c u_c) and its label-free calibrated accuracy
    (the same after subtracting the mean over the task's instances of the full logits)."""
    full = (
        wide.lazy()
        .group_by("pos")
        .agg(pl.col("gold").first(), *(pl.col(f"u{k}").sum() for k in range(k_opts)))
        .with_columns(pl.lit(0).alias("member"))
    )
    scored = with_predictions(full, k_opts, ["member"]).select(*_SCORES[:2]).collect()
    return scored.item(0, "accuracy"), scored.item(0, "calibrated_accuracy")


def heads_tables(parts: Sequence[PartitionInfo], notes: list[str]) -> dict[str, pl.DataFrame]:
    """Every table of this module for ``parts`` (see the module docstring); partitions without
    heads get a line in ``notes`` and their component-level rows only."""

    def partition(info: PartitionInfo) -> dict[str, Any]:
        """One partition's frames and summary row, by table."""
        k_opts = len(info.manifest.options)
        wide = load_wide(info)
        heads = load_heads(info) if has_heads(info) else None
        comps = component_scores_of(info, wide)
        head_rows = None if heads is None else head_scores_of(info, heads)
        first_estimator = (
            None if head_rows is None else head_rows.filter(pl.col("estimator") == ESTIMATORS[0])
        )
        summary = summary_row(_full_scores(wide, k_opts), comps, first_estimator)
        n = n_instances(wide)
        key = dict(info.key.items())
        out: dict[str, Any] = {
            "component_scores": tag(comps, info),
            "head_scores": None if head_rows is None else tag(head_rows, info),
            "head_summary": {**key, "n_instances": n, **summary},
        }
        return out

    found: dict[str, list[Any]] = {name: [] for name in TABLES}
    for out in map_partitions(partition, parts):
        for name, value in out.items():
            if value is not None:
                found[name].append(value)
    if line := not_extracted(parts, "heads", "Head scores"):
        notes.append(f"{line[:-1]}; their components only are in the heads tables.")
    return {
        name: pl.DataFrame(found[name], schema=TABLES[name])
        if name == "head_summary"
        else (pl.concat(found[name]) if found[name] else pl.DataFrame(schema=TABLES[name]))
        for name in TABLES
    }


_NAMES = dict.fromkeys(KEY, pl.String)
TABLES: dict[str, dict[str, type[pl.DataType] | pl.DataType]] = {
    "head_scores": {
        **_NAMES,
        "estimator": pl.String,
        "component": pl.Int16,
        "layer": pl.Int16,
        "head": pl.Int16,
        "accuracy": pl.Float64,
        "calibrated_accuracy": pl.Float64,
        "margin": pl.Float64,
        "bias": pl.Float64,
        "diversity": pl.Float64,
        "bias_share": pl.Float64,
        "diversity_share": pl.Float64,
        "name": pl.String,
    },
    "component_scores": {
        **_NAMES,
        "component": pl.Int16,
        "name": pl.String,
        "kind": pl.String,
        "layer": pl.Int16,
        "accuracy": pl.Float64,
        "calibrated_accuracy": pl.Float64,
        "margin": pl.Float64,
    },
    "head_summary": {
        **_NAMES,
        "n_instances": pl.Int64,
        "accuracy": pl.Float64,
        "calibrated_accuracy": pl.Float64,
        **{
            name: dtype
            for label in ("heads", "components")
            for name, dtype in (
                (f"n_{label}", pl.Int64),
                (f"{label}_beat", pl.Int64),
                (f"{label}_beat_calibrated", pl.Int64),
                (f"best_{label[:-1]}", pl.String),
                (f"best_{label[:-1]}_accuracy", pl.Float64),
                (f"best_calibrated_{label[:-1]}", pl.String),
                (f"best_{label[:-1]}_calibrated_accuracy", pl.Float64),
            )
        },
    },
}
"""Column types of every table of this module (the empty tables when nothing applies)."""


@partition_engine
def head_scores(
    store: Store | str | Path, models: Iterable[str] = (), tasks: Iterable[str] = ()
) -> pl.DataFrame:
    """``head_scores`` of the selected partitions; refuses (one line) partitions extracted
    without ``--heads``."""
    parts = selected(store, models, tasks)
    require_heads(parts)
    return pl.concat([tag(head_scores_of(p, load_heads(p)), p) for p in parts])


def _tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    return heads_tables(ctx.parts, ctx.notes)


ANALYSIS = Analysis(
    name="heads",
    title="Heads: the parts that beat the whole",
    methods=(8, 2),
    tables=_tables,
    report=heads_section,
    order=50,
)
