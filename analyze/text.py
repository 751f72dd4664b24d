"""Running text (methods §9): what the text analyses share. Reading a text partition's
tables part file by part file in record batches of whole tokens (memory flat as documents grow),
the per-token geometry of every block from the six stored dot products (numpy, one array per
batch), and accumulating sums, counts, maxima and the profile moments over batches.

Every quantity is exact from the stored dot products (h the block's input, a what attention adds,
m what the MLP adds, d = a + m):

- ||h + a||^2 = hh + 2 ha + aa, ||d||^2 = aa + 2 am + mm, d . h = ha + hm,
  ||h_(l+1)||^2 = ||h + d||^2 = hh + 2 d . h + ||d||^2 (from block l's row),
- ||d_(l+1)|| from block (l+1)'s row, ||h_L||^2 = ||h_(L-1) + d_(L-1)||^2 from the last block's row.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import polars as pl
import pyarrow as pa
from threadpoolctl import threadpool_limits

from layerdiv.analyze import plots
from layerdiv.analyze.registry import Context, NoData, map_partitions
from layerdiv.analyze.stats import array_degrees as degrees
from layerdiv.schemas import SKIP_KEYS
from layerdiv.schemas.kinds import KINDS
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
    "proj",
)
"""Per-token, per-block geometry columns (methods §9), in the order of the first axis
of :func:`token_geometry`."""

THETA_STATE = GEOMETRY.index("theta_state")

DOTS = ("hh", "aa", "mm", "ha", "hm", "am", "dd_next", "h_final", "h_embed")
"""The float columns of ``token_blocks``."""

BATCH_TOKENS = 4096
"""Tokens per batch read from a part file: a batch holds ``BATCH_TOKENS x blocks`` rows, so the
memory of an analysis does not depend on the chunk size or the number of documents. A pass reuses
its arrays from batch to batch (:func:`scratch`; with 32 blocks 26 MiB), so the batch size
changes its time little (``benchmarks/bench_text_analyze.py --stages``)."""

EPS = 1e-6
"""Floor of the norms in the relative sizes (methods §9)."""


def batches(
    info: PartitionInfo, table: str, columns: Sequence[str], rows: int
) -> Iterator[pl.DataFrame]:
    """The ``columns`` of ``info``'s ``table`` in order, file by file, in frames of at most
    ``rows`` rows (:meth:`~layerdiv.store.PartitionInfo.batches`; a future-effects part whose
    rows repeat a key, :data:`~layerdiv.schemas.SKIP_KEYS`, is refused). Raises :class:`NoData`
    after the last part when the table has no row (e.g. no document long enough for a split
    point)."""
    empty = True
    for batch in info.batches(table, columns, rows, SKIP_KEYS.get(table, ())):
        empty = empty and batch.num_rows == 0
        yield cast(pl.DataFrame, pl.from_arrow(batch))
    if empty:
        raise NoData(f"{info.where} has no {table} rows")


WORK = 8
"""Float arrays of blocks x tokens :func:`token_geometry` works in besides its output."""


def scratch(rows: int, blocks: int, tokens: int, buffer: np.ndarray | None) -> np.ndarray:
    """A float64 array (rows, blocks, tokens), C-contiguous: the start of ``buffer`` when it is
    large enough (a pass reuses one buffer from batch to batch: fresh arrays for every batch cost
    a page fault per 4 KiB of them, in the kernel's CPU time), else a new array."""
    size = rows * blocks * tokens
    if buffer is None or buffer.size < size:
        return np.empty((rows, blocks, tokens))
    return buffer.reshape(-1)[:size].reshape(rows, blocks, tokens)


def token_dots(
    rows: pa.RecordBatch | pa.Table, blocks: int, where: str = "", out: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Of ``token_blocks`` rows (whole tokens, sorted by (doc, pos, block) as the store writes
    them): each token's position (tokens,) and the :data:`DOTS` as one float64 array
    (len(DOTS), ``blocks``, tokens), a null as NaN, written into the start of ``out`` when it is
    large enough (:func:`scratch`). Raises ``StoreError`` when the rows are not ``blocks``
    consecutive rows per token."""
    if rows.num_rows % blocks:
        raise StoreError(f"{where}: token_blocks rows are not whole tokens of {blocks} blocks")

    def column(name: str) -> np.ndarray:  # (tokens, blocks)
        return np.asarray(rows.column(name).to_numpy(zero_copy_only=False)).reshape(-1, blocks)

    doc, pos, block = column("doc"), column("pos"), column("block")
    if (block != np.arange(blocks)).any() or (doc != doc[:, :1]).any() or (pos != pos[:, :1]).any():
        raise StoreError(
            f"{where}: token_blocks rows are not sorted by (doc, pos, block) with every block "
            "of every token; re-extract it with --overwrite"
        )
    # blocks x tokens: the reductions over tokens run along contiguous memory
    dots = scratch(len(DOTS), blocks, len(pos), out)
    for row, name in zip(dots, DOTS, strict=True):
        np.copyto(row, column(name).T)
    _check_dots(dots, doc[:, 0], pos[:, 0], where)
    return pos[:, 0], dots


SQUARES = tuple(DOTS.index(c) for c in ("hh", "aa", "mm"))
"""The rows of :func:`token_dots` that are squared norms."""


def _check_dots(dots: np.ndarray, doc: np.ndarray, pos: np.ndarray, where: str) -> None:
    """Refuse (``StoreError``, naming the first token) a negative squared norm, which no forward
    pass gives (NaN and infinite values are refused as the part is read,
    ``PartitionInfo.batches``); the analyses never average them."""
    bad = np.zeros(dots.shape[2], bool)
    for row in SQUARES:
        bad |= (dots[row] < 0).any(axis=0)
    if bad.any():
        token = int(np.argmax(bad))
        raise StoreError(
            f"{where}: token_blocks of doc {doc[token]} position {pos[token]} hold a negative "
            "squared norm (a damaged part); re-extract it with --overwrite"
        )


def check_token_order(rows: pa.RecordBatch | pa.Table, blocks: int, after: int, where: str) -> int:
    """The key (doc, pos) of the last token of ``token_blocks`` rows (whole tokens, as
    :func:`token_dots` takes them), refusing (``StoreError``) tokens whose keys do not increase
    strictly from ``after`` (the last key before them, -1 for none): a token repeated or out of
    order. Parts are read in document order, so keys increase over a whole partition."""
    doc = np.asarray(rows.column("doc").to_numpy(zero_copy_only=False)[::blocks], np.int64)
    pos = np.asarray(rows.column("pos").to_numpy(zero_copy_only=False)[::blocks], np.int64)
    if not len(doc):
        return after
    key = (doc << 32) | pos
    if key[0] <= after or (np.diff(key) <= 0).any():
        raise StoreError(
            f"{where}: token_blocks rows repeat a token or are out of (doc, pos) order; "
            "re-extract it with --overwrite"
        )
    return int(key[-1])


def token_geometry(dots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The geometry of blocks x tokens from their dot products (:func:`token_dots`): an array
    (len(:data:`GEOMETRY`), blocks, tokens) in float64, NaN where a quantity is undefined (e.g.
    a cosine of a zero vector, or theta_update of the last block). Computed in the start of
    ``out`` when it is large enough for that and :data:`WORK` more rows (:func:`scratch`)."""
    hh, aa, mm, ha, hm, am, dd_next, h_final, h_embed = dots
    blocks, tokens = hh.shape
    work = scratch(len(GEOMETRY) + WORK, blocks, tokens, out)
    geometry, (nh, na, nm, nha, nd, dh, nnext, tmp) = work[: len(GEOMETRY)], work[len(GEOMETRY) :]
    attn_rel, mlp_rel, layer_rel, cos_attn, cos_mlp, cos_layer, cos_io, theta_state = geometry[:8]
    theta_update, angle_final, proj = geometry[8:]
    with np.errstate(divide="ignore", invalid="ignore"):
        np.sqrt(hh, out=nh), np.sqrt(aa, out=na), np.sqrt(mm, out=nm)  # ||h||, ||a||, ||m||
        # ||h + a||^2 = hh + 2 ha + aa
        np.add(hh, aa, out=nha)
        nha += 2 * ha
        np.sqrt(np.maximum(nha, 0.0, out=nha), out=nha)
        # ||d||^2 = ||a + m||^2 = aa + 2 am + mm (kept squared in nnext for the next line)
        np.add(aa, mm, out=nnext)
        nnext += 2 * am
        np.sqrt(np.maximum(nnext, 0.0, out=nd), out=nd)
        np.add(ha, hm, out=dh)  # d . h
        # ||h_(l+1)||^2 = ||h + d||^2 = hh + 2 d.h + ||d||^2
        nnext += hh
        nnext += 2 * dh
        np.sqrt(np.maximum(nnext, 0.0, out=nnext), out=nnext)
        # attn_rel = ||a|| / max(||h||, 1e-6)
        np.maximum(nh, EPS, out=tmp)
        np.divide(na, tmp, out=attn_rel)
        # layer_rel = ||d|| / max(||h||, 1e-6)
        np.divide(nd, tmp, out=layer_rel)
        # mlp_rel = ||m|| / max(||h + a||, 1e-6)
        np.divide(nm, np.maximum(nha, EPS, out=tmp), out=mlp_rel)
        # cos_attn = cos(a, h) = h.a / (||a|| ||h||)
        np.divide(ha, np.multiply(na, nh, out=tmp), out=cos_attn)
        # cos_mlp = cos(m, h + a) = (h.m + a.m) / (||m|| ||h + a||)
        np.add(hm, am, out=cos_mlp)
        cos_mlp /= np.multiply(nm, nha, out=tmp)
        # cos_layer = cos(d, h) = (h.a + h.m) / (||d|| ||h||)
        np.divide(dh, np.multiply(nd, nh, out=tmp), out=cos_layer)
        # cos_io = cos(h + d, h) = (hh + d.h) / (||h + d|| ||h||)
        np.add(hh, dh, out=cos_io)
        cos_io /= np.multiply(nnext, nh, out=tmp)
        # theta_state = arccos cos(h_l, h_(l+1)) in degrees; h_(l+1) = h + d, so = arccos cos_io
        degrees(cos_io, out=theta_state)
        # theta_update = arccos cos(d_l, d_(l+1)) = arccos dd_next / (||d_l|| ||d_(l+1)||), with
        # ||d_(l+1)|| from block l + 1 of the same token; none for the last block
        np.divide(dd_next[:-1], np.multiply(nd[:-1], nd[1:], out=tmp[:-1]), out=theta_update[:-1])
        degrees(theta_update[:-1], out=theta_update[:-1])
        theta_update[-1] = np.nan
        # angle_final = arccos cos(h_l, h_L) = arccos h_final / (||h_l|| ||h_L||), ||h_L|| the
        # ||h_(l+1)|| of the token's last block
        np.divide(h_final, np.multiply(nh, nnext[-1:], out=tmp), out=angle_final)
        degrees(angle_final, out=angle_final)
        # proj = <h_l - h_0, h_L - h_0> / ||h_L - h_0||^2 (methods §10)
        #      = (h_l.h_L - h_l.h_0 - h_0.h_L + h_0.h_0) / (h_L.h_L - 2 h_0.h_L + h_0.h_0),
        # h_0.h_0 and h_0.h_L block 0's hh and h_final, h_L.h_L = ||h_(l+1)||^2 of the last block
        np.subtract(h_final, h_embed, out=proj)
        proj += hh[:1] - h_final[:1]
        proj /= np.square(nnext[-1:]) - 2 * h_final[:1] + hh[:1]
        # h_0 - h_0: exactly 0 at the embedding, not float32 rounding (NaN without h_embed)
        proj[0] = np.where(np.isnan(h_embed[0]), np.nan, 0.0)
    return geometry


@dataclass
class BlockStats:
    """Per block, added up batch by batch: the tokens ``n`` (blocks,) and, per geometry column
    (rows in :data:`GEOMETRY` order, one column per block), the ``total``, ``count`` and maximum
    ``top`` of its defined (not NaN) values."""

    n: np.ndarray
    total: np.ndarray
    count: np.ndarray
    top: np.ndarray

    @classmethod
    def empty(cls, blocks: int) -> BlockStats:
        shape = (len(GEOMETRY), blocks)
        return cls(
            np.zeros(blocks, dtype=np.int64),
            np.zeros(shape),
            np.zeros(shape, dtype=np.int64),
            np.full(shape, -np.inf),
        )

    def add(self, geometry: np.ndarray) -> None:
        """Add the tokens of a :func:`token_geometry` array."""
        tokens = geometry.shape[2]
        total, top = geometry.sum(axis=2), geometry.max(axis=2)
        count = np.full(total.shape, tokens)
        for c in np.flatnonzero(np.isnan(total).any(axis=1)):  # a column with NaN: leave it out
            defined = ~np.isnan(geometry[c])
            total[c] = np.add.reduce(geometry[c], axis=1, where=defined)
            count[c] = defined.sum(axis=1)
            top[c] = np.fmax.reduce(geometry[c], axis=1)  # fmax: NaN left out
        self.n += tokens
        self.total += total
        self.count += count
        self.top = np.fmax(self.top, top)

    def table(self) -> pl.DataFrame:
        """Per ``block``: ``n`` and per geometry column c the mean ``c_mean`` (sum / count of
        the tokens where c is defined) and the maximum ``c_max``, null where c is never
        defined."""
        with np.errstate(invalid="ignore", divide="ignore"):
            mean = np.where(self.count > 0, self.total / self.count, np.nan)
        top = np.where(self.count > 0, self.top, np.nan)
        return pl.DataFrame(
            {
                "block": np.arange(len(self.n)),
                "n": self.n,
                **{f"{c}_mean": mean[i] for i, c in enumerate(GEOMETRY)},
                **{f"{c}_max": top[i] for i, c in enumerate(GEOMETRY)},
            }
        ).fill_nan(None)


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
    """Sums over tokens of the theta_state profiles x (one column per token, one row per block)
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
        """Add tokens: ``profiles`` (L, tokens) theta_state in degrees (a token with an undefined
        angle is left out), ``positions`` (tokens,)."""
        keep = np.isfinite(profiles).all(axis=0)
        x, pos = (profiles, positions) if keep.all() else (profiles[:, keep], positions[keep])
        self.n += x.shape[1]
        self.total += x.sum(axis=1)
        self.cross += x @ x.T
        first, second = halves(len(x))
        is_early = x[second].mean(axis=0) < EARLY_STOP_FRACTION * x[first].mean(axis=0)
        ranges = position_range(pos)
        tokens, early = np.bincount(ranges), np.bincount(ranges, weights=is_early)
        for r in np.flatnonzero(tokens):
            n, k = self.early.get(int(r), (0, 0))
            self.early[int(r)] = (n + int(tokens[r]), k + int(early[r]))

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
class DocumentSums:
    """Per document, added up batch by batch: per geometry column and block the ``total`` and
    ``count`` of its tokens' defined values (:class:`BlockStats` of one document): what a
    bootstrap over documents resamples (:func:`~layerdiv.analyze.stats.resampled_power_law`)."""

    blocks: int
    sums: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def add(self, geometry: np.ndarray, docs: np.ndarray) -> None:
        """Add the tokens of a :func:`token_geometry` array, ``docs`` (tokens,) their documents
        (sorted, as the store writes them)."""
        starts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
        defined = ~np.isnan(geometry)
        total = np.add.reduceat(np.where(defined, geometry, 0.0), starts, axis=2)
        count = np.add.reduceat(defined.astype(np.int64), starts, axis=2)
        for i, doc in enumerate(docs[starts].tolist()):
            old_total, old_count = self.sums.get(doc, (0.0, 0))
            self.sums[doc] = (old_total + total[:, :, i], old_count + count[:, :, i])

    def column(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(documents, blocks) totals and counts of geometry column ``name``."""
        row = GEOMETRY.index(name)
        docs = sorted(self.sums)
        shape = (len(docs), self.blocks)
        totals = np.array([self.sums[d][0][row] for d in docs]).reshape(shape)
        counts = np.array([self.sums[d][1][row] for d in docs]).reshape(shape)
        return totals, counts


@dataclass
class TextPass:
    """What one read of a partition's ``token_blocks`` gives: the per-block sums of every geometry
    column (over every token and per document) and the theta_state profile moments."""

    stats: BlockStats
    moments: ProfileMoments
    documents: DocumentSums


def text_pass(info: PartitionInfo) -> TextPass:
    """One pass over ``info``'s ``token_blocks``, in batches of :data:`BATCH_TOKENS` whole
    tokens, the same arrays reused from batch to batch (:func:`scratch`)."""
    blocks = info.manifest.n_blocks
    out = TextPass(BlockStats.empty(blocks), ProfileMoments.empty(blocks), DocumentSums(blocks))
    columns = ["doc", "pos", "block", *DOTS]
    dots_buffer = np.empty(len(DOTS) * blocks * BATCH_TOKENS)
    work_buffer = np.empty((len(GEOMETRY) + WORK) * blocks * BATCH_TOKENS)
    last = -1
    for batch in info.batches("token_blocks", columns, BATCH_TOKENS * blocks):
        pos, dots = token_dots(batch, blocks, info.where, dots_buffer)
        last = check_token_order(batch, blocks, last, info.where)
        geometry = token_geometry(dots, work_buffer)
        out.stats.add(geometry)
        doc = np.asarray(batch.column("doc").to_numpy(zero_copy_only=False))[::blocks]
        out.documents.add(geometry, doc)
        out.moments.add(geometry[THETA_STATE], pos)
    return out


PASSES = "text_passes"
"""Key of :func:`text_passes` in ``Context.shared``."""


def text_passes(ctx: Context) -> dict[str, TextPass]:
    """The :class:`TextPass` of every text partition of ``ctx`` by ``PartitionInfo.where``, made
    once per analysis run (partitions 4 at a time) and shared through ``ctx.shared``."""
    passes: dict[str, TextPass] = ctx.shared.setdefault(PASSES, {})
    todo = [p for p in ctx.parts if p.where not in passes]
    # Small matrix products per batch (the profiles' outer products): BLAS threads only add
    # synchronisation beside the partitions' own threads.
    with threadpool_limits(1, user_api="blas"):
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


def text_vs_last_token(
    panels: Sequence[tuple[str, str, str]],
    text: pl.DataFrame,
    last: pl.DataFrame | None,
    names: dict[str, str],
    xlabel: str,
    title: str,
    by: str | None = None,
) -> plots.Figure:
    """One panel per (column of ``text``, column of ``last``, label) of ``panels``: per model of
    ``text`` (and per value of the column ``by``, e.g. the lens readout, when it has several),
    its running-text curve (solid) and, where ``last`` has rows of it, its curve at the last
    prompt token of the choice tasks (dashed), both against ``relative_depth``."""
    keys = ["model", *([by] if by else [])]
    groups = sorted(text.select(keys).unique().iter_rows())
    several = by is not None and text[by].n_unique() > 1
    color = plots.model_colors([str(g) for g in groups])
    out = [plots.Panel(label, xlabel=xlabel) for _, _, label in panels]
    for group in groups:
        pick = pl.all_horizontal(pl.col(k) == v for k, v in zip(keys, group, strict=True))
        sub = text.filter(pick)
        other = None if last is None else last.filter(pick)
        name = names.get(group[0], group[0]) + (f" ({group[1]})" if several else "")
        for panel, (solid, dashed, _) in zip(out, panels, strict=True):
            panel.series.append(
                plots.Series(
                    f"{name} text",
                    sub["relative_depth"].to_list(),
                    sub[solid].to_list(),
                    color=color[str(group)],
                )
            )
            if other is not None and other.height:
                panel.series.append(
                    plots.Series(
                        f"{name} last prompt token",
                        other["relative_depth"].to_list(),
                        other[dashed].to_list(),
                        color=color[str(group)],
                        dash="dash",
                        marker="s",
                    )
                )
    return plots.Figure(title, out, cols=len(out), panel_size=(4.6, 3.8))


LENS = ("kl", "top5_overlap", "ce")
"""Per-token lens columns of ``token_lens``."""

LENS_ROWS = 1 << 20
"""Rows of ``token_lens`` read at once."""


def document_means(frames: Iterable[pl.DataFrame]) -> pl.DataFrame:
    """Per (doc, layer): the mean of each lens column over the document's positions (methods
    §9: first over positions within a document), from batches of ``token_lens`` rows (a
    document may span batches: their sums and counts add up)."""
    return combine((sums(f, ["doc", "layer"], LENS) for f in frames), ["doc", "layer"], LENS)
