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
- ``reweight`` and ``reweight_weights`` (option ``reweight``, ``layerdiv analyze --reweight``):
  component reweighting (:mod:`.reweight`), fitted on a few labelled instances of each task and
  evaluated on the rest, beside the full model, its calibration and the best single component
  chosen on the same instances.

Partitions extracted without ``--heads`` get a note and their component-level rows; asking the
API for their head scores (:func:`head_scores`) is refused in one line.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.analyses import reweight as rw
from layerdiv.analyze.analyses.paper import tagged
from layerdiv.analyze.decomposition import argmax, load_wide, with_softmax
from layerdiv.analyze.markdown import DASH, fmt, markdown_table, verdict
from layerdiv.analyze.options import ESTIMATORS
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    ReportContext,
    map_partitions,
    partition_engine,
    register,
)
from layerdiv.schemas import GRIDS
from layerdiv.store import PartitionInfo, Store, StoreError
from layerdiv.store.key import KEY
from layerdiv.store.parts import dense, in_key_order

HOW_TO_EXTRACT = (
    "extract them with `layerdiv extract --heads` for the same model and task (it adds the heads "
    "to the partitions already stored)"
)
TOP_HEADS = 5
"""Heads per (model, task) in the report's top heads table."""


class NoHeadsError(StoreError):
    """Head scores were asked for a partition extracted without ``--heads``."""


def has_heads(info: PartitionInfo) -> bool:
    """Whether every complete chunk of the partition has its ``heads`` part (a partition being
    extended with ``--heads`` may lack some: ``PartitionInfo.incomplete``)."""
    return "heads" in info.tables


def require_heads(parts: Iterable[PartitionInfo]) -> None:
    """Refuse (one line) partitions without a heads table."""
    missing = [p.key.label for p in parts if not has_heads(p)]
    if missing:
        raise NoHeadsError(f"no heads stored for {', '.join(missing)}: {HOW_TO_EXTRACT}")


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


def _n_instances(wide: pl.DataFrame) -> int:
    return int(wide.select(pl.col("pos").max()).item()) + 1


def _members(wide: pl.DataFrame, k_opts: int) -> np.ndarray:
    """(N, M, K) option logits of the rows of ``wide`` (sorted by instance, M rows each)."""
    n = _n_instances(wide)
    return wide.select(_u(k_opts)).to_numpy().reshape(n, -1, k_opts)


def _accuracy(logits: np.ndarray, gold: np.ndarray) -> float:
    return float((logits.argmax(axis=-1) == gold).mean()) if len(gold) else float("nan")


