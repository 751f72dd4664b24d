"""Closed-form ridge maps between every layer of two models (methods §11), numpy only: per
source layer one centred Gram matrix and one eigendecomposition, shared by every target layer
and every ridge value (and one per cross-validation fold); every cross-product and prediction
in blocks of rows, so that memory holds a few d x d matrices (and at most L_B d_B rotated
held-out rows) whatever the number of tokens; the threads are BLAS's, one per
eigendecomposition."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from threadpoolctl import threadpool_limits

BLOCK_ROWS = 4096
"""Rows read, centred and multiplied at once."""

NORM_FLOOR = 1e-6
"""The floor of ||y|| in rel_error (methods §11)."""


class Layers(Protocol):
    """States (or updates) of one model over the same rows: train rows first, then held out."""

    @property
    def n_layers(self) -> int: ...

    @property
    def width(self) -> int: ...

    def rows(self, layer: int, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of ``layer`` as float64, (stop - start, width)."""
        ...


@dataclass
class ArrayLayers:
    """:class:`Layers` over an array (n, L + 1, d) of stored states in any float dtype, rows
    taken in ``order``; with ``updates``, layer i is h_(i+1) - h_i (i < L)."""

    states: np.ndarray
    order: np.ndarray
    updates: bool = False

    @property
    def n_layers(self) -> int:
        return int(self.states.shape[1]) - int(self.updates)

    @property
    def width(self) -> int:
        return int(self.states.shape[2])

    def rows(self, layer: int, start: int, stop: int) -> np.ndarray:
        index = self.order[start:stop]
        h = self.states[index, layer].astype(np.float64)
        return self.states[index, layer + 1].astype(np.float64) - h if self.updates else h


@dataclass(frozen=True)
class DocumentSums:
    """Per held-out document (unit) k, the sums that give :class:`MapScores`'s held-out scores
    over any multiset of the documents (methods §11): ``rows`` n_k (K,); per (k, i, j) ``sse``,
    sum ||y_hat - y||^2, and ``rel``, sum ||y_hat - y|| / max(||y||, 1e-6) (K, L_A', L_B'); per
    (k, j) ``mean_rel``, the mean predictor's sum, ``y_sum``, sum (y - c_j) (K, L_B', d_B), and
    ``y_sq``, sum ||y - c_j||^2 (K, L_B'), c_j the whole held-out mean (a shift that leaves the
    spread unchanged and keeps its sums small)."""

    rows: np.ndarray
    sse: np.ndarray
    rel: np.ndarray
    mean_rel: np.ndarray
    y_sum: np.ndarray
    y_sq: np.ndarray

    def scores(self, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(r2, rel_error, mean_rel_error) over documents drawn ``weights`` times (R, K): per
        resample r, with w = weights[r], n = sum w_k n_k, S_j = sum w_k y_sum_kj:
        r2 = 1 - sum w_k sse_k / (sum w_k y_sq_kj - ||S_j||^2 / n), rel_error = sum w_k rel_k / n,
        mean_rel_error = sum w_k mean_rel_k / n; (R, L_A', L_B'), (R, L_A', L_B'), (R, L_B')."""
        n = weights @ self.rows
        centre = [
            np.sum((weights @ self.y_sum[:, j]) ** 2, axis=1) for j in range(len(self.y_sq.T))
        ]
        spread = weights @ self.y_sq - np.stack(centre, axis=1) / n[:, None]
        shape = (len(weights), *self.sse.shape[1:])
        sse = (weights @ self.sse.reshape(len(self.rows), -1)).reshape(shape)
        with np.errstate(divide="ignore", invalid="ignore"):
            r2 = np.where(spread[:, None, :] > 0, 1.0 - sse / spread[:, None, :], np.nan)
        rel = (weights @ self.rel.reshape(len(self.rows), -1)).reshape(shape) / n[:, None, None]
        return r2, rel, weights @ self.mean_rel / n[:, None]


@dataclass(frozen=True)
class MapScores:
    """Every (source layer i, target layer j): ``rel_error``, ``r2`` and the ``ridge`` its map
    was fitted with, (L_A', L_B') each; per target layer the mean predictor's rel_error
    (``mean_rel_error``, (L_B',)): y_hat = y_bar, the train mean, whatever the source; with the
    held-out rows' documents given, their :class:`DocumentSums` (``documents``)."""

    rel_error: np.ndarray
    r2: np.ndarray
    ridge: np.ndarray
    mean_rel_error: np.ndarray
    documents: DocumentSums | None = None


def _blocks(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, stop)) for s in range(start, stop, size)]


