"""``--heads``: every attention head's option logits (methods §8), choice tasks
(``heads`` table)."""

from layerdiv.measurements.registry import Measurement, register

HEADS = register(
    Measurement(
        name="heads",
        flag="--heads",
        help="Also store every attention head's option logits (heads table); extends partitions "
        "stored without them.",
        tables={"choice": ("heads",)},
    )
)
