"""The choices of the analysis commands, declared once. Nothing heavy is imported here: the command
line reads these when it starts."""

from __future__ import annotations

from typing import Literal

Estimator = Literal["paper", "ensemble"]
Scale = Literal["final", "prefix"]
ESTIMATORS: tuple[Estimator, ...] = ("paper", "ensemble")
"""The estimators of MSE, bias and diversity (methods §2); the first is the default."""
SCALES: tuple[Scale, ...] = ("final", "prefix")
"""How junction scores scale a prefix (methods §1, §3); the first is the default."""
FORMATS = ("parquet", "csv")
"""File formats of result tables; the first is the default."""
REPORT_FORMATS = ("md", "html")
"""Formats of ``layerdiv report`` (``--format md,html`` writes both); the first is the default."""
Executor = Literal["local", "ray"]
EXECUTORS: tuple[Executor, ...] = ("local", "ray")
"""Where the per-partition work of the analyses runs: threads of this process, or Ray tasks on a
cluster (``analyze.cluster``); the first is the default."""
