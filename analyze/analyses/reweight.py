"""Component reweighting, the method of the work the paper builds on (LLMDecomp: Chang et al.,
"When Parts Are Greater Than Sums", ``train_components.py``): a weight w_c in [0, 1] per
component, the prediction argmax_k sum_c w_c u_c[k], fitted on a few labelled instances.

LLMDecomp minimises mean cross-entropy + lambda * ||w||_1 by SGD from w = 1 and stops early; here
the same penalised objective is solved to convergence with L-BFGS-B (bounds [0, 1], analytic
gradient), also from w = 1, so the result depends only on the training instances. NumPy and SciPy
only (no torch), CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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