def _eigh(gram: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Eigenvalues, eigenvectors and lambda's scale trace(G) / d of a centred Gram matrix G;
    a constant layer (trace 0: h_0 of one token shared by every row, as a choice task's last
    prompt token can be) has scale 1, and its map W = 0 (the train mean) for any lambda > 0."""
    with threadpool_limits(1, user_api="blas"):  # LAPACK's tridiagonal reduction: BLAS-2
        e, v = np.linalg.eigh(gram)  # calls, slower on two threads (several times, on busy cores)
    return e, v, float(np.trace(gram)) / len(gram) or 1.0


@dataclass
class _Fold:
    """One fold f of the train rows, held out from the fit T of the others (methods §11's
    cross-validation): its row count n_f, the sum s_f of its rows (centred by the train mean),
    T's mean m relative to the train mean, G_T's eigenvalues ``e``, eigenvectors ``v`` and
    lambda scale, and ``m_rot`` = V' A_f V, A_f = sum over f's rows of (x - m)(x - m)'."""

    n: int
    s: np.ndarray
    m: np.ndarray
    e: np.ndarray
    v: np.ndarray
    scale: float
    m_rot: np.ndarray


def _folds(
    sums: list[np.ndarray], grams: list[np.ndarray], sizes: list[int], gram: np.ndarray
) -> list[_Fold]:
    """Per fold, its :class:`_Fold` from the fold's row count, sum and Gram matrix (centred by
    the train mean) and the whole train Gram matrix: G_T = G - G_f - n_T m m', m = -s_f / n_T,
    A_f = G_f - s_f m' - m s_f' + n_f m m'."""
    n_train, out = sum(sizes), []
    for s, g, n in zip(sums, grams, sizes, strict=True):
        n_t = n_train - n
        m = -s / n_t
        e, v, scale = _eigh(gram - g - n_t * np.outer(m, m))
        a = g - np.outer(s, m) - np.outer(m, s) + n * np.outer(m, m)
        out.append(_Fold(n, s, m, e, v, scale, v.T @ a @ v))
    return out


def _cv_ridge(
    folds: list[_Fold],
    cross: np.ndarray,
    fold_cross: list[np.ndarray],
    y_sums: list[np.ndarray],
    y_squares: list[float],
    ridges: Sequence[float],
) -> float:
    """The ridge of least cross-validated squared error: per fold f, W_T(lambda) =
    (G_T + lambda I)^-1 C_T fitted on the other folds (lambda = ridge trace(G_T) / d_A) and
    sum over f's rows of ||(x - m) W_T - (y - m_y)||^2 = d'(M o QQ')d - 2 d'rowsum(Q o P) + c,
    with G_T = V diag(e) V', d = 1 / (e + lambda), Q = V'C_T, P = V'B_f, M = V'A_f V,
    B_f = sum (x - m)(y - m_y)', c = sum ||y - m_y||^2 over f's rows (no row read again);
    summed over folds."""
    err = np.zeros(len(ridges))
    for fold, c_f, s_y, q in zip(folds, fold_cross, y_sums, y_squares, strict=True):
        n_t = sum(f.n for f in folds) - fold.n
        m_y = -s_y / n_t
        c_t = cross - c_f - n_t * np.outer(fold.m, m_y)
        b_f = c_f - np.outer(fold.s, m_y) - np.outer(fold.m, s_y) + fold.n * np.outer(fold.m, m_y)
        rot = fold.v.T @ np.hstack([c_t, b_f])  # [Q, P]: one product
        q_rot = rot[:, : c_t.shape[1]]
        quad = fold.m_rot * (q_rot @ q_rot.T)
        lin = np.einsum("ij,ij->i", q_rot, rot[:, c_t.shape[1] :])
        const = q - 2 * float(m_y @ s_y) + fold.n * float(m_y @ m_y)
        for r, ridge in enumerate(ridges):
            d = 1.0 / (fold.e + ridge * fold.scale)
            err[r] += float(d @ quad @ d) - 2 * float(d @ lin) + const
    return float(ridges[int(np.argmin(err))])


def fit_maps(
    source: Layers,
    target: Layers,
    n_train: int,
    n_heldout: int,
    ridges: Sequence[float] = (1e-3,),
    folds: Sequence[int] = (),
    block_rows: int = BLOCK_ROWS,
    progress: Callable[[int], None] | None = None,
    documents: np.ndarray | None = None,
) -> MapScores:
    """Ridge maps from every source layer i to every target layer j, fitted on rows
    0..n_train-1 and scored on the next ``n_heldout`` (methods §11):
    Xc, Yc the train states centred by their train means; G = Xc'Xc = V diag(e) V';
    lambda = ridge trace(G)/d_A; W = V diag(1 / (e + lambda)) V' Xc'Yc; on held-out rows
    y_hat = (x - x_bar) W + y_bar, rel_error = mean ||y_hat - y|| / max(||y||, 1e-6),
    r2 = 1 - sum ||y_hat - y||^2 / sum ||y - mean_heldout(y)||^2; the mean predictor's
    rel_error with y_hat = y_bar. One ``ridges`` value: every map's ridge. Several: per map
    the value of least squared error cross-validated over ``folds`` (the boundaries of the
    train rows' folds, rows folds[f]..folds[f+1]-1; at least two folds), one Gram matrix and
    cross-product per fold and one eigendecomposition per fit, every ridge value solved from
    them. ``progress`` is called with each source layer done. ``documents``: the held-out rows'
    document (unit) ids, (n_heldout,); with them the scores also hold each document's
    :class:`DocumentSums`, by-products of the held-out error loop."""
    cv = len(ridges) > 1
    bounds = list(folds) if cv else [0, n_train]
    if cv and (len(bounds) < 3 or bounds[0] != 0 or bounds[-1] != n_train):
        raise ValueError(f"folds {bounds}: boundaries 0 < ... < {n_train}, at least two folds")
    parts = [_blocks(a, b, block_rows) for a, b in itertools.pairwise(bounds)]
    sizes = [b - a for a, b in itertools.pairwise(bounds)]
    held = _blocks(n_train, n_train + n_heldout, block_rows)
    doc = (
        np.zeros(n_heldout, int)
        if documents is None
        else np.unique(documents, return_inverse=True)[1]
    )
    n_docs = int(doc.max()) + 1
    per_doc = [doc[s - n_train : e - n_train] for s, e in held]  # each block's document index
    doc_rows = np.bincount(doc, minlength=n_docs).astype(np.float64)
    doc_y = np.zeros((n_docs, target.n_layers, target.width))  # sum (y - h_bar) per document
    doc_sq, doc_mean = np.zeros((n_docs, target.n_layers)), np.zeros((n_docs, target.n_layers))
    y_bar, y_norm, y_ss, mean_rel = [], [], [], []
    y_sums: list[list[np.ndarray]] = []  # per target layer and fold: sum of (y - y_bar)
    y_squares: list[list[float]] = []  # ... and sum of ||y - y_bar||^2
    for j in range(target.n_layers):  # per target layer: train mean, held-out norms and spread
        y_bar.append(sum(target.rows(j, s, e).sum(0) for p in parts for s, e in p) / n_train)
        if cv:
            y_sums.append([np.zeros(target.width) for _ in parts])
            y_squares.append([0.0 for _ in parts])
            for f, p in enumerate(parts):
                for s, e in p:
                    y = target.rows(j, s, e) - y_bar[j]
                    y_sums[j][f] += y.sum(0)
                    y_squares[j][f] += float(np.sum(y**2))
        h_bar = sum(target.rows(j, s, e).sum(0) for s, e in held) / n_heldout
        norms, mean_err = [], []
        for (s, e), k in zip(held, per_doc, strict=True):
            y = target.rows(j, s, e)
            norms.append(np.maximum(np.linalg.norm(y, axis=1), NORM_FLOOR))
            mean_err.append(np.linalg.norm(y - y_bar[j], axis=1) / norms[-1])
            y -= h_bar
            np.add.at(doc_y[:, j], k, y)
            doc_sq[:, j] += np.bincount(k, np.einsum("ij,ij->i", y, y), n_docs)
            doc_mean[:, j] += np.bincount(k, mean_err[-1], n_docs)
        y_norm.append(np.concatenate(norms))
        mean_rel.append(float(np.mean(np.concatenate(mean_err))))
        y_ss.append(float(doc_sq[:, j].sum()))  # sum ||y - mean_heldout(y)||^2
    rel = np.empty((source.n_layers, target.n_layers))
    r2, chosen = np.empty_like(rel), np.empty_like(rel)
    doc_sse = np.zeros((n_docs, *rel.shape))
    doc_rel = np.zeros_like(doc_sse)
    for i in range(source.n_layers):
        x_bar = sum(source.rows(i, s, e).sum(0) for p in parts for s, e in p) / n_train
        sums, grams = [], []
        for p in parts:  # per fold: sum and Gram matrix of x - x_bar
            s_f, g_f = np.zeros(source.width), np.zeros((source.width, source.width))
            for s, e in p:
                xc = source.rows(i, s, e) - x_bar
                s_f += xc.sum(0)
                g_f += xc.T @ xc
            sums.append(s_f)
            grams.append(g_f)
        gram = np.sum(grams, axis=0)
        e_all, v_all, scale = _eigh(gram)  # one decomposition, every target layer and ridge
        cv_folds = _folds(sums, grams, sizes, gram) if cv else []
        # With at most L_B d_B held-out rows, (x - x_bar) V of every held-out row once (no more
        # products, nor memory, than every target layer's W) replaces W = V diag(d) V'C per pair.
        rotated = (
            [(source.rows(i, s, e) - x_bar) @ v_all for s, e in held]
            if solve_rows(n_heldout, target.width, target.n_layers)
            else None
        )
        for j in range(target.n_layers):
            fold_cross = []
            for p, s_f in zip(parts, sums, strict=True):  # sum (x - x_bar)(y - y_bar)' per fold
                c = -np.outer(s_f, y_bar[j])
                for s, e in p:
                    c += (source.rows(i, s, e) - x_bar).T @ target.rows(j, s, e)
                fold_cross.append(c)
            cross = np.sum(fold_cross, axis=0)  # Xc'Yc
            ridge = (
                _cv_ridge(cv_folds, cross, fold_cross, y_sums[j], y_squares[j], ridges)
                if cv
                else float(ridges[0])
            )
            solved = (v_all.T @ cross) / (e_all + ridge * scale)[:, None]  # diag(d) V'Xc'Yc
            w = None if rotated is not None else v_all @ solved
            for b, (s, e) in enumerate(held):  # y_hat - y = (x - x_bar) W + y_bar - y
                err = rotated[b] @ solved if rotated is not None else (
                    source.rows(i, s, e) - x_bar) @ w  # fmt: skip
                err += y_bar[j]
                err -= target.rows(j, s, e)
                sq = np.einsum("ij,ij->i", err, err)
                k = per_doc[b]
                doc_sse[:, i, j] += np.bincount(k, sq, n_docs)
                doc_rel[:, i, j] += np.bincount(
                    k, np.sqrt(sq) / y_norm[j][s - n_train : e - n_train], n_docs
                )
            rel[i, j] = float(doc_rel[:, i, j].sum()) / n_heldout
            err_sq = float(doc_sse[:, i, j].sum())
            r2[i, j] = 1.0 - err_sq / y_ss[j] if y_ss[j] > 0 else float("nan")
            chosen[i, j] = ridge
        if progress is not None:
            progress(i)
    found = DocumentSums(doc_rows, doc_sse, doc_rel, doc_mean, doc_y, doc_sq)
    return MapScores(rel, r2, chosen, np.array(mean_rel), None if documents is None else found)


def solve_rows(n_heldout: int, d_b: int, l_b: int) -> bool:
    """Whether :func:`fit_maps` rotates the held-out rows once per source layer (2 n_h d_A^2
    FLOPs: at most L_B d_B of them, no more than W = V (diag(d) V'C) for each of the ``l_b``
    target layers) rather than forming W once per pair."""
    return n_heldout <= l_b * d_b


def map_flops(
    d_a: int, d_b: int, l_a: int, l_b: int, n_train: int, n_heldout: int, folds: int = 0
) -> float:
    """Matrix-multiply and decomposition FLOPs of :func:`fit_maps` for ``l_a`` x ``l_b`` layer
    pairs: per source layer the Gram matrix (2 n_t d_A^2) and its eigendecomposition (about
    4 d_A^3); per pair the cross-product (2 n_t d_A d_B), V'C (2 d_A^2 d_B) and the held-out
    predictions (2 n_h d_A d_B); W = V (diag(d) V'C) per pair (2 d_A^2 d_B) or the held-out
    rows rotated per source layer (2 n_h d_A^2). Cross-validated over ``folds`` folds: per
    source layer and fold an eigendecomposition and V'A_f V (8 d_A^3), per pair and fold
    V'[C_T, B_f] (4 d_A^2 d_B) and the symmetric QQ' (d_A^2 d_B)."""
    rows = solve_rows(n_heldout, d_b, l_b)
    per_source = 2 * n_train * d_a**2 + 4 * d_a**3 + (2 * n_heldout * d_a**2 if rows else 0)
    per_pair = 2 * (n_train + n_heldout) * d_a * d_b + 2 * d_a**2 * d_b * (1 if rows else 2)
    per_source += folds * 8 * d_a**3
    per_pair += folds * 5 * d_a**2 * d_b
    return float(l_a * per_source + l_a * l_b * per_pair)
