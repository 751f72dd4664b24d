"""The metrics of the layer-addition curves, declared once: name, correlation sign, title, unit per
estimator, methods section and plot style. Tables, correlations, reports and figures read them
from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from layerdiv.analyze.options import ESTIMATORS, Estimator


@dataclass(frozen=True)
class Unit:
    """How a metric's values are shown: multiplied by ``scale`` and labelled ``label``."""

    scale: float
    label: str
    """Short label for headers, e.g. ``%``, ``×100``, ``logit²``."""
    meaning: str
    """What the unit is, in words, for the report's captions."""
    digits: int = 1
    """Decimals shown in the report's tables."""


PERCENT = Unit(100.0, "%", "percent")
PROB_X100 = Unit(100.0, "×100", "probability squared, ×100")
LOGIT_SQUARED = Unit(
    1.0,
    "logit²",
    "logit units squared (Eq. 8: spread of the components' logits around their mean)",
    digits=2,
)
PROB_DIVERSITY = Unit(
    100.0,
    "×100",
    "probability squared, ×100 (spread of the components' softmax outputs around their mean)",
)


@dataclass(frozen=True)
class Metric:
    """One column of the curves and scores tables."""

    name: str
    """Column name in ``curves`` and ``scores``."""
    title: str
    sign: float
    """+1 when higher is better, -1 when lower is better: the sign with which the metric enters
    its correlation with accuracy (paper Fig. 3, footnote 4)."""
    units: Mapping[Estimator, Unit]
    section: str
    """Section of the methods page that defines it (methods §N)."""
    color: str
    line: str
    """Matplotlib line style."""

    def unit(self, estimator: Estimator) -> Unit:
        return self.units[estimator]

    def heading(self, estimator: Estimator) -> str:
        """Title with unit, e.g. ``MSE (×100)``."""
        return f"{self.title} ({self.unit(estimator).label})"

    @property
    def signed(self) -> str:
        """The metric as correlated with accuracy, e.g. ``−MSE``."""
        return self.title if self.sign > 0 else f"−{self.title}"


def _same(unit: Unit) -> dict[Estimator, Unit]:
    return dict.fromkeys(ESTIMATORS, unit)


ACCURACY = Metric("accuracy", "Accuracy", 1.0, _same(PERCENT), "2", "black", "-")
METRICS: dict[str, Metric] = {
    m.name: m
    for m in (
        ACCURACY,
        Metric("mse", "MSE", -1.0, _same(PROB_X100), "2", "#d62728", "--"),
        Metric("bias", "Bias", -1.0, _same(PROB_X100), "2", "#1f77b4", "-."),
        Metric(
            "diversity",
            "Diversity",
            1.0,
            {"paper": LOGIT_SQUARED, "ensemble": PROB_DIVERSITY},
            "2",
            "#2ca02c",
            ":",
        ),
    )
}
"""Every metric of a junction point, in table order."""

CORRELATED: tuple[Metric, ...] = tuple(m for m in METRICS.values() if m is not ACCURACY)
"""The metrics correlated with accuracy across junction points (methods §4)."""
