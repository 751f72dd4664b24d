"""``--lens``: the logit lens of every block input (methods §9): at the last prompt
token of a choice task (``lens``), at every token of a text task (``token_lens``), read out by
the final norm and unembedding (``final``) or with the last block applied first
(``last-block``, text tasks). Its hooks (:func:`layerdiv.measurements.lens.hooks.lens_hooks`) are
bound to the task kind's own capture: a choice task's last-token decomposition, a text task's
per-token capture (which keeps the states it reads)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np
import pyarrow as pa

from layerdiv.errors import LayerdivError
from layerdiv.measurements.registry import (
    Measurement,
    ModelShape,
    Planning,
    Setting,
    per_token_and_layer,
)
from layerdiv.schemas import (
    LEARNED_LENS,
    LEARNED_LENS_KINDS,
    NONNEGATIVE,
    PROBABILITY,
    TOKEN_LENS,
    Range,
    Rules,
    token_key,
)
from layerdiv.schemas import LENS as LENS_SCHEMA
from layerdiv.schemas.kinds import KINDS

READOUTS = {"final": ("choice", "text"), "last-block": ("text",)}
"""Each readout of the lens (``--lens NAME``, ``layerdiv.measurements.lens.hooks.LENSES``) and the
task kinds it applies to."""

LENS_VALUES = ("kl", "top5_overlap", "final_rank", "top1", "ce")
"""The values of a lens row (:data:`~layerdiv.schemas.TOKEN_LENS`, :data:`~layerdiv.schemas.LENS`),
in the order extraction computes them and :func:`lens_columns` takes them."""


def lens_columns(values: np.ndarray, nullable_ce: bool = False) -> dict[str, pa.Array]:
    """The :data:`LENS_VALUES` columns of lens rows from ``values`` (..., len(LENS_VALUES)),
    flattened: the floats as float32, the rank and token id as int32 (exact in the float32 they
    are computed in up to 2^24); with ``nullable_ce`` a NaN ce is stored as null."""
    v = np.asarray(values).reshape(-1, len(LENS_VALUES))
    kl, top5, rank, top1, ce = v.T
    return {
        "kl": pa.array(kl.astype(np.float32)),
        "top5_overlap": pa.array(top5.astype(np.float32)),
        "ce": pa.array(ce.astype(np.float32), from_pandas=nullable_ce),
        "final_rank": pa.array(rank.astype(np.int32)),
        "top1": pa.array(top1.astype(np.int32)),
    }


def lens_table(instances: Sequence[int], values: np.ndarray) -> pa.Table:
    """Rows (instance, layer) of :data:`~layerdiv.schemas.LENS` from ``values`` (B, L + 1,
    len(:data:`LENS_VALUES`))."""
    b, layers = np.shape(values)[:2]
    return pa.table(
        {
            "instance": pa.array(np.repeat(np.asarray(instances, np.int32), layers)),
            "layer": pa.array(np.tile(np.arange(layers, dtype=np.int16), b)),
            **lens_columns(values),
        },
        schema=LENS_SCHEMA,
    )


def token_lens_table(
    docs: Sequence[int], n_tokens: Sequence[int], values: np.ndarray, schema: pa.Schema = TOKEN_LENS
) -> pa.Table:
    """Rows (doc, pos, layer) of :data:`~layerdiv.schemas.TOKEN_LENS` (or of a learned lens's
    ``schema``, the same columns) from ``values`` (sum n_tokens, L + 1, len(:data:`LENS_VALUES`)),
    ``ce`` NaN (stored as null) at each document's last position."""
    n, layers = np.shape(values)[:2]
    doc, pos = token_key(docs, n_tokens)
    return pa.table(
        {
            "doc": pa.array(np.repeat(doc, layers)),
            "pos": pa.array(np.repeat(pos, layers)),
            "layer": pa.array(np.tile(np.arange(layers, dtype=np.int16), n)),
            **lens_columns(values, nullable_ce=True),
        },
        schema=schema,
    )


def readout_of(manifest: Any) -> str | None:
    """The logit lens's readout a partition's manifest records (``final`` or ``last-block``;
    None: no lens recorded)."""
    return manifest.settings.get(LENS.name, {}).get("lens")