def reweight_partition(
    info: PartitionInfo,
    wide: pl.DataFrame,
    heads: pl.DataFrame | None,
    n_train: int = rw.N_TRAIN,
    seed: int = rw.SEED,
) -> tuple[dict[str, object], pl.DataFrame]:
    """Component reweighting on one partition: the members are the heads (bias terms included)
    and every other component when ``heads`` is given, else every component (blocks). Returns
    the ``reweight`` row and the fitted weights (one row per member)."""
    k_opts = len(info.manifest.options)
    infos = info.manifest.components
    comp = _members(wide, k_opts)  # (N, L, K); their sum is the full model (methods §1)
    gold = wide.filter(pl.col("component") == 0)["gold"].to_numpy().astype(np.int64)
    instance_ids = wide.filter(pl.col("component") == 0)["instance"].to_numpy()
    keep = [c for c, ci in enumerate(infos) if heads is None or ci.kind != "attn"]
    member_rows: dict[str, list[object]] = {
        "member": [infos[c].name for c in keep],
        "component": list(keep),
        "head": [None] * len(keep),
    }
    x = comp[:, keep]
    if heads is not None:
        x = np.concatenate([x, _members(heads, k_opts)], axis=1)
        first = heads.filter(pl.col("pos") == 0)
        for c, h in first.select("component", "head").iter_rows():
            label = "bias" if h < 0 else f"h{h}"
            member_rows["member"].append(f"{infos[c].name}.{label}")
            member_rows["component"].append(c)
            member_rows["head"].append(h)
    train, test = rw.split(len(gold), n_train, seed)
    fit = rw.fit_weights(x[train], gold[train])
    full = comp.sum(axis=1)
    calibrated = full - full.mean(axis=0)  # label-free: mean over the task's instances
    single_train = (x[train].argmax(axis=2) == gold[train, None]).mean(axis=0)
    best = int(single_train.argmax())
    row: dict[str, object] = {
        "members": "blocks" if heads is None else "heads",
        "n_members": x.shape[1],
        "n_train": len(train),
        "n_test": len(test),
        "seed": seed,
        "l1": rw.L1,
        "train_instances": instance_ids[train].tolist(),
        "n_nonzero": int((fit.weights > 0).sum()),
        "converged": fit.converged,
        "train_accuracy": _accuracy(rw.combine(x[train], fit.weights), gold[train]),
        "full_accuracy": _accuracy(full[test], gold[test]),
        "calibrated_accuracy": _accuracy(calibrated[test], gold[test]),
        "best_member": member_rows["member"][best],
        "best_member_accuracy": _accuracy(x[test, best], gold[test]),
        "reweighted_accuracy": _accuracy(rw.combine(x[test], fit.weights), gold[test]),
    }
    weights = pl.DataFrame(
        {**member_rows, "weight": fit.weights},
        schema={"member": pl.String, "component": pl.Int16, "head": pl.Int16, "weight": pl.Float64},
    )
    return row, weights


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


def heads_tables(
    parts: Sequence[PartitionInfo],
    notes: list[str],
    reweight: bool = True,
    n_train: int = rw.N_TRAIN,
    seed: int = rw.SEED,
) -> dict[str, pl.DataFrame]:
    """Every table of this module for ``parts`` (see the module docstring; the reweighting
    tables are empty unless ``reweight``); partitions without heads get a line in ``notes`` and
    their component-level rows only."""

    def partition(info: PartitionInfo) -> tuple[dict[str, Any], int]:
        """One partition's frames (by table), summary row and reweighting row (None where it
        is not fitted), and its number of instances."""
        k_opts = len(info.manifest.options)
        wide = load_wide(info)
        heads = load_heads(info) if has_heads(info) else None
        comps = component_scores_of(info, wide)
        head_rows = None if heads is None else head_scores_of(info, heads)
        first_estimator = (
            None if head_rows is None else head_rows.filter(pl.col("estimator") == ESTIMATORS[0])
        )
        summary = summary_row(_full_scores(wide, k_opts), comps, first_estimator)
        n = _n_instances(wide)
        key = dict(info.key.items())
        out: dict[str, Any] = {
            "component_scores": tagged(comps, info),
            "head_scores": None if head_rows is None else tagged(head_rows, info),
            "head_summary": {**key, "n_instances": n, **summary},
            "reweight": None,
            "reweight_weights": None,
        }
        if reweight and n > n_train:
            row, weights = reweight_partition(info, wide, heads, n_train, seed)
            out["reweight"] = {**key, **row}
            out["reweight_weights"] = tagged(weights, info)
        return out, n

    found: dict[str, list[Any]] = {name: [] for name in TABLES}
    for info, (out, n) in zip(parts, map_partitions(partition, parts), strict=True):
        for name, value in out.items():
            if value is not None:
                found[name].append(value)
        if reweight and n <= n_train:
            notes.append(
                f"Reweighting skipped for {info.key.label}: {n} instances, it needs more "
                f"than the {n_train} it trains on."
            )
    missing = [p.key.label for p in parts if not has_heads(p)]
    if missing:
        notes.append(
            f"No heads stored for {', '.join(missing)} (their components only in the heads "
            f"tables): {HOW_TO_EXTRACT}."
        )
    rows = ("head_summary", "reweight")
    return {
        name: pl.DataFrame(found[name], schema=TABLES[name])
        if name in rows
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
    "reweight": {
        **_NAMES,
        "members": pl.String,
        "n_members": pl.Int64,
        "n_train": pl.Int64,
        "n_test": pl.Int64,
        "seed": pl.Int64,
        "l1": pl.Float64,
        "train_instances": pl.List(pl.Int64),
        "n_nonzero": pl.Int64,
        "converged": pl.Boolean,
        "train_accuracy": pl.Float64,
        "full_accuracy": pl.Float64,
        "calibrated_accuracy": pl.Float64,
        "best_member": pl.String,
        "best_member_accuracy": pl.Float64,
        "reweighted_accuracy": pl.Float64,
    },
    "reweight_weights": {
        **_NAMES,
        "member": pl.String,
        "component": pl.Int16,
        "head": pl.Int16,
        "weight": pl.Float64,
    },
}
"""Column types of every table of this module (the empty tables when nothing applies)."""


