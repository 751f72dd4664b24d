"""How the tests compare floats: within a budget of the magnitudes that produce a value.

A float32 operation rounds its result to 2^-24 of its size (the unit roundoff u, about 6e-8); a
sum or dot product over n terms is off by up to n u times the sum of the terms' magnitudes (about
sqrt(n) u in practice), and a kernel for another instruction set, or another number of threads,
sums in another order. So a float computed by the extraction is compared with its reference within
a budget of the magnitudes it is computed from (the norms of the two vectors of a dot product, the
terms of a sum, the largest logit of a softmax, the scale of a column), never of the value alone
(a difference of large terms may be near 0: any relative tolerance on it fails somewhere), and never
exactly unless it is exact by construction (an integer, a key, a value set rather than computed).
``make numerical`` runs these tests again on torch's portable kernels and one thread."""

from __future__ import annotations

from typing import Any

import numpy as np

FLOAT32 = 1e-5
"""The float32 budget of a value computed through a tiny test model (two blocks, d = 32, V ~ 400),
relative to its magnitudes: about 170 u, ten times what another kernel or thread count was seen to
move it."""

FLOAT32_DEEP = 1e-4
"""The same through every block of SmolLM2 (30 blocks, d = 576) against a float64 pass: the
rounding of the states accumulates with depth."""


def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def assert_within(
    got: Any, want: Any, scale: Any, budget: float = FLOAT32, rel: float = 0.0, what: str = ""
) -> None:
    """|got - want| <= rel |want| + budget * scale everywhere (numpy arrays, tensors or numbers,
    broadcast): ``scale`` the magnitudes that produce the value, ``rel`` a tolerance of the value
    itself where the method allows one (a float32 pass against a float64 reference); NaN only
    where ``want`` is NaN. The message names the worst excess."""
    g, w = np.broadcast_arrays(_numpy(got), _numpy(want))
    assert np.array_equal(np.isnan(g), np.isnan(w)), f"{what}: NaN at other places"
    s = np.broadcast_to(_numpy(scale), w.shape)
    error = np.abs(g - w)
    # |got - want| <= rel |want| + budget * scale, NaN (both) left out
    excess = np.where(np.isnan(w), -np.inf, error - rel * np.abs(w) - budget * s)
    if excess.size and np.max(excess) > 0:
        at = np.unravel_index(np.argmax(excess), excess.shape)
        raise AssertionError(
            f"{what}: |got - want| = {error[at]:.3g} at {at} (want {w[at]:.6g}) exceeds "
            f"{rel:g} |want| + {budget:g} x scale {s[at]:.3g}"
        )
