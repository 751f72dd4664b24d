"""Learned-lens translators on disk: one safetensors file per fit (METHODS §17).

Every learned lens is stored in one affine form, T_l(h) = A_l h + b_l for blocks l = 0..L-1 (the
tuned lens's h + W_l h + b_l is stored as A_l = I + W_l), so that extraction applies every lens
kind the same way. The file holds the tensors ``A`` (L, d, d) and ``b`` (L, d) in float32 or
float64 and string metadata: the lens ``kind``, the model's ``weights_fingerprint``, the training
``task``, the fit's settings as JSON and the translators' own ``fingerprint`` (sha256 over the
tensors' bytes and the other metadata), checked on every read. numpy only: no torch import.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from layerdiv.errors import LayerdivError
from layerdiv.store.atomic import atomic_path

LENS_KINDS = ("logit", "ls", "tuned")
"""Lens kinds: the logit lens (no translators, the default) and the two learned ones."""

_META = ("kind", "weights_fingerprint", "task", "settings")


class TranslatorError(LayerdivError):
    """A translators file that cannot be read or trusted, or that belongs to another model."""


@dataclass(frozen=True)
class Translators:
    """Per-block affine translators of one learned lens (METHODS §17)."""

    kind: str
    A: np.ndarray
    """(L, d, d): T_l(h) = A[l] @ h + b[l]."""
    b: np.ndarray
    """(L, d)."""
    weights_fingerprint: str
    """The model's ``Manifest.weights_fingerprint``; a lens is refused on other weights."""
    task: str
    """The training task: a store partition scored on it has no held-out claim."""
    settings: dict[str, Any] = field(default_factory=dict)
    """The fit's settings (lambda, steps, tokens per step, seed, init, ...)."""

    def __post_init__(self) -> None:
        if self.kind not in LENS_KINDS[1:]:
            raise TranslatorError(
                f"lens kind {self.kind!r} is not a learned lens; use one of {LENS_KINDS[1:]}"
            )
        if (
            self.A.ndim != 3
            or self.A.shape[1] != self.A.shape[2]
            or self.b.shape != self.A.shape[:2]
        ):
            raise TranslatorError(
                f"translators of shapes A {self.A.shape}, b {self.b.shape}: expected A (L, d, d) "
                "and b (L, d); fit them again with `layerdiv fit-lens`"
            )

    @property
    def n_blocks(self) -> int:
        return int(self.A.shape[0])

    @property
    def d_model(self) -> int:
        return int(self.A.shape[1])

    def metadata(self) -> dict[str, str]:
        """The file's string metadata, without the fingerprint."""
        return {
            "kind": self.kind,
            "weights_fingerprint": self.weights_fingerprint,
            "task": self.task,
            "settings": json.dumps(self.settings, sort_keys=True),
        }

    @property
    def fingerprint(self) -> str:
        """sha256 over the tensors (dtype, shape, bytes) and the metadata."""
        h = hashlib.sha256()
        for name, arr in (("A", self.A), ("b", self.b)):
            a = np.ascontiguousarray(arr)
            h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
            h.update(a.tobytes())
        h.update(json.dumps(self.metadata(), sort_keys=True).encode())
        return h.hexdigest()

    def check_model(self, weights_fingerprint: str, n_blocks: int, d_model: int) -> None:
        """Refuse translators fitted on another model's weights or shape."""
        if weights_fingerprint != self.weights_fingerprint:
            raise TranslatorError(
                f"these {self.kind} translators were fitted on weights "
                f"{self.weights_fingerprint[:12]}, "
                f"not on this model's {weights_fingerprint[:12]}; fit a lens on this model with "
                "`layerdiv fit-lens`"
            )
        if (n_blocks, d_model) != (self.n_blocks, self.d_model):
            raise TranslatorError(
                f"translators for {self.n_blocks} blocks of width {self.d_model}, model has "
                f"{n_blocks} of width {d_model}; fit a lens on this model with `layerdiv fit-lens`"
            )


def save_translators(path: str | Path, t: Translators) -> str:
    """Write ``t`` atomically to ``path`` (safetensors); returns its fingerprint."""
    from safetensors.numpy import save_file

    meta = t.metadata() | {"fingerprint": t.fingerprint}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(target) as tmp:
        save_file(
            {"A": np.ascontiguousarray(t.A), "b": np.ascontiguousarray(t.b)},
            str(tmp),
            metadata=meta,
        )
    return meta["fingerprint"]


def load_translators(path: str | Path) -> Translators:
    """Read and check a translators file written by ``save_translators``."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise TranslatorError(f"no translators file at {p}; write one with `layerdiv fit-lens`")
    try:
        with safe_open(str(p), framework="numpy") as f:
            meta = f.metadata() or {}
            A, b = f.get_tensor("A"), f.get_tensor("b")
    except Exception as err:
        raise TranslatorError(
            f"{p} is not a readable translators file ({type(err).__name__}: {err}); "
            "write it again with `layerdiv fit-lens`"
        ) from None
    missing = [k for k in (*_META, "fingerprint") if k not in meta]
    if missing:
        raise TranslatorError(
            f"{p} lacks the metadata {missing}; write it again with `layerdiv fit-lens`"
        )
    t = Translators(
        kind=meta["kind"],
        A=A,
        b=b,
        weights_fingerprint=meta["weights_fingerprint"],
        task=meta["task"],
        settings=json.loads(meta["settings"]),
    )
    if t.fingerprint != meta["fingerprint"]:
        raise TranslatorError(
            f"{p} does not match its own fingerprint (edited or damaged); "
            "write it again with `layerdiv fit-lens`"
        )
    return t
