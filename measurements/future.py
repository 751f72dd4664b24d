"""``--skips`` on a text task: the future effects of removing each block's update at the
positions before a split point (METHODS.md section 9; ``future_effects`` and ``future_output``),
with the settings ``--skip-split``, ``--skip-sublayer`` and ``--skip-seed`` (recorded in the
manifest, compared on a rerun)."""

import click

from layerdiv.measurements.registry import Measurement, Setting, register
from layerdiv.schemas import SUBLAYERS

FUTURE_EFFECTS = register(
    Measurement(
        name="future_effects",
        flag="--skips",  # declared by layerdiv.measurements.skips
        tables={"text": ("future_effects", "future_output")},
        settings=(
            Setting(
                "skip_split",
                click.Option(
                    ["--skip-split"],
                    type=click.Choice(["random", "all"]),
                    default=None,
                    help="Text tasks with --skips: 4 seeded split points per document (random, "
                    "the default) or every position but the first (all).",
                ),
                "random",
            ),
            Setting(
                "skip_sublayers",
                click.Option(
                    ["--skip-sublayer", "skip_sublayers"],
                    type=click.Choice(list(SUBLAYERS)),
                    multiple=True,
                    help="Text tasks with --skips: remove the whole block (default), or only its "
                    "attention or MLP addition; repeat for several.",
                ),
                ("block",),
            ),
            Setting(
                "skip_seed",
                click.Option(
                    ["--skip-seed"],
                    type=click.IntRange(min=0),
                    default=None,
                    help="Text tasks with --skips: seed of the random split points (default 0).",
                ),
                0,
            ),
        ),
        readout=("text",),
    )
)
