"""The cache's table schemas, declared once and versioned.

Every Parquet file the store writes uses one of these schemas exactly; every reader checks the
manifest's ``schema_version`` against :data:`SCHEMA_VERSION` and refuses a newer one. Bump the
version whenever a column is added, removed, renamed or changes meaning or unit.

The hive partition columns ``model`` and ``task`` are not stored inside the files: they come from
the directory names (``model=<slug>/task=<task>``) and are typed as strings by every reader.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 1
"""Version of the on-disk layout and of the column sets below."""

PARTITION_COLUMNS = ("model", "task")
"""Hive partition keys, in directory order."""

COMPONENT_KINDS = ("embed", "attn", "mlp", "bias")
"""Values of the ``kind`` column, in the order they can first appear in a model."""

COMPONENTS = pa.schema(
    [
        pa.field("instance", pa.int32(), nullable=False),
        pa.field("component", pa.int16(), nullable=False),
        pa.field("name", pa.dictionary(pa.int16(), pa.string()), nullable=False),
        pa.field("kind", pa.dictionary(pa.int8(), pa.string()), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("option", pa.int8(), nullable=False),
        pa.field("logit", pa.float32(), nullable=False),
        pa.field("out_norm", pa.float32(), nullable=True),
        pa.field("prefix_rms", pa.float32(), nullable=False),
        pa.field("cos_residual", pa.float32(), nullable=True),
    ],
    metadata={"layerdiv.table": "components", "layerdiv.schema_version": str(SCHEMA_VERSION)},
)
"""One row per (instance, component, option).

- ``instance``: the instance's index in the task's dataset order (0-based).
- ``component``: execution-order index c of the component, 0 = embedding (METHODS.md section 1).
- ``name``: component name (``embed``, ``attn.<i>``, ``mlp.<i>``, ``bias``; a module that runs
  again in the same forward pass gets ``#<k>`` appended, k = 1, 2, ...).
- ``kind``: one of :data:`COMPONENT_KINDS`.
- ``layer``: decoder block index i of the module (-1 for ``embed`` and ``bias``).
- ``option``: answer option index k (0-based, in the task's option order).
- ``logit``: u_c[k], the component's contribution to option k's logit (METHODS.md Eq. 2-3),
  in logit units, with the final-norm scale of the full residual frozen.
- ``out_norm``: L2 norm of the component output z_c at the last prompt token (residual units);
  null for the constant ``bias`` component.
- ``prefix_rms``: the final norm's scale statistic of the prefix r_c = z_0 + ... + z_c: rms for
  RMSNorm models, the standard deviation for LayerNorm models (eps included, as the norm uses it).
  For ``bias`` it is the scale of the full residual, so the logit lens is the identity there.
- ``cos_residual``: cosine between z_c and the prefix r_(c-1) it is added to; null for c = 0 and
  for the constant ``bias`` component.
The per-component columns repeat for every option of the same (instance, component).
"""

INSTANCES = pa.schema(
    [
        pa.field("instance", pa.int32(), nullable=False),
        pa.field("gold", pa.int8(), nullable=False),
        pa.field("n_tokens", pa.int32(), nullable=False),
        pa.field("truncated", pa.bool_(), nullable=False),
        pa.field("final_rms", pa.float32(), nullable=False),
        pa.field("model_logits", pa.list_(pa.float32()), nullable=False),
        pa.field("sum_error", pa.float32(), nullable=False),
    ],
    metadata={"layerdiv.table": "instances", "layerdiv.schema_version": str(SCHEMA_VERSION)},
)
"""One row per instance.

- ``instance``: as in :data:`COMPONENTS`.
- ``gold``: index of the gold option.
- ``n_tokens``: prompt length in tokens as fed to the model (after any left truncation).
- ``truncated``: true when the prompt was longer than the model's context and its beginning was
  dropped to fit.
- ``final_rms``: the final norm's scale statistic of the full residual x (rms, or std for
  LayerNorm models).
- ``model_logits``: the model's own option logits (before any soft-capping), one per option.
- ``sum_error``: max over options of |sum_c u_c[k] - model_logits[k]|, divided by
  max(1, max_k sum_c |u_c[k]|): the relative error of the decomposition (METHODS.md section 1).
"""

TABLES = {"components": COMPONENTS, "instances": INSTANCES}
"""Every table of the store by name."""


class SchemaError(ValueError):
    """A file or manifest does not match the schema this version of layerdiv reads."""


def check_version(version: object, where: str) -> None:
    """Refuse a store written with a schema version this code cannot read."""
    if not isinstance(version, int):
        raise SchemaError(f"{where}: no valid schema_version (got {version!r}); re-extract it.")
    if version > SCHEMA_VERSION:
        raise SchemaError(
            f"{where}: written with schema version {version}, newer than this layerdiv reads "
            f"({SCHEMA_VERSION}); upgrade layerdiv (pip install -U layerdiv)."
        )
    if version < SCHEMA_VERSION:
        raise SchemaError(
            f"{where}: written with old schema version {version} (this layerdiv reads "
            f"{SCHEMA_VERSION}); re-extract it with --overwrite."
        )
