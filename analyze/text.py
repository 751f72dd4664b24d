"""Running text (METHODS.md section 9): what the text analyses share. Reading a text partition's
tables part file by part file in batches of whole tokens (memory flat as documents grow), the
per-token geometry of every block from the six stored dot products, and accumulating sums, counts
and maxima over batches.

Every quantity is exact from the stored dot products (h the block's input, a what attention adds,
m what the MLP adds, d = a + m):

- ||h + a||^2 = hh + 2 ha + aa, ||d||^2 = aa + 2 am + mm, d . h = ha + hm,
  ||h_(l+1)||^2 = ||h + d||^2 = hh + 2 d . h + ||d||^2 (from block l's row),
- ||d_(l+1)|| from block (l+1)'s row, ||h_L||^2 = ||h_(L-1) + d_(L-1)||^2 from the last block's row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from layerdiv.analyze.registry import Context, map_partitions
from layerdiv.analyze.stats import degrees
from layerdiv.schemas import KINDS
from layerdiv.store import PartitionInfo, StoreError

TEXT_KIND = KINDS["text"].name
"""The manifest ``kind`` of running-text partitions."""

GEOMETRY = (
    "attn_rel",
    "mlp_rel",
    "layer_rel",
    "cos_attn",
    "cos_mlp",
    "cos_layer",
    "cos_io",
    "theta_state",
    "theta_update",
    "angle_final",
)
"""Per-token, per-block geometry columns (METHODS.md section 9)."""

DOTS = ("hh", "aa", "mm", "ha", "hm", "am", "dd_next", "h_final")
"""The float columns of ``token_blocks``."""

BATCH_TOKENS = 16_384
"""Tokens per batch read from a part file: a batch holds ``BATCH_TOKENS x blocks`` rows, so the
memory of an analysis does not depend on the chunk size or the number of documents."""

EPS = 1e-6
"""Floor of the norms in the relative sizes (METHODS.md section 9)."""


def batches(files: Sequence[str], columns: Sequence[str], rows: int) -> Iterator[pl.DataFrame]:
    """The ``columns`` of the Parquet ``files`` (paths or URLs) in order, file by file, in frames
    of ``rows`` rows (the last of each file shorter): with ``rows`` a multiple of a token's rows,
    every frame holds whole tokens."""
    for file in files:
        scan = pl.scan_parquet(file)
        n = scan.select(pl.len()).collect().item()
        for start in range(0, n, rows):
            yield scan.select(columns).slice(start, rows).collect()


def token_geometry(
    frame: pl.DataFrame, blocks: int, columns: Sequence[str] = GEOMETRY, where: str = ""
) -> pl.DataFrame:
    """Per ``token_blocks`` row (whole tokens, sorted by (doc, pos, block) as the store writes
    them): ``doc``, ``pos``, ``block`` and the geometry ``columns`` (:data:`GEOMETRY`) of METHODS.md
    section 9 (NaN, e.g. a cosine of a zero vector, as null). ``frame`` needs the
    :func:`stored_columns` of ``columns``. Raises ``StoreError`` when the rows are not ``blocks``
    consecutive rows per token."""
    if frame.height % blocks:
        raise StoreError(f"{where}: token_blocks rows are not whole tokens of {blocks} blocks")
    row = pl.int_range(pl.len(), dtype=pl.Int64)
    first = (row // blocks) * blocks  # row of the token's block 0
    ordered = frame.select(
        (pl.col("block").cast(pl.Int64) == row % blocks).all()
        & (pl.col("doc").gather(first) == pl.col("doc")).all()
        & (pl.col("pos").gather(first) == pl.col("pos")).all()
    ).item()
    if not ordered:
        raise StoreError(
            f"{where}: token_blocks rows are not sorted by (doc, pos, block) with every block "
            "of every token; re-extract it with --overwrite"
        )
    hh, aa, mm, ha, hm, am = (pl.col(c).cast(pl.Float64) for c in DOTS[:6])
    # The shared terms, computed once (columns prefixed with _):
    shared = {
        "_nh": hh.sqrt(),  # ||h||
        "_na": aa.sqrt(),  # ||a||
        "_nm": mm.sqrt(),  # ||m||
        "_nha": (hh + 2 * ha + aa).clip(0.0).sqrt(),  # ||h + a||^2 = hh + 2 ha + aa
        "_nd": (aa + 2 * am + mm).clip(0.0).sqrt(),  # ||d||^2 = ||a + m||^2 = aa + 2 am + mm
        "_dh": ha + hm,  # d . h
        # ||h_(l+1)||^2 = ||h + d||^2 = hh + 2 d.h + ||d||^2
        "_nnext": (hh + 2 * (ha + hm) + aa + 2 * am + mm).clip(0.0).sqrt(),
    }
    nh, na, nm, nha, nd, dh, nnext = (pl.col(c) for c in shared)
    cos_io = (hh + dh) / (nnext * nh)  # cos(h + d, h) = (hh + d.h) / (||h + d|| ||h||)
    last = first + (blocks - 1)  # the token's last block: ||h_L|| = its ||h_(l+1)||
    formulas = {
        # attn_rel = ||a|| / max(||h||, 1e-6)
        "attn_rel": na / nh.clip(EPS),
        # mlp_rel = ||m|| / max(||h + a||, 1e-6)
        "mlp_rel": nm / nha.clip(EPS),
        # layer_rel = ||d|| / max(||h||, 1e-6)
        "layer_rel": nd / nh.clip(EPS),
        # cos_attn = cos(a, h) = h.a / (||a|| ||h||)
        "cos_attn": ha / (na * nh),
        # cos_mlp = cos(m, h + a) = (h.m + a.m) / (||m|| ||h + a||)
        "cos_mlp": (hm + am) / (nm * nha),
        # cos_layer = cos(d, h) = (h.a + h.m) / (||d|| ||h||)
        "cos_layer": dh / (nd * nh),
        # cos_io = cos(h + d, h)
        "cos_io": cos_io,
        # theta_state = arccos cos(h_l, h_(l+1)) in degrees; h_(l+1) = h + d, so = arccos cos_io
        "theta_state": degrees(cos_io),
        # theta_update = arccos cos(d_l, d_(l+1)) = arccos dd_next / (||d_l|| ||d_(l+1)||), with
        # ||d_(l+1)|| from the next row (block l + 1 of the same token; dd_next is null on the
        # last block, and so is the angle)
        "theta_update": degrees(pl.col("dd_next").cast(pl.Float64) / (nd * nd.shift(-1))),
        # angle_final = arccos cos(h_l, h_L) = arccos h_final / (||h_l|| ||h_L||)
        "angle_final": degrees(pl.col("h_final").cast(pl.Float64) / (nh * nnext.gather(last))),
    }
    return (
        frame.lazy()
        .with_columns(**shared)
        .select("doc", "pos", "block", *(formulas[c].fill_nan(None).alias(c) for c in columns))
        .collect()
    )


def stored_columns(columns: Sequence[str]) -> list[str]:
    """The ``token_blocks`` columns :func:`token_geometry` reads for the geometry ``columns``."""
    extra = {"theta_update": "dd_next", "angle_final": "h_final"}
    return ["doc", "pos", "block", *DOTS[:6], *(extra[c] for c in columns if c in extra)]


def token_batches(info: PartitionInfo, columns: Sequence[str] = GEOMETRY) -> Iterator[pl.DataFrame]:
    """:func:`token_geometry` (the geometry ``columns``) of every ``token_blocks`` part of
    ``info``, in batches of :data:`BATCH_TOKENS` whole tokens."""
    blocks = info.manifest.n_blocks
    stored = stored_columns(columns)
    for frame in batches(info.uris("token_blocks"), stored, BATCH_TOKENS * blocks):
        yield token_geometry(frame, blocks, columns, info.where)


EARLY_STOP_FRACTION = 0.25
"""A token stops updating early when its mean theta_state over the second half of the blocks (the
last block left out) is below this fraction of its own mean over the first half (block 0 left out:
the embedding's first update is large for every token)."""


def halves(blocks: int) -> tuple[slice, slice]:
    """The blocks the early-stop test compares: the first half without block 0, and the second
    half without the last block."""
    return slice(1, max(blocks // 2, 2)), slice(blocks // 2, max(blocks - 1, blocks // 2 + 1))


def position_range(pos: np.ndarray) -> np.ndarray:
    """Range r of each position: 0 for position 0, else r with 2^(r-1) <= pos < 2^r."""
    return np.where(pos > 0, np.floor(np.log2(np.maximum(pos, 1))).astype(int) + 1, 0)


@dataclass
class ProfileMoments:
    """Sums over tokens of the theta_state profiles x (one row per token, one column per block)
    and of their outer products x x^T, and the early-stop counts by position range: what the PCA
    of the profiles and ``text_early_stop`` need, added batch by batch (L x L numbers, not
    tokens x L)."""

    n: int
    total: np.ndarray
    cross: np.ndarray
    early: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Position range r (:func:`position_range`) -> (tokens, tokens that stop early)."""

    @classmethod
    def empty(cls, blocks: int) -> ProfileMoments:
        return cls(0, np.zeros(blocks), np.zeros((blocks, blocks)))

    def add(self, profiles: np.ndarray, positions: np.ndarray) -> None:
        """Add tokens: ``profiles`` (tokens, L) theta_state in degrees (a token with an undefined
        angle is left out), ``positions`` (tokens,)."""
        keep = np.isfinite(profiles).all(axis=1)
        x, pos = profiles[keep], positions[keep]
        self.n += len(x)
        self.total += x.sum(axis=0)
        self.cross += x.T @ x
        first, second = halves(x.shape[1])
        is_early = x[:, second].mean(axis=1) < EARLY_STOP_FRACTION * x[:, first].mean(axis=1)
        ranges = position_range(pos)
        for r in np.unique(ranges):
            at = ranges == r
            n, k = self.early.get(int(r), (0, 0))
            self.early[int(r)] = (n + int(at.sum()), k + int(is_early[at].sum()))

    def pca(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(mean profile (L,), variances (L,) in decreasing order, components (L, L) as rows,
        each signed so that its largest entry is positive): the eigen-decomposition of the sample
        covariance (sum x x^T - n mean mean^T) / (n - 1)."""
        mean = self.total / max(self.n, 1)
        cov = (self.cross - self.n * np.outer(mean, mean)) / max(self.n - 1, 1)
        values, vectors = np.linalg.eigh(cov)
        order = np.argsort(values)[::-1]
        vectors = vectors[:, order].T
        signs = np.sign(vectors[np.arange(len(vectors)), np.abs(vectors).argmax(axis=1)])
        return mean, np.clip(values[order], 0.0, None), vectors * signs[:, None]


@dataclass
class TextPass:
    """What one read of a partition's ``token_blocks`` gives: the per-block sums of every geometry
    column (:func:`sums`, one frame per batch) and the theta_state profile moments."""

    sums: list[pl.DataFrame]
    moments: ProfileMoments


def text_pass(info: PartitionInfo) -> TextPass:
    """One pass over ``info``'s ``token_blocks``, batch by batch (:func:`token_batches`)."""
    blocks = info.manifest.n_blocks
    out = TextPass([], ProfileMoments.empty(blocks))
    for frame in token_batches(info):
        out.sums.append(sums(frame, ["block"], GEOMETRY))
        theta = frame["theta_state"].fill_null(np.nan).to_numpy().reshape(-1, blocks)
        out.moments.add(theta, frame["pos"].to_numpy()[::blocks])
    return out


PASSES = "text_passes"
"""Key of :func:`text_passes` in ``Context.shared``."""


def text_passes(ctx: Context) -> dict[str, TextPass]:
    """The :class:`TextPass` of every text partition of ``ctx`` by ``PartitionInfo.where``, made
    once per analysis run (partitions 4 at a time) and shared through ``ctx.shared``."""
    passes: dict[str, TextPass] = ctx.shared.setdefault(PASSES, {})
    todo = [p for p in ctx.parts if p.where not in passes]
    for info, done in zip(todo, map_partitions(text_pass, todo), strict=True):
        passes[info.where] = done
    return passes


def sums(frame: pl.DataFrame, keys: Sequence[str], columns: Iterable[str]) -> pl.DataFrame:
    """Per ``keys``: ``n`` (rows) and, per column c, ``c_sum``, ``c_n`` (non-null rows) and
    ``c_max``: what :func:`combine` adds up over batches."""
    columns = list(columns)
    return frame.group_by(keys).agg(
        pl.len().alias("n"),
        *(pl.col(c).cast(pl.Float64).sum().alias(f"{c}_sum") for c in columns),
        *(pl.col(c).count().alias(f"{c}_n") for c in columns),
        *(pl.col(c).cast(pl.Float64).max().alias(f"{c}_max") for c in columns),
    )


def combine(
    parts: Iterable[pl.DataFrame], keys: Sequence[str], columns: Iterable[str]
) -> pl.DataFrame:
    """Per ``keys``, sorted: the :func:`sums` of every batch added up, as ``n``, the means
    ``c_mean`` = sum / non-null count and the maxima ``c_max``."""
    columns = list(columns)
    frames = list(parts)
    total = (
        pl.concat(frames)
        .group_by(keys)
        .agg(
            pl.col("n").sum(),
            *(pl.col(f"{c}_sum", f"{c}_n").sum() for c in columns),
            *(pl.col(f"{c}_max").max() for c in columns),
        )
    )
    return total.select(
        *keys,
        "n",
        *(
            pl.when(pl.col(f"{c}_n") > 0)
            .then(pl.col(f"{c}_sum") / pl.col(f"{c}_n"))
            .alias(f"{c}_mean")
            for c in columns
        ),
        *(pl.col(f"{c}_max") for c in columns),
    ).sort(keys)


def tag(frame: pl.DataFrame, info: PartitionInfo) -> pl.DataFrame:
    """``frame`` with the partition's ``model`` and ``task`` as its first columns."""
    return frame.select(
        pl.lit(info.model).alias("model"), pl.lit(info.task).alias("task"), pl.all()
    )
