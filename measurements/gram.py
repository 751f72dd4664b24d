"""``--gram``: each instance's Gram matrix of the component outputs (exact angles), choice
tasks (``gram`` table)."""

from layerdiv.measurements.registry import Measurement, register

GRAM = register(
    Measurement(
        name="gram",
        flag="--gram",
        help="Also store each instance's Gram matrix of the component outputs (exact angles).",
        tables={"choice": ("gram",)},
    )
)
