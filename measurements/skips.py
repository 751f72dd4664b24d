"""``--skips`` on a choice task: the option logits with each block skipped (methods §7,
``skips`` table). On a text task the same flag writes the future effects
(:mod:`layerdiv.measurements.future`)."""

from layerdiv.measurements.registry import Measurement, register

SKIPS = register(
    Measurement(
        name="skips",
        flag="--skips",
        help="Also store the option logits with each block skipped (about half a forward pass "
        "per block; extends a partition stored without them). On a text task: the future effects "
        "of removing each block at the positions before a split point.",
        tables={"choice": ("skips",)},
    )
)
