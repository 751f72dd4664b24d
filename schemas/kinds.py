"""The task kinds, declared once: what a partition of each kind stores and how its units are
read (torch-free: the store and the analyses read it; the extraction's side of each kind, its
capture, batch check, tables and tally, is ``layerdiv.extract.kinds``).

A manifest records its kind by :attr:`Kind.name` (``choice`` before schema version 4)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from layerdiv.schemas import NONNEGATIVE, Rules


@dataclass(frozen=True)
class Kind:
    """One task kind: its units, its partitions' required tables and their sizes."""

    name: str
    """``choice`` or ``text`` (the manifest's and the task YAML's ``kind``)."""
    unit: str
    """The key column chunks are cut along (``instance`` or ``doc``)."""
    units: str
    """What the unit is called in messages (``instances``, ``documents``)."""
    marker: str
    """The table whose part marks a chunk complete (written after every other part)."""
    required: tuple[str, ...]
    """Tables every complete chunk has (the marker last); the optional ones are declared by the
    measurements that write them (``layerdiv.measurements``)."""
    since: int
    """The schema version its partitions appeared in (with its required tables)."""
    scored: bool
    """Its units are prompts whose options are scored at the last prompt token (a gold option,
    an accuracy; option and component columns; one readout position per unit; every table of a
    measurement without a row rule holds whole rows per unit); else documents read at every
    token."""
    rows: Mapping[str, tuple[str, ...]]
    """The rows of each required table in a chunk, as a product of the chunk's facts:
    ``units`` (its units), ``tokens`` (their tokens), ``blocks`` (L), ``components``,
    ``options``."""
    task_fields: tuple[str, ...] = ()
    """The task YAML's keys of this kind alone (the default kind, ``choice``, has none: its
    tasks hash as they did before other kinds existed)."""
    rules: Mapping[str, Rules] = field(default_factory=dict)
    """The row rules of its required tables that have some (:class:`~layerdiv.schemas.Rules`);
    a measurement's tables have theirs in its declaration (``Measurement.rules``)."""

    @property
    def per_token(self) -> bool:
        """Whether some table has rows per token (a chunk's size needs its token count, the
        marker's ``n_tokens``)."""
        return any("tokens" in facts for facts in self.rows.values())

    def expected_rows(self, facts: Mapping[str, int]) -> dict[str, int]:
        """Rows of each required table in a chunk of ``facts`` (:attr:`rows`)."""
        return {table: math.prod(facts[f] for f in of) for table, of in self.rows.items()}


CHOICE = Kind(
    "choice",
    "instance",
    "instances",
    "instances",
    ("components", "instances"),
    since=1,
    scored=True,
    rows={"instances": ("units",), "components": ("units", "components", "options")},
)
TEXT = Kind(
    "text",
    "doc",
    "documents",
    "documents",
    ("tokens", "token_blocks", "documents"),
    since=4,
    scored=False,
    rows={"documents": ("units",), "tokens": ("tokens",), "token_blocks": ("tokens", "blocks")},
    task_fields=("kind", "text", "max_tokens", "group_field", "answer"),
    rules={
        "tokens": Rules(bounds={"pos": (0, "T-1"), "token": (0, "V-1"), "loss": NONNEGATIVE}),
        "token_blocks": Rules(bounds={"pos": (0, "T-1"), "block": (0, "L-1")}),
    },
)
KINDS = {k.name: k for k in (CHOICE, TEXT)}
"""Every task kind by name."""
DEFAULT_KIND = CHOICE.name
"""The kind of a task YAML or manifest that names none."""
TASK_FIELDS = frozenset(f for k in KINDS.values() for f in k.task_fields)
"""The task YAML's keys of some kind alone."""
