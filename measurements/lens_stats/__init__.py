"""``--lens-stats``: the sufficient statistics of the least-squares lens (methods §17,
``lens_stats`` table) on a text task: per block l = 0..L-1, the float64 sums over every token of
a part's documents of h_l, h_L, h_l h_l^T and h_l h_L^T, and their count n (h_L the last residual
state before the final norm). A part's sums are of its own documents alone, so a partition's
sums are its parts' sums, however its chunks were sharded, resumed or merged. The hooks are
:class:`layerdiv.measurements.lens_stats.hooks.LensStatsCapture`; ``layerdiv fit-lens --kind ls``
solves the lens from a partition's sums (:func:`read_sums`, :func:`ls_translators`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from layerdiv.errors import LayerdivError
from layerdiv.measurements.registry import Measurement, ModelShape
from layerdiv.schemas import LENS_STATS as LENS_STATS_SCHEMA
from layerdiv.schemas import Rules
from layerdiv.schemas.kinds import KINDS
from layerdiv.store.translators import Translators

DEFAULT_RIDGE = 1e-4
"""lambda of the least-squares lens as a multiple of the mean diagonal of the centred
covariance of h_l (methods §17's default)."""


class LensStatsError(LayerdivError, ValueError):
    """Lens statistics that cannot be summed or solved: a partition without them, or with
    some of its documents lacking them, or sums of one run mixed with another's."""


@dataclass(frozen=True)
class LensSums:
    """The float64 sums of methods §17 over ``n`` tokens, for blocks l = 0..L-1."""

    n: int
    h: np.ndarray
    """(L, d): sum h_l."""
    final: np.ndarray
    """(d,): sum h_L."""
    hh: np.ndarray
    """(L, d, d): sum h_l h_l^T."""
    hf: np.ndarray
    """(L, d, d): sum h_l h_L^T."""

    def __add__(self, other: LensSums) -> LensSums:
        return LensSums(
            self.n + other.n,
            self.h + other.h,
            self.final + other.final,
            self.hh + other.hh,
            self.hf + other.hf,
        )


def lens_stats_table(sums: LensSums) -> pa.Table:
    """The L rows (block order) of :data:`~layerdiv.schemas.LENS_STATS` holding ``sums``."""
    blocks, d = sums.h.shape

    def lists(values: np.ndarray) -> pa.Array:
        flat = np.ascontiguousarray(values, np.float64).reshape(blocks, -1)
        offsets = np.arange(blocks + 1, dtype=np.int32) * flat.shape[1]
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.reshape(-1)))

    return pa.table(
        {
            "block": pa.array(np.arange(blocks, dtype=np.int16)),
            "tokens": pa.array(np.full(blocks, sums.n, np.int64)),
            "sum_h": lists(sums.h),
            "sum_final": lists(np.broadcast_to(sums.final, (blocks, d))),
            "sum_hh": lists(sums.hh),
            "sum_hfinal": lists(sums.hf),
        },
        schema=LENS_STATS_SCHEMA,
    )


def lens_stats_rows(docs: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``lens_stats`` rows of a part holding documents ``docs``: its run's sums. Each value
    is a batch's contribution (the hooks' ``Contribution``), which :meth:`fold` adds to the sums
    of the run it ran in (once) and returns them; a part holds exactly one run's documents."""
    runs = {id(r): r for r in (v.fold() for v in values)}
    if len(runs) != 1 or next(iter(runs.values())).docs != set(docs):
        raise LensStatsError(
            f"--lens-stats: the sums of documents {docs[0]}..{docs[-1]} are not one run's "
            "(a batch of another run, or a run split across parts); nothing of this chunk was "
            "written"
        )
    return {"lens_stats": lens_stats_table(next(iter(runs.values())).totals())}


def whole_blocks(
    rows: Mapping[str, int], blocks: int, settings: Mapping[str, Any]
) -> tuple[str, str] | None:
    """A part of ``lens_stats`` holds one row per block: exactly L rows."""
    found = rows.get("lens_stats")
    if found is not None and found != blocks:
        return "lens_stats", f"{found} rows where a part holds one per block ({blocks})"
    return None


def lens_stats_cost(
    shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]
) -> float:
    """Per token and block, the products h_l h_l^T and h_l h_L^T: 2 d^2 multiply-adds, 4 d^2
    FLOPs (in float64); the sums of h_l and h_L are negligible."""
    return 4.0 * shape.layers * shape.d**2 * tokens