@partition_engine
def head_scores(
    store: Store | str | Path, models: Iterable[str] = (), tasks: Iterable[str] = ()
) -> pl.DataFrame:
    """``head_scores`` of the selected partitions; refuses (one line) partitions extracted
    without ``--heads``."""
    st = store if isinstance(store, Store) else Store(store)
    parts = st.select(models, tasks)
    require_heads(parts)
    return pl.concat([tagged(head_scores_of(p, load_heads(p)), p) for p in parts])


# --- report ----------------------------------------------------------------------------------


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


def beat_verdicts(summary: pl.DataFrame, names: dict[str, str]) -> str:
    """Per (model, task) with heads: the verdict on "a head beats the whole", like with like:
    the best calibrated head's accuracy minus the calibrated full model's (points), with the
    normal interval of two proportions over the n instances (optimistic: the best of many heads,
    chosen on the same instances)."""
    lines = []
    for r in summary.filter(pl.col("n_heads").is_not_null()).sort(*KEY).iter_rows(named=True):
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
    return "\n".join(lines)


def heads_section(ctx: ReportContext) -> str:
    """The report's heads section: the parts that beat the whole, the heatmaps (drawn into
    ``ctx.figures``), the top heads and the reweighting results."""
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
        beat_verdicts(summary, names),
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
    reweight = tables["reweight"]
    if reweight.height:
        parts += [
            "### Component reweighting",
            "Weights w in [0, 1] per member (heads and the other components, or blocks where no "
            "heads are stored), prediction argmax Σ w·u, fitted on a few labelled instances "
            "(cross-entropy + λ·Σw, L-BFGS-B from w = 1) and evaluated on the rest of the task; "
            "the best single member is chosen on the same training instances. The training "
            "instances are listed in the `reweight` table (`train_instances`, `seed`).",
            markdown_table(
                [
                    "Model",
                    "Task",
                    "Members",
                    "Train / test",
                    "Full (%)",
                    "Calibrated full (%)",
                    "Best single (%)",
                    "Reweighted (%)",
                    "Non-zero weights",
                ],
                [
                    [
                        names.get(r["model"], r["model"]),
                        r["task"],
                        r["members"],
                        f"{r['n_train']} / {r['n_test']}",
                        _pct(r["full_accuracy"]),
                        _pct(r["calibrated_accuracy"]),
                        f"{r['best_member']} ({_pct(r['best_member_accuracy'])})",
                        _pct(r["reweighted_accuracy"]),
                        f"{r['n_nonzero']} of {r['n_members']}",
                    ]
                    for r in reweight.sort(*KEY).iter_rows(named=True)
                ],
            ),
        ]
    return "\n\n".join(parts)


def _tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    return heads_tables(ctx.parts, ctx.notes, reweight=bool(ctx.options.get("reweight")))


register(
    Analysis(
        name="heads",
        title="Heads: the parts that beat the whole",
        methods=(8, 2),
        tables=_tables,
        report=heads_section,
        options={"reweight": "also fit component reweighting (tables reweight, reweight_weights)"},
    )
)
