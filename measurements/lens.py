"""``--lens``: the logit lens of every block input (methods §9): at the last prompt
token of a choice task (``lens``), at every token of a text task (``token_lens``), read out by
the final norm and unembedding (``final``) or with the last block applied first
(``last-block``, text tasks)."""

import click

from layerdiv.measurements.registry import Measurement, Setting, register

LENS = register(
    Measurement(
        name="lens",
        flag="--lens",  # declared by its setting (it takes the readout)
        settings=(
            Setting(
                "lens",
                click.Option(
                    ["--lens", "lens"],
                    type=click.Choice(["final", "last-block"]),
                    is_flag=False,
                    flag_value="final",
                    default=None,
                    help="Also store the logit lens of every block input (text tasks: at every "
                    "token; KL to the model's output, top-5 overlap, next-token cross-entropy); "
                    "--lens last-block applies the last block first (text tasks).",
                ),
                "final",
            ),
        ),
        legacy=True,
        tables={"choice": ("lens",), "text": ("token_lens",)},
        readout=("text",),
    )
)
