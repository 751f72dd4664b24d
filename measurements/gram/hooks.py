"""The capture of ``extract --gram`` (:mod:`layerdiv.measurements.gram`): each instance's Gram
matrix of the component outputs at the last prompt token (methods §7: every norm and angle of any
partial sum), from the outputs the decomposition capture keeps; no hooks of its own."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from layerdiv.errors import DecompositionError
from layerdiv.extract.capture import BatchDecomposition, ComponentCapture
from layerdiv.measurements import Attachment


class GramCapture:
    """Bound to a :class:`ComponentCapture` (``layerdiv.measurements.DecompositionCapture``);
    after each forward pass, every instance's upper triangle of z_a . z_b over the components
    without the bias, row by row (``layerdiv.schemas.GRAM``)."""

    def __init__(self, ctx: Attachment) -> None:
        self.capture: ComponentCapture | None = None
        self._gram: torch.Tensor | None = None

    def bind(self, capture: ComponentCapture) -> None:
        self.capture = capture

    def reset(self) -> None:
        self._gram = None

    def decomposed(self, batch: BatchDecomposition) -> None:
        assert self.capture is not None  # bound before any pass
        z = self.capture.outputs()  # (B, C, d)
        upper = torch.triu_indices(z.shape[1], z.shape[1], device=z.device)
        self._gram = (z @ z.transpose(1, 2))[:, upper[0], upper[1]].cpu()

    def result(self) -> Sequence[torch.Tensor]:
        if self._gram is None:
            raise DecompositionError("--gram: no forward pass was decomposed")
        return list(self._gram)

    def remove(self) -> None:
        """No hooks of its own to remove."""