def read_sums(info: Any) -> LensSums:
    """The sums of a text partition (``layerdiv.store.PartitionInfo``): its parts' sums added in
    part order. Refuses a partition without ``lens_stats``, or whose stored documents some lack
    them (each part is one run's documents: none is counted twice)."""
    if "lens_stats" not in info.tables:
        raise LensStatsError(
            f"{info.where} has no lens statistics; extract it with "
            f"`{info.extract_command('lens_stats')}`"
        )
    lacking = info.lacking.get("lens_stats", [])
    if lacking:
        raise LensStatsError(
            f"{info.where}: {sum(n for _, n in lacking)} stored documents lack their lens "
            f"statistics; complete them with `{info.extract_command('lens_stats')}`"
        )
    blocks = info.manifest.n_blocks
    total: LensSums | None = None
    columns = ["block", "tokens", "sum_h", "sum_final", "sum_hh", "sum_hfinal"]
    for batch in info.batches("lens_stats", columns, rows=blocks):
        if batch.num_rows != blocks or batch.column("block").to_pylist() != list(range(blocks)):
            raise LensStatsError(
                f"{info.where}: a lens_stats part does not hold blocks 0..{blocks - 1} in order; "
                "re-extract it with --lens-stats --overwrite"
            )
        flat = {c: batch.column(c).values.to_numpy() for c in columns[2:]}
        d = flat["sum_h"].size // blocks
        part = LensSums(
            int(batch.column("tokens")[0].as_py()),
            flat["sum_h"].reshape(blocks, d),
            flat["sum_final"].reshape(blocks, d)[0],
            flat["sum_hh"].reshape(blocks, d, d),
            flat["sum_hfinal"].reshape(blocks, d, d),
        )
        total = part if total is None else total + part
    assert total is not None  # some stored chunk holds them
    return total


def ls_translators(
    sums: LensSums, ridge: float | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The least-squares lens of methods §17 in closed form: per block, A_l and b_l minimising
    the mean over the summed tokens of ||A_l h_l + b_l - h_L||^2 + lambda_l ||A_l - I||_F^2.
    With means m_l, m_L, covariance C_l = E[(h_l - m_l)(h_l - m_l)^T] and cross-covariance
    X_l = E[(h_l - m_l)(h_L - m_L)^T], A_l^T = (C_l + lambda_l I)^-1 (X_l + lambda_l I) and
    b_l = m_L - A_l m_l. ``ridge``: lambda_l as a multiple of the mean diagonal of C_l (None:
    :data:`DEFAULT_RIDGE`). Returns A (L, d, d), b (L, d) and lambda (L,), float64."""
    scale = DEFAULT_RIDGE if ridge is None else ridge
    n = float(sums.n)
    mh, mf = sums.h / n, sums.final / n
    cov = sums.hh / n - mh[:, :, None] * mh[:, None, :]
    cross = sums.hf / n - mh[:, :, None] * mf[None, None, :]
    d = mh.shape[1]
    lam = scale * np.trace(cov, axis1=1, axis2=2) / d
    eye = np.eye(d)
    At = np.linalg.solve(cov + lam[:, None, None] * eye, cross + lam[:, None, None] * eye)
    A = np.ascontiguousarray(At.transpose(0, 2, 1))
    return A, mf[None, :] - np.einsum("lij,lj->li", A, mh), lam


def training_partition(info: Any) -> None:
    """Refuse a partition a lens cannot be fitted on: not a text task's."""
    if KINDS[info.manifest.kind].scored:
        raise LensStatsError(
            f"{info.where} is a {info.manifest.kind} task: a lens is fitted on a text task's "
            "tokens; give a text task with --task"
        )


def fit_ls(info: Any, ridge: float | None = None) -> Translators:
    """The least-squares translators of a text partition (``layerdiv.store.PartitionInfo``)
    from its stored sums (:func:`read_sums`, :func:`ls_translators`), with the model's weights
    fingerprint and the partition's task as the training task."""
    training_partition(info)
    sums = read_sums(info)
    A, b, lam = ls_translators(sums, ridge)
    settings = {"ridge": DEFAULT_RIDGE if ridge is None else ridge, "lambda": lam.tolist(),
                "tokens": sums.n, "documents": info.n_done}  # fmt: skip
    return Translators("ls", A, b, info.manifest.weights_fingerprint, info.task, settings)


LENS_STATS = Measurement(
    name="lens_stats",
    flag="--lens-stats",
    help="Also store, per block, the float64 sums over every token from which `layerdiv "
    "fit-lens --kind ls` solves a least-squares lens (lens_stats table; text tasks).",
    tables={"text": ("lens_stats",)},
    attach=f"{__name__}.hooks:LensStatsCapture",
    rows=lens_stats_rows,
    check_rows=whole_blocks,
    flops=lens_stats_cost,
    rules={"lens_stats": Rules(bounds={"block": (0, "L-1"), "tokens": (1, float("inf"))})},
    since={"lens_stats": 9},
    order=95,
)
"""The hooks of ``extract --lens-stats`` (:mod:`layerdiv.measurements.lens_stats`, methods
§17)."""