def lens_rows(units: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``lens`` rows of a choice task's instances ``units`` from each one's (L + 1, 5)
    values (:data:`LENS_VALUES`; ce of its gold option's first token); or the ``token_lens``
    rows of a text task's documents from each one's (T, L + 1, 5) values (ce of the next
    token)."""
    if np.ndim(values[0]) == 3:
        lengths = [len(x) for x in values]
        v = np.concatenate([np.asarray(x) for x in values])
        return {"token_lens": token_lens_table(units, lengths, v)}
    return {"lens": lens_table(units, np.stack([np.asarray(x) for x in values]))}


def plan_lens(plan: Planning) -> None:
    """Refuse a readout the task's kind cannot take (:data:`READOUTS`)."""
    readout, kind = plan.settings["lens"], plan.task.kind
    if kind not in READOUTS[readout]:
        raise LayerdivError(
            f"task {plan.task.name} is a {kind} task: --lens {readout} applies to "
            f"{', '.join(READOUTS[readout])} tasks only (a choice task keeps the last prompt "
            "token alone); use --lens"
        )


def lens_cost(shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]) -> float:
    """FLOPs of the lens of a sequence: a text task's L + 1 full-vocabulary readouts of every
    token (``last-block``: and the last block once per block input), a choice task's L readouts
    of the last prompt token."""
    L = shape.layers
    if KINDS[kind].scored:
        return L * shape.readout()
    extra = (L + 1) * shape.readout(tokens)
    return extra + (L * shape.block(tokens) if settings.get("lens") == "last-block" else 0.0)


LENS_BOUNDS: dict[str, Range] = {
    "kl": NONNEGATIVE,
    "top5_overlap": PROBABILITY,
    "ce": NONNEGATIVE,
    "final_rank": (1, "V"),
    "top1": (0, "V-1"),
}
"""The ranges of the lens statistics' columns (``lens``, ``token_lens`` and the learned lenses'
tables)."""

TOKEN_LENS_RULES = Rules(grid=(("pos", "tokens"), ("layer", "states")), bounds=LENS_BOUNDS)
"""The row rules of a per-token lens table: ``token_lens`` and each learned lens's."""


LENS = Measurement(
    name="lens",
    flag="--lens",  # declared by its setting (it takes the readout)
    settings=(
        Setting(
            "lens",
            click.Option(
                ["--lens", "lens"],
                type=click.Choice(list(READOUTS)),
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
    vocab_rows=("text",),
    attach=f"{__name__}.hooks:lens_hooks",
    rows=lens_rows,
    check_rows=per_token_and_layer("token_lens"),
    flops=lens_cost,
    costed={"text": ({"lens": "last-block"},)},
    plan_check=plan_lens,
    rules={
        "lens": Rules(grid=(("layer", "states"),), bounds=LENS_BOUNDS),
        "token_lens": TOKEN_LENS_RULES,
    },
    since={"lens": 4, "token_lens": 4},
    order=40,
)


def learned_table(kind: str) -> str:
    """The table of the learned lens ``kind`` (``ls``, ``tuned``; methods §17)."""
    return f"token_lens_{kind}"


def translators_of(manifest: Any, kind: str) -> dict[str, Any]:
    """What a partition's manifest records of its ``kind`` lens's translators (``kind``,
    ``fingerprint``, the training ``task``, derived by its hooks; empty where it holds none)."""
    return manifest.settings.get(f"lens_{kind}", {})


def plan_learned(plan: Planning) -> Any:
    """Read the translators a run names (``--lens-ls FILE``, ``--lens-tuned FILE``) before the
    weights load: refuse a file that cannot be read or trusted, or of another lens kind. They go
    to the hooks (``Attachment.planned``), which check them against the model's weights."""
    from layerdiv.store.translators import TranslatorError, load_translators

    name = next(k for k in plan.settings if k.startswith("lens_"))
    kind, path = name[len("lens_") :], plan.settings[name]
    if path is None:
        raise TranslatorError(f"--lens-{kind} needs the translators file: add --lens-{kind} FILE")
    t = load_translators(path)
    if t.kind != kind:
        raise TranslatorError(
            f"{path} holds {t.kind} translators, not {kind} ones; give it to --lens-{t.kind}"
        )
    if t.task == plan.task.name:
        plan.notes.append(
            f"the {kind} translators were fitted on task {t.task}: its lens under them is not "
            "held out (the report says so)"
        )
    return t


def learned_rows(kind: str) -> Any:
    """The rows of the ``kind`` lens from its hooks' values: a text task's per-token values as
    :func:`lens_rows` stores them, in the kind's own table."""

    def rows(units: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
        lengths = [len(x) for x in values]
        v = np.concatenate([np.asarray(x) for x in values])
        return {learned_table(kind): token_lens_table(units, lengths, v, LEARNED_LENS[kind])}

    return rows


def learned_cost(shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]) -> float:
    """FLOPs of a learned lens over a sequence: the translators A_l h + b_l (2 d^2 per token and
    block) and the logit lens's L + 1 readouts."""
    return shape.layers * 2 * shape.d**2 * tokens + lens_cost(shape, kind, tokens, {})


def learned_lens(kind: str, order: int) -> Measurement:
    """The measurement of the learned lens ``kind`` (methods §17): ``extract --lens-<kind>
    FILE`` stores the lens statistics of a text task's tokens under the translators of FILE
    (``layerdiv fit-lens``) in ``token_lens_<kind>``, beside the logit lens's ``token_lens`` (and
    added to stored chunks that lack it). The translators' kind, fingerprint and training task
    are settings its hooks derive once per partition: a resume, a shard or a merge with other
    translators is refused."""
    flag, table = f"--lens-{kind}", learned_table(kind)
    return Measurement(
        name=f"lens_{kind}",
        flag=flag,  # declared by its setting (it takes the file)
        settings=(
            Setting(
                f"lens_{kind}",
                click.Option(
                    [flag, f"lens_{kind}"],
                    type=click.Path(dir_okay=False, resolve_path=True),
                    default=None,
                    help=f"Also store the lens statistics of a text task under the {kind} lens "
                    f"of this translators file (`layerdiv fit-lens --kind {kind}`), beside the "
                    "logit lens's.",
                ),
                None,
            ),
        ),
        tables={"text": (table,)},
        vocab_rows=("text",),
        attach="layerdiv.measurements.lens.hooks:learned_lens_hooks",
        rows=learned_rows(kind),
        check_rows=per_token_and_layer(table),
        flops=learned_cost,
        plan_check=plan_learned,
        rules={table: TOKEN_LENS_RULES},
        since={table: 9},
        order=order,
    )


LEARNED = {kind: learned_lens(kind, 41 + i) for i, kind in enumerate(LEARNED_LENS_KINDS)}
"""The learned lenses' measurements by kind (entry points ``lens_ls``, ``lens_tuned``)."""
LENS_LS, LENS_TUNED = LEARNED["ls"], LEARNED["tuned"]


def stored_lenses(info: Any) -> list[tuple[str, str]]:
    """(lens, table) of each lens that a text partition (``layerdiv.store.PartitionInfo``) holds
    complete and that the depth measures read (methods §15-17): ``logit`` (``token_lens``, where
    its readout is ``final``), then each learned lens in its own table."""
    out = [("logit", "token_lens")] if "token_lens" in info.tables else []
    if out and readout_of(info.manifest) != "final":
        out = []
    return out + [
        (k, learned_table(k)) for k in LEARNED_LENS_KINDS if learned_table(k) in info.tables
    ]


def learned_lens_settings(files: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The ``ExtractConfig.measurement_settings`` entries that add the learned lenses of
    ``files`` (kind -> translators file, as ``layerdiv fit-lens`` writes it) to an extraction
    through the Python API, as ``--lens-ls FILE`` / ``--lens-tuned FILE`` do (the demo's step)."""
    unknown = sorted(set(files) - set(LEARNED_LENS_KINDS))
    if unknown:
        raise LayerdivError(f"no learned lens of kind {unknown[0]}; use {LEARNED_LENS_KINDS}")
    return {f"lens_{k}": {f"lens_{k}": str(Path(f).resolve())} for k, f in files.items()}
