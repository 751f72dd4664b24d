"""Closed-form ridge maps between every layer of two models (methods §11), numpy and
scipy only: per source layer one centred Gram matrix and one Cholesky factorisation, shared by
every target layer; every cross-product and prediction in blocks of rows, so that memory holds a
few d x d matrices whatever the number of tokens; the threads are BLAS's."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
from scipy.linalg import cho_factor, cho_solve

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
class MapScores:
    """rel_error and r2 of every (source layer i, target layer j): (L_A', L_B') each."""

    rel_error: np.ndarray
    r2: np.ndarray


def _blocks(start: int, stop: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, stop)) for s in range(start, stop, size)]


def fit_maps(
    source: Layers,
    target: Layers,
    n_train: int,
    n_heldout: int,
    ridge: float = 1e-3,
    block_rows: int = BLOCK_ROWS,
    progress: Callable[[int], None] | None = None,
) -> MapScores:
    """Ridge maps from every source layer i to every target layer j, fitted on rows
    0..n_train-1 and scored on the next ``n_heldout`` (methods §11):
    Xc, Yc the train states centred by their train means; G = Xc'Xc; lambda = ridge trace(G)/d_A;
    W = (G + lambda I)^-1 Xc'Yc; on held-out rows y_hat = (x - x_bar) W + y_bar,
    rel_error = mean ||y_hat - y|| / max(||y||, 1e-6),
    r2 = 1 - sum ||y_hat - y||^2 / sum ||y - mean_heldout(y)||^2.
    ``progress`` is called with each source layer done."""
    train = _blocks(0, n_train, block_rows)
    held = _blocks(n_train, n_train + n_heldout, block_rows)
    y_bar, y_norm, y_ss = [], [], []
    for j in range(target.n_layers):  # per target layer: train mean, held-out norms and spread
        y_bar.append(sum(target.rows(j, s, e).sum(0) for s, e in train) / n_train)
        h_bar = sum(target.rows(j, s, e).sum(0) for s, e in held) / n_heldout
        norms, spread = [], 0.0
        for s, e in held:
            y = target.rows(j, s, e)
            norms.append(np.maximum(np.linalg.norm(y, axis=1), NORM_FLOOR))
            spread += float(np.sum((y - h_bar) ** 2))
        y_norm.append(np.concatenate(norms))
        y_ss.append(spread)  # sum ||y - mean_heldout(y)||^2
    rel = np.empty((source.n_layers, target.n_layers))
    r2 = np.empty_like(rel)
    for i in range(source.n_layers):
        x_bar = sum(source.rows(i, s, e).sum(0) for s, e in train) / n_train
        gram = np.zeros((source.width, source.width))
        for s, e in train:
            xc = source.rows(i, s, e) - x_bar
            gram += xc.T @ xc
        # A constant source layer (trace 0: h_0 of one token shared by every row, as a choice
        # task's last prompt token can be) maps to W = 0, the train mean, for any lambda > 0.
        lam = ridge * np.trace(gram) / source.width or 1.0
        gram[np.diag_indices_from(gram)] += lam
        factor = cho_factor(gram, overwrite_a=True)  # one factorisation, every target layer
        # With at most d_B held-out rows, (x - x_bar)(G + lambda I)^-1 of every held-out row once
        # (no larger than W) replaces a solve per target layer.
        solved = (
            [cho_solve(factor, (source.rows(i, s, e) - x_bar).T).T for s, e in held]
            if solve_rows(n_heldout, target.width)
            else None
        )
        for j in range(target.n_layers):
            cross = np.zeros((source.width, target.width))
            for s, e in train:  # Xc'Yc = Xc'Y: the centred columns of Xc sum to zero
                cross += (source.rows(i, s, e) - x_bar).T @ target.rows(j, s, e)
            w = None if solved is not None else cho_solve(factor, cross, overwrite_b=True)
            err_norm, err_sq = [], 0.0
            for b, (s, e) in enumerate(held):  # y_hat - y = (x - x_bar) W + y_bar - y
                err = (
                    solved[b] @ cross if solved is not None else (source.rows(i, s, e) - x_bar) @ w
                )
                err += y_bar[j]
                err -= target.rows(j, s, e)
                sq = np.einsum("ij,ij->i", err, err)
                err_norm.append(np.sqrt(sq))
                err_sq += float(sq.sum())
            rel[i, j] = float(np.mean(np.concatenate(err_norm) / y_norm[j]))
            r2[i, j] = 1.0 - err_sq / y_ss[j] if y_ss[j] > 0 else float("nan")
        if progress is not None:
            progress(i)
    return MapScores(rel, r2)


def solve_rows(n_heldout: int, d_b: int) -> bool:
    """Whether :func:`fit_maps` solves for the held-out rows once per source layer (at most d_B
    of them) rather than for W once per pair."""
    return n_heldout <= d_b


def map_flops(d_a: int, d_b: int, l_a: int, l_b: int, n_train: int, n_heldout: int) -> float:
    """Matrix-multiply and factorisation FLOPs of :func:`fit_maps` for ``l_a`` x ``l_b`` layer
    pairs: per source layer the Gram matrix (2 n_t d_A^2) and its Cholesky (d_A^3 / 3); per pair
    the cross-product (2 n_t d_A d_B) and the held-out predictions (2 n_h d_A d_B); the solve,
    per source layer for the held-out rows (2 n_h d_A^2) or per pair for W (2 d_A^2 d_B)."""
    rows = solve_rows(n_heldout, d_b)
    per_source = 2 * n_train * d_a**2 + d_a**3 / 3 + (2 * n_heldout * d_a**2 if rows else 0)
    per_pair = 2 * (n_train + n_heldout) * d_a * d_b + (0 if rows else 2 * d_a**2 * d_b)
    return float(l_a * per_source + l_a * l_b * per_pair)
