"""Component reweighting (option ``reweight``, ``layerdiv analyze --reweight``), the method of
the work the paper builds on (LLMDecomp: Chang et al., "When Parts Are Greater Than Sums",
``train_components.py``): a weight w_c in [0, 1] per component, the prediction argmax_k sum_c w_c
u_c[k], fitted on a few labelled instances of each task and evaluated on the rest, beside the full
model, its calibration and the best single component chosen on the same instances (methods §8).

Tables (empty unless the option is given): ``reweight``, one row per (model, task), and
``reweight_weights``, the fitted weight of every member. The members are the heads (bias terms
included) and every other component where ``extract --heads`` stored heads, else every component.

LLMDecomp minimises mean cross-entropy + lambda * ||w||_1 by SGD from w = 1 and stops early; here
the same penalised objective is solved to convergence with L-BFGS-B (bounds [0, 1], analytic
gradient), also from w = 1, so the result depends only on the training instances. NumPy and SciPy
only (no torch), CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import click
import numpy as np
import polars as pl

from layerdiv.analyze.decomposition import load_wide
from layerdiv.analyze.frames import tag
from layerdiv.analyze.markdown import fmt, markdown_table
from layerdiv.analyze.registry import Analysis, Context, ReportContext, map_partitions
from layerdiv.measurements.heads.analysis import has_heads, load_heads, n_instances
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

N_TRAIN = 24
"""Labelled instances the weights are fitted on (LLMDecomp's default)."""
L1 = 1e-2
"""Weight of the L1 penalty lambda * sum_c w_c (LLMDecomp's default)."""
SEED = 0
"""Seed of the random choice of the training instances."""


@dataclass(frozen=True)
class Fit:
    """Fitted weights and how the optimiser ended."""

    weights: np.ndarray
    """(M,) w_c in [0, 1], one per member."""
    loss: float
    """Penalised training loss at ``weights``."""
    converged: bool
    iterations: int


def objective(w: np.ndarray, x: np.ndarray, y: np.ndarray, l1: float) -> tuple[float, np.ndarray]:
    """Mean cross-entropy of softmax(sum_c w_c u_c) against the gold options ``y`` plus
    ``l1`` * sum_c w_c (w >= 0, so that is the L1 norm), and its gradient in w.

    ``x`` is (n, M, K): u_c[k] of each instance and member. With z = sum_c w_c u_c and
    q = softmax(z), d CE / d w_c = mean_i sum_k (q_ik - y_ik) u_ic[k]."""
    n = x.shape[0]
    z = combine(x, w)
    z = z - z.max(axis=1, keepdims=True)
    log_q = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    rows = np.arange(n)
    loss = -log_q[rows, y].mean() + l1 * w.sum()
    residual = np.exp(log_q)
    residual[rows, y] -= 1.0
    grad = np.einsum("nk,nmk->m", residual, x) / n + l1
    return float(loss), grad


def fit_weights(x: np.ndarray, y: np.ndarray, l1: float = L1) -> Fit:
    """Minimise :func:`objective` over w in [0, 1]^M from w = 1 (the full model)."""
    from scipy.optimize import Bounds, minimize
    from threadpoolctl import threadpool_limits

    # The problem is small (M up to a few thousand, 24 instances): BLAS threads only add
    # synchronisation (measured: 20x less CPU time with one thread, on 2 busy cores).
    with threadpool_limits(1):
        result = minimize(
            objective,
            np.ones(x.shape[1]),
            args=(x, y, l1),
            jac=True,
            method="L-BFGS-B",
            bounds=Bounds(0.0, 1.0),
        )
    return Fit(np.clip(result.x, 0.0, 1.0), float(result.fun), bool(result.success), result.nit)


def split(n: int, n_train: int = N_TRAIN, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Positions 0..n-1 split into ``n_train`` training positions chosen at random with ``seed``
    and the rest (both sorted)."""
    order = np.random.default_rng(seed).permutation(n)
    return np.sort(order[:n_train]), np.sort(order[n_train:])


def combine(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The reweighted logits sum_c w_c u_c[k] of every instance of ``x`` (n, M, K)."""
    return np.einsum("nmk,m->nk", x, w)


# --- the analysis ----------------------------------------------------------------------------


def _members(wide: pl.DataFrame, k_opts: int) -> np.ndarray:
    """(N, M, K) option logits of the rows of ``wide`` (sorted by instance, M rows each)."""
    n = n_instances(wide)
    return wide.select(f"u{k}" for k in range(k_opts)).to_numpy().reshape(n, -1, k_opts)


def _accuracy(logits: np.ndarray, gold: np.ndarray) -> float:
    return float((logits.argmax(axis=-1) == gold).mean()) if len(gold) else float("nan")


def reweight_partition(
    info: PartitionInfo,
    wide: pl.DataFrame,
    heads: pl.DataFrame | None,
    n_train: int = N_TRAIN,
    seed: int = SEED,
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
    train, test = split(len(gold), n_train, seed)
    fit = fit_weights(x[train], gold[train])
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
        "l1": L1,
        "train_instances": instance_ids[train].tolist(),
        "n_nonzero": int((fit.weights > 0).sum()),
        "converged": fit.converged,
        "train_accuracy": _accuracy(combine(x[train], fit.weights), gold[train]),
        "full_accuracy": _accuracy(full[test], gold[test]),
        "calibrated_accuracy": _accuracy(calibrated[test], gold[test]),
        "best_member": member_rows["member"][best],
        "best_member_accuracy": _accuracy(x[test, best], gold[test]),
        "reweighted_accuracy": _accuracy(combine(x[test], fit.weights), gold[test]),
    }
    weights = pl.DataFrame(
        {**member_rows, "weight": fit.weights},
        schema={"member": pl.String, "component": pl.Int16, "head": pl.Int16, "weight": pl.Float64},
    )
    return row, weights


_NAMES = dict.fromkeys(KEY, pl.String)
TABLES: dict[str, dict[str, type[pl.DataType] | pl.DataType]] = {
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
"""Column types of the tables of this module (empty when the option is not given)."""


def reweight_tables(
    parts: Sequence[PartitionInfo], notes: list[str], n_train: int = N_TRAIN, seed: int = SEED
) -> dict[str, pl.DataFrame]:
    """``reweight`` and ``reweight_weights`` of ``parts``; a partition with no more instances
    than ``n_train`` is skipped with a note."""

    def partition(info: PartitionInfo) -> tuple[dict[str, Any] | None, pl.DataFrame | None, int]:
        wide = load_wide(info)
        n = n_instances(wide)
        if n <= n_train:
            return None, None, n
        heads = load_heads(info) if has_heads(info) else None
        row, weights = reweight_partition(info, wide, heads, n_train, seed)
        return {**dict(info.key.items()), **row}, tag(weights, info), n

    rows, frames = [], []
    for info, (row, weights, n) in zip(parts, map_partitions(partition, parts), strict=True):
        if row is None or weights is None:
            notes.append(
                f"Reweighting skipped for {info.key.label}: {n} instances, it needs more "
                f"than the {n_train} it trains on."
            )
        else:
            rows.append(row)
            frames.append(weights)
    return {
        "reweight": pl.DataFrame(rows, schema=TABLES["reweight"]),
        "reweight_weights": pl.concat(frames)
        if frames
        else pl.DataFrame(schema=TABLES["reweight_weights"]),
    }


def report(ctx: ReportContext) -> str:
    """The reweighting section: the reweighted accuracy beside the full model's, its calibration
    and the best single member ("" when the option was not given)."""
    reweight = ctx.tables["reweight"]
    if not reweight.height:
        return ""
    names = ctx.names
    return "\n\n".join(
        [
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
                        fmt(r["full_accuracy"], 100),
                        fmt(r["calibrated_accuracy"], 100),
                        f"{r['best_member']} ({fmt(r['best_member_accuracy'], 100)})",
                        fmt(r["reweighted_accuracy"], 100),
                        f"{r['n_nonzero']} of {r['n_members']}",
                    ]
                    for r in reweight.sort(*KEY).iter_rows(named=True)
                ],
            ),
        ]
    )


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: :func:`reweight_tables` when the option ``reweight`` is given,
    else the empty tables."""
    if not ctx.options.get("reweight"):
        return {name: pl.DataFrame(schema=schema) for name, schema in TABLES.items()}
    return reweight_tables(ctx.parts, ctx.notes)


ANALYSIS = Analysis(
    name="reweight",
    title="Component reweighting",
    methods=(8,),
    tables=tables,
    report=report,
    options={
        "reweight": click.Option(
            ["--reweight"],
            is_flag=True,
            help="Also fit component reweighting (LLMDecomp) on 24 labelled instances per task "
            "and evaluate it on the rest (CPU; tables reweight and reweight_weights).",
        )
    },
    order=60,
)
