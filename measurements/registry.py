"""The optional measurements an extraction can add to a partition, declared once each.

A measurement is a :class:`Measurement`: the ``extract`` option that asks for it (and the options
of its settings), the task kinds it applies to and the tables it writes for each, the settings it
records in the partition's manifest under its own name, whether its batches need rows over the
vocabulary (the batch budget), whether its passes need gradients, its forward hooks on each task
kind (:attr:`Measurement.attach`, given an :class:`Attachment`; bound to the kind's own capture
where they derive from it), how its rows are built (:attr:`Measurement.rows`) and their counts
checked (:attr:`Measurement.check_rows`), its cost in forward passes (:attr:`Measurement.flops`),
and its checks of a plan (:attr:`Measurement.plan_check`) and of a model
(:attr:`Measurement.model_check`). The command line, ``ExtractConfig``, the extraction, its cost
estimate, the completeness check, ``ls``, ``query``'s views and ``merge`` read these
declarations.

A measurement is one folder, ``measurements/<name>/``: its declaration (the package's
``__init__.py``), its hooks (``hooks.py``, the only module of it that imports torch) and its
analyses. Every one registers through the entry point group :data:`ENTRY_POINTS` (the entry point
names the :class:`Measurement` object): the built-in ones in layerdiv's ``pyproject.toml``, which
this registry does not import by name, another distribution's in its own; or in one process with
:func:`register`. See docs/development.md, "Adding a measurement".
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, NamedTuple, Protocol, runtime_checkable

import click
import pyarrow as pa

from layerdiv.errors import LayerdivError
from layerdiv.registry import Registry
from layerdiv.schemas import TABLES, Rules, schema_of
from layerdiv.schemas.kinds import KINDS

ENTRY_POINTS = "layerdiv.measurements"
"""The entry point group whose entries (each a :class:`Measurement`) are registered on first
use."""


class AnswerError(LayerdivError, ValueError):
    """A measurement that needs each document's answer, asked of a task that names none."""


class MeasurementError(LayerdivError, ValueError):
    """A measurement that cannot be registered (a taken name, flag, option, setting or table, an
    unknown kind), or one declared outside layerdiv whose code failed or whose rows are wrong."""


class Capture(Protocol):
    """The forward hooks of a measurement on one model (what :attr:`Measurement.attach` gives):
    :meth:`reset` before each forward pass, :meth:`result` after it (one value per batch row),
    :meth:`remove` when the run ends."""

    def reset(self) -> None: ...

    def result(self) -> Sequence[Any]: ...

    def remove(self) -> None: ...


@runtime_checkable
class RowsCapture(Capture, Protocol):
    """A :class:`Capture` whose values depend on which instance or document each batch row is:
    :meth:`batch` is called after :meth:`reset`, before the forward pass."""

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        """The rows' instances or documents (None: a probe pass, whose values are not stored)
        and their token counts (rows are left-padded)."""


@runtime_checkable
class RunCapture(Capture, Protocol):
    """A :class:`Capture` whose values add up over a run of instances or documents stored as one
    part (sums over its tokens: ``--lens-stats``): :meth:`begin` before the first batch of each
    contiguous run the extraction computes (every batch of the run follows, none of another)."""

    def begin(self, ids: Sequence[int]) -> None:
        """The run's instances or documents (ascending), before its first batch."""


@runtime_checkable
class DecompositionCapture(Capture, Protocol):
    """A :class:`Capture` whose values derive from the task kind's own capture: a choice task's
    last-token decomposition (methods §1, ``layerdiv.extract.capture.ComponentCapture``, each
    pass's ``BatchDecomposition``) or a text task's per-token capture (methods §9,
    ``layerdiv.extract.text.TextCapture``, each pass's ``TextBatch``): :meth:`bind` once after it
    is attached, before any forward pass; :meth:`decomposed` after each pass, before
    :meth:`result`."""

    def bind(self, capture: Any) -> None:
        """The kind's own capture of the same model (a choice task's: its option rows, readout,
        component outputs; a text task's: its block inputs, block calls and input ids) and its
        pause switch (a paused capture keeps nothing: hooks bound to it keep nothing either, so
        that passes of a bound capture's own, the skips', leave the others' values alone)."""

    def decomposed(self, batch: Any) -> None:
        """The pass's decomposition (``BatchDecomposition``, or ``TextBatch``: its ``loss`` may
        be set here, from a readout of h_L the hooks take anyway)."""


@runtime_checkable
class GradientCapture(Capture, Protocol):
    """The :class:`Capture` of a measurement declared with ``needs_grad``: before the model's
    pass (inference mode, whose tensors keep no graph), the batch runs for it alone with
    gradients on and the task kind's own capture paused, and :meth:`backward` gets that pass's
    output. Its hooks keep nothing while gradients are off (``torch.is_grad_enabled()``: every
    other pass), and the values of other hooks in its pass are reset before theirs."""

    def backward(self, output: Any) -> None:
        """Its pass's model output (``logits`` of the last position): take the gradients
        (``torch.autograd.grad`` of a target w.r.t. the states its hooks kept)."""


@runtime_checkable
class PartitionCapture(Capture, Protocol):
    """A :class:`Capture` that computes, once per partition and before its first chunk, the
    tables it stores for the whole partition (:attr:`Measurement.whole`) and settings derived from
    them (their fingerprint: recorded and compared with the measurement's own, so that two
    shards, a resume or a merge never mix two of them)."""

    def prepare(
        self,
        seqs: Sequence[Sequence[int]],
        probe: Callable[[list[list[int]]], Any],
        stored: Mapping[str, pa.Table],
    ) -> tuple[dict[str, Any], dict[str, pa.Table]]:
        """``seqs``: every unit's token ids, in the task's order; ``probe(seqs)`` runs one
        forward pass over them whose values are not stored (the kind's own capture keeps the
        pass); ``stored``: the partition's stored whole tables (a resume, another shard), to be
        used rather than computed again. Returns (the derived settings, the whole tables)."""


@dataclass(frozen=True)
class Attachment:
    """What a measurement's hooks are attached with (:attr:`Measurement.attach`'s one argument):
    one model, as one task's extraction runs it."""

    model: Any
    """The model (a ``transformers`` causal LM, its weights loaded)."""
    adapter: Any
    """Its ``layerdiv.extract.adapters.Adapter``: where its blocks, norms and sublayers are."""
    kind: str
    """The task's kind (``choice``, ``text``): a measurement of several kinds hooks each its
    own way."""
    settings: Mapping[str, Any]
    """The measurement's settings (:attr:`Measurement.settings`), as this run resolved them."""
    readout: Any
    """The model's final norm and unembedding (``layerdiv.extract.readout.Readout``), built once
    per model and shared by every capture that reads residual states out."""
    option_ids: Sequence[int] = ()
    """Choice tasks: the token id of each option (the task's, the same for every instance)."""
    gold: Sequence[int] = ()
    """Choice tasks: each instance's gold option (an index into :attr:`option_ids`), by
    instance (:meth:`RowsCapture.batch` says which instance each batch row is)."""
    planned: Any = None
    """What the measurement's check of the plan (:attr:`Measurement.plan_check`) gave, for its
    hooks (the future effects: each document's answer span)."""
    weights_fingerprint: str = ""
    """The model's weights fingerprint (``Manifest.weights_fingerprint``): hooks that read
    something fitted on one model's weights (a learned lens's translators) check it."""
    progress: Callable[[float], None] = lambda share: None
    """Hooks that run passes of their own call it with the share (0 to 1) of the current
    batch's work done so far, so that the progress bar moves within a batch (the runner counts
    the batch's units in full once it is done)."""


class AnswerSpan(NamedTuple):
    """Where a document's answer lies (methods §10), as the depth-efficiency paper's code counts
    it: its first token s = T - A, T the document's tokens (special tokens included, before any
    cut to ``max_tokens``) and A the answer's own tokens without special tokens; and whether a
    token merges across the boundary (the document's first s tokens are not the text's own
    tokens: that token counts as the answer's)."""

    start: int
    length: int
    merges: bool


def answer_spans(tokenizer: Any, items: Sequence[Any]) -> list[AnswerSpan]:
    """Each document's :class:`AnswerSpan` (``items``: documents with ``prompt`` = text + answer
    and ``answer``)."""
    out = []
    for item in items:
        ids = tokenizer(item.prompt)["input_ids"]
        length = len(tokenizer(item.answer, add_special_tokens=False)["input_ids"])
        start = len(ids) - length
        text = item.prompt[: len(item.prompt) - len(item.answer)]
        out.append(AnswerSpan(start, length, tokenizer(text)["input_ids"] != ids[:start]))
    return out


@dataclass(frozen=True)
class Planning:
    """What a measurement's check of a task's plan (:attr:`Measurement.plan_check`) is given, before
    the weights load."""

    task: Any
    """The task (``layerdiv.extract.tasks.TaskSpec``: ``name``, ``kind``, ``max_tokens``,
    ``answer``, ...)."""
    items: Sequence[Any]
    """Its instances or documents (``prompt``, ``answer``, ...), as this run takes them."""
    tokenizer: Any
    """The model's tokenizer."""
    settings: Mapping[str, Any]
    """The measurement's settings, as this run resolved them."""
    notes: list[str] = field(default_factory=list)
    """What the user should know (the check appends to it; printed with the task's summary)."""
    answers: Sequence[AnswerSpan] | None = None
    """A text task with an answer: each document's answer span, computed once per task by the
    plan (:func:`answer_spans`); None otherwise."""
    sequences: Callable[[str, int], list[list[int]]] | None = None
    """(another task's name or YAML path, n) -> the token ids of its first n units (at most),
    as an extraction of it with this tokenizer takes them (a reference taken from another
    task); None where no task can be loaded."""

    def other_task(self, name: str, count: int) -> list[list[int]]:
        """The token ids of task ``name``'s first ``count`` units (:attr:`sequences`)."""
        if self.sequences is None:
            raise MeasurementError(f"task {name} cannot be loaded in this plan")
        return self.sequences(name, count)

    def require_answers(self, why: str, instead: str) -> list[tuple[int, int]]:
        """Per document, its answer's start s and length A (:attr:`answers`), with a note where
        a token merges across the boundary and one where ``max_tokens`` cuts answers off
        entirely (:meth:`cut_answers`); refuses a task without an answer, and a document whose
        answer is empty, in one line (``why``: what needs it; ``instead``: what to do
        otherwise)."""
        if self.answers is None:
            raise AnswerError(
                f"task {self.task.name}: {why}, and the task names none; add an 'answer' "
                f"template beside 'text' (the document is text + answer), or {instead}"
            )
        empty = [doc for doc, span in enumerate(self.answers) if span.length < 1]
        if empty:
            raise AnswerError(
                f"task {self.task.name}: document {empty[0]}'s answer is empty (no tokens of its "
                f"own; {len(empty)} of {len(self.answers)} documents): {why}; fix the data or "
                f"the task's answer template, filter such rows out, or {instead}"
            )
        merged = [doc for doc, span in enumerate(self.answers) if span.merges]
        cut = self.cut_answers()
        notes = [
            f"{len(merged)} of {len(self.answers)} documents have a token that merges across "
            f"the answer's boundary (the first: document {merged[0]}); it counts as the "
            "answer's (methods §10)"
            if merged
            else None,
            f"{len(cut)} of {len(self.answers)} documents' answers lie wholly past max_tokens "
            f"{self.task.max_tokens} (the first: document {cut[0]}): they have no measurable "
            "answer, and the answer-anchored measurements store them as missing (null; no "
            "split point for the future effects), left out of every mean and count"
            if cut
            else None,
        ]
        self.notes.extend(n for n in notes if n is not None and n not in self.notes)
        return [(span.start, span.length) for span in self.answers]

    def cut_answers(self) -> list[int]:
        """The documents whose answer the task's ``max_tokens`` cuts off entirely (its first
        token s at or past the cut: no position predicts an answer token)."""
        cap = self.task.max_tokens
        spans = self.answers or []
        return [doc for doc, span in enumerate(spans) if cap is not None and span.start >= cap]


class ModelShape(Protocol):
    """What a pass costs (``layerdiv.extract.cost.Shape``): blocks L, width d, vocabulary V, the
    attention's FLOPs per (position, earlier position) pair of a block, and the FLOPs of a
    block, a readout and a plain forward pass."""

    @property
    def layers(self) -> int: ...

    @property
    def d(self) -> int: ...

    @property
    def vocab(self) -> int: ...

    @property
    def attention(self) -> int: ...

    def block(self, tokens: int) -> float: ...

    def readout(self, positions: int = 1) -> float: ...

    def forward(self, tokens: int) -> float: ...


Attach = Callable[[Attachment], Capture | None]
"""The model and task (:class:`Attachment`) -> the hooks the measurement needs, attached (None:
none of its own for this task kind, whose captures in ``layerdiv.extract`` compute it)."""

Rows = Callable[[Sequence[int], Sequence[Any]], dict[str, pa.Table]]
"""(instances or documents, ascending; the capture's value of each) -> its tables."""

Flops = Callable[[ModelShape, str, int, Mapping[str, Any]], float]
"""(the model's shape, the task kind, a sequence's tokens, the measurement's settings) -> the
FLOPs it adds to the plain forward pass over that sequence."""


def negligible(shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]) -> float:
    """The :data:`Flops` of a measurement whose work (dot products, projections, copies of
    states the pass computes anyway) is small against the blocks': none."""
    return 0.0


PlanCheck = Callable[[Planning], Any]
"""A task's plan -> what the measurement's hooks get as :attr:`Attachment.planned`; refuses
(a ``layerdiv.errors.LayerdivError``, one line) settings the task cannot follow."""

ModelCheck = Callable[[Any], Any]
"""A model's config -> a refusal (``layerdiv.errors.LayerdivError``, one line) where the
measurement cannot measure it (checked before the weights load)."""

SizeWarning = Callable[[Sequence[int], Sequence[int], str, Mapping[str, Any], int, int], str | None]
"""(each unit's token count, the units a run computes it for, the task kind, its settings, the
model's blocks L and width d) -> a line to print before that run, where its tables will be
large, or None."""

CheckRows = Callable[[Mapping[str, int], int, Mapping[str, Any]], tuple[str, str] | None]
"""(the row count of each table of one chunk's parts, the model's blocks, the measurement's
settings) -> (the first table whose count cannot be right, what is wrong), or None."""


def per_token_and_layer(table: str) -> CheckRows:
    """The :data:`CheckRows` of a text task's ``table`` that holds a row per token of the chunk
    (its ``tokens`` rows) and layer 0..L."""

    def check(rows: Mapping[str, int], blocks: int, settings: Mapping[str, Any]) -> Any:
        found, tokens = rows.get(table), rows.get("tokens")
        if found is None or tokens is None or found == tokens * (blocks + 1):
            return None
        return table, (
            f"{found} rows where the chunk needs {tokens * (blocks + 1)} (one per token of its "
            f"{tokens} and layer 0..{blocks})"
        )

    return check


@dataclass(frozen=True)
class Setting:
    """One setting of a measurement: the ``extract`` option that gives it, and its default."""

    name: str
    """The key in the manifest's settings of the measurement (and the option's parameter)."""
    option: click.Option
    """The ``extract`` option (its default must be None: not given keeps the stored value)."""
    default: Any
    """The value of a new partition when the option is not given."""
    unordered: bool = False
    """A repeated option whose values are a set: given in another order than the partition
    recorded them, they are the recorded ones (not refused)."""


@dataclass(frozen=True)
class Measurement:
    """One optional measurement (see the module's docstring)."""

    name: str
    """Its name: the key of its settings in the manifest and of its options in
    ``ExtractConfig.measurement_settings``."""
    flag: str
    """The ``extract`` option that asks for it (``--gram``)."""
    tables: Mapping[str, tuple[str, ...]]
    """Task kind -> the tables it writes in that kind's partitions."""
    help: str = ""
    """The flag's help line; empty when another measurement declares the same flag."""
    option: click.Option | None = None
    """The flag's option when it is not a plain on/off flag (``--lens [final|last-block]``)."""
    schemas: Mapping[str, pa.Schema] = field(default_factory=dict)
    """The schemas of tables declared outside ``layerdiv.schemas`` (a measurement registered
    from another distribution); every built-in table's schema is in ``layerdiv.schemas``."""
    rules: Mapping[str, Rules] = field(default_factory=dict)
    """The row rules of its tables that have some (key grid, value ranges:
    ``layerdiv.schemas.Rules``), checked by every reader (:func:`table_rules`): the one place
    they are declared, for a built-in measurement as for one from another distribution."""
    settings: tuple[Setting, ...] = ()
    """Everything of it that changes a stored number: recorded in the manifest's settings under
    its name and in the key-value metadata of each of its parts (:data:`SETTINGS_KEY`), compared
    by every run (a run giving another value is refused, one giving none keeps the stored one),
    by ``merge`` and by every reader."""
    legacy: bool = False
    """Its settings were manifest fields of the same names before the manifest had
    ``settings`` (read into ``settings`` from such a manifest: :func:`legacy_settings`)."""
    vocab_rows: tuple[str, ...] = ()
    """The task kinds in which its batches hold rows over the vocabulary at every token (the
    batch budget: fewer tokens per batch)."""
    needs_grad: bool = False
    """Its hooks take gradients (a :class:`GradientCapture`): the batch runs again for them
    alone, out of inference mode (every other pass stays in it)."""
    attribution: bool = False
    """An attribution measurement (integrated gradients, erasure): many passes per token, so
    ``extract`` prints its cost estimate before every run of it, however short
    (``layerdiv.extract.cost``)."""
    attach: Attach | str | None = None
    """Its forward hooks on each task kind; or ``"module:attribute"`` naming them, imported
    when an extraction attaches them (a built-in measurement names its folder's ``hooks``
    module, ``f"{__name__}.hooks:..."``: the declaration does not import torch)."""
    rows: Rows | None = None
    """How its rows are built from :attr:`attach`'s values."""
    check_rows: CheckRows | None = None
    """How the row counts of its tables in one chunk relate (read from the parts' footers when
    a store is opened: every reader relies on it); None: only whole rows per instance of a
    choice task are checked."""
    flops: Flops | None = None
    """The FLOPs it adds to a sequence's plain forward pass (``extract``'s estimate, the docs'
    cost table); None: one more plain pass."""
    costed: Mapping[str, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    """Task kind -> further settings the docs' cost table shows it with, beside its
    defaults."""
    plan_check: PlanCheck | str | None = None
    """Its check of a task's plan (or ``"module:attribute"``), before the weights load."""
    model_check: ModelCheck | str | None = None
    """Its check of the model's config (or ``"module:attribute"``), before the weights load."""
    size_warning: SizeWarning | str | None = None
    """What a run prints before it starts where its tables will be large (or
    ``"module:attribute"``)."""
    whole: tuple[str, ...] = ()
    """Tables it stores once per partition, not per chunk (``layerdiv.schemas.WHOLE_TABLES``),
    given by its hooks' :meth:`PartitionCapture.prepare` before the first chunk."""
    fingerprints: Mapping[str, tuple[str, Callable[[pa.Table], str]]] = field(default_factory=dict)
    """Per table of :attr:`whole`: the setting its hooks derive from it (recorded in the
    manifest) and how that is computed from the table; every read of the table's file
    (``layerdiv.store.parts.read_whole``) and ``merge`` compare the two."""
    since: Mapping[str, int] = field(default_factory=dict)
    """The schema version (``layerdiv.schemas.SCHEMA_VERSION``) each of its tables, chunk and
    whole ones, appeared in: a store of an older version holds none of them
    (:func:`tables_of`). A built-in's; a table not named (a plug-in's) is read from any store
    that holds it."""
    order: int = 0
    """Its place among the measurements of its distribution (:func:`loaded`): the order of the
    ``extract`` options and of the optional tables everywhere."""

    def attach_to(self, ctx: Attachment) -> Capture | None:
        """:attr:`attach`'s hooks on ``ctx.model``, attached (the named ones imported first)."""
        if self.attach is None:
            raise MeasurementError(f"measurement {self.name} has no hooks")
        return _resolve(self.attach)(ctx)

    def check_plan(self, planning: Planning) -> Any:
        """:attr:`plan_check`'s check of a task's plan (None where it declares none)."""
        return None if self.plan_check is None else _resolve(self.plan_check)(planning)

    def check_model(self, config: Any) -> None:
        """:attr:`model_check`'s check of a model's config (none declared: every model)."""
        if self.model_check is not None:
            _resolve(self.model_check)(config)

    def size_warning_of(
        self,
        lengths: Sequence[int],
        units: Sequence[int],
        kind: str,
        settings: Mapping[str, Any],
        blocks: int,
        width: int,
    ) -> str | None:
        """:attr:`size_warning`'s line for a run computing it for ``units`` (None: none)."""
        if self.size_warning is None:
            return None
        return _resolve(self.size_warning)(lengths, units, kind, settings, blocks, width)

    def flops_of(
        self, shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]
    ) -> float:
        """The FLOPs it adds to a plain pass over a sequence of ``tokens`` tokens
        (:attr:`flops`; none declared: one plain pass)."""
        if self.flops is None:
            return shape.forward(tokens)
        return self.flops(shape, kind, tokens, settings)

    def schema(self, table: str) -> pa.Schema:
        """The schema of one of its tables."""
        return self.schemas.get(table) or TABLES[table]

    @property
    def dest(self) -> str:
        """The flag's parameter name (``--skip-x`` -> ``skip_x``)."""
        return self.flag.lstrip("-").replace("-", "_")

    def defaults(self) -> dict[str, Any]:
        """Its settings' values for a new partition when no option gives them (JSON types)."""
        return as_json({s.name: s.default for s in self.settings})

    def command(self, settings: Mapping[str, Any] | None) -> str:
        """The ``extract`` options that ask for it with ``settings`` (None: its flag alone)."""
        words = [] if any(s.option.opts[0] == self.flag for s in self.settings) else [self.flag]
        given = {} if settings is None else settings
        for s in self.settings if settings is not None else ():
            value = given.get(s.name, s.default)
            values = value if isinstance(value, list | tuple) else [value]
            values = [v for v in values if v is not None]  # not given: no option
            words += [f"{s.option.opts[0]} {v}" for v in values]
        return " ".join(words or [self.flag])

    def describe(self, settings: Mapping[str, Any] | None) -> str:
        """``settings`` as the options that give them, and those derived by its hooks
        (:meth:`PartitionCapture.prepare`) as ``name value``, for messages (``none
        recorded``)."""
        if settings is None:
            return "none recorded"
        own = {s.name for s in self.settings}
        derived = [f"{k} {str(v)[:12]}" for k, v in sorted(settings.items()) if k not in own]
        return " ".join([self.command(settings), *derived])

    def click_options(self) -> list[click.Option]:
        """The ``extract`` options it declares: its flag (unless shared) and its settings'."""
        flag = self.option or (
            click.Option([self.flag, self.dest], is_flag=True, default=False, help=self.help)
            if self.help
            else None
        )
        return [*([flag] if flag is not None else []), *(s.option for s in self.settings)]

    def modules(self, capture: Any = None) -> set[str]:
        """The modules of its code outside layerdiv (its hooks, the class of their ``capture``
        where given, its rows); empty for a built-in measurement."""
        attach = self.attach
        named = attach.partition(":")[0] if isinstance(attach, str) else None
        found = {named, *(getattr(f, "__module__", None) for f in (attach, self.rows))}
        if capture is not None:
            found.add(type(capture).__module__)
        return {m for m in found if isinstance(m, str) and m.split(".")[0] != "layerdiv"}


def _resolve(value: Any) -> Any:
    """``value``, or the attribute that ``"module:attribute"`` names (imported)."""
    if not isinstance(value, str):
        return value
    module, _, name = value.partition(":")
    return getattr(import_module(module), name)


SETTINGS_KEY = b"layerdiv.settings"
"""The key, in a part's Parquet key-value metadata, of the settings (JSON) of the measurement
that wrote it."""


def as_json(value: Any) -> Any:
    """``value`` as a JSON file holds it (tuples as lists): settings compare equal only so."""
    return json.loads(json.dumps(value))


def legacy_settings(data: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The settings of the measurements whose settings a manifest written before it had
    ``settings`` kept as fields of their own (``lens``, ``skip_split``, ...): those of each such
    measurement whose first setting is there, the rest at their defaults."""
    out = {}
    for m in registered():
        if m.legacy and data.get(m.settings[0].name) is not None:
            given = {s.name: data[s.name] for s in m.settings if data.get(s.name) is not None}
            out[m.name] = {**m.defaults(), **as_json(given)}
    return out


MEASUREMENTS: Registry[Measurement] = Registry(
    "measurement", ENTRY_POINTS, lambda entry, measurement: register(measurement)
)
"""Every measurement by name: those of the entry point group :data:`ENTRY_POINTS` (the built-in
ones first), then those registered by :func:`register`."""
_RESERVED: dict[str, str] = {}
"""The option strings and parameter names of the ``extract`` command's own options (not a
measurement's), each with its owner: :func:`reserve`."""


def option_names(options: Iterable[click.Parameter]) -> dict[str, click.Parameter]:
    """Every option string (``--lens``, ``-h``) and parameter name (``lens``) of ``options``: the
    names two options of one command may not share."""
    return {n: o for o in options for n in (*o.opts, *o.secondary_opts, o.name) if n}


def reserve(owner: str, options: Iterable[click.Parameter]) -> None:
    """Record the names of a command's own ``options`` (``extract``'s: a measurement adds its
    options beside them), which :func:`register` then refuses; a measurement registered before
    that takes one is refused now (``MeasurementError``)."""
    for name in option_names(options):
        _RESERVED.setdefault(name, owner)
    for m in list(MEASUREMENTS.by_name.values()):
        if problem := _name_taken(m):
            unregister(m.name)
            raise MeasurementError(problem)


def _name_taken(measurement: Measurement) -> str | None:
    """Why ``measurement``'s options cannot be added to ``extract``'s: a name (option string,
    parameter or setting name) that the command or another measurement has, a setting whose
    name is not its option's parameter, or a flag that no option declares; None if none."""
    m = measurement
    taken = dict(_RESERVED)
    for other in MEASUREMENTS.by_name.values():
        if other.name != m.name:
            taken.update(
                dict.fromkeys(option_names(other.click_options()), f"measurement {other.name}")
            )
    mine = option_names(m.click_options())
    for name in mine:
        if name in taken:
            return (
                f"measurement {m.name}: the option name {name!r} is taken by {taken[name]}; "
                "give its flag, options and settings names of their own"
            )
    for s in m.settings:
        if s.name != s.option.name:
            return (
                f"measurement {m.name}: setting {s.name!r} is given by an option whose parameter "
                f"is {s.option.name!r}; name the setting as its option's parameter"
            )
    if m.flag not in mine and not any(
        m.flag in option_names(o.click_options()) for o in MEASUREMENTS.by_name.values()
    ):
        return (
            f"measurement {m.name}: its flag {m.flag} is declared by no option; give it a help "
            "line (Measurement.help) or an option (Measurement.option)"
        )
    return None


def table_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a table (its files' and folders' name, a ``query`` view): it
    must be a Python identifier of ASCII letters, digits and underscores (never a path such
    as ``../../x``); None if it can."""
    if isinstance(name, str) and name.isascii() and name.isidentifier():
        return None
    return f"table name {name!r} is not an identifier (ASCII letters, digits and underscores)"


def register(measurement: Measurement) -> Measurement:
    """Add ``measurement`` to every extraction, store reader and command; returns it. Refuses a
    name, table, flag, option or setting name that is taken (by another measurement, or by
    ``extract`` itself: :func:`reserve`), and a kind that does not exist."""
    if measurement.name in MEASUREMENTS:  # the entry points' measurements come first
        raise MeasurementError(f"a measurement named {measurement.name!r} is registered already")
    if problem := _name_taken(measurement):
        raise MeasurementError(problem)
    unknown = [k for k in measurement.tables if k not in KINDS]
    if unknown:
        raise MeasurementError(
            f"measurement {measurement.name}: unknown task kind {unknown[0]!r} "
            f"(the kinds are {', '.join(KINDS)})"
        )
    for table in (*(t for ts in measurement.tables.values() for t in ts), *measurement.whole):
        if problem := table_name_problem(table):
            raise MeasurementError(f"measurement {measurement.name}: {problem}; rename it")
    taken = {t for m in MEASUREMENTS for ts in m.tables.values() for t in ts}
    taken |= {t for k in KINDS.values() for t in k.required}
    mine = [t for ts in measurement.tables.values() for t in ts]
    dated = [t for t in measurement.since if t not in (*mine, *measurement.whole)]
    if dated:
        raise MeasurementError(
            f"measurement {measurement.name}: a schema version for {dated[0]!r}, which is not "
            "one of its tables"
        )
    ruled = [t for t in measurement.rules if t not in (*mine, *measurement.whole)]
    if ruled:
        raise MeasurementError(
            f"measurement {measurement.name}: row rules for {ruled[0]!r}, which is not one of "
            "its tables"
        )
    clash = [t for t in mine if t in taken or (t not in TABLES and t not in measurement.schemas)]
    if clash:
        raise MeasurementError(
            f"measurement {measurement.name}: table {clash[0]!r} is taken or has no schema "
            "(declare it in Measurement.schemas)"
        )
    MEASUREMENTS.put(measurement.name, measurement)
    _tables.cache_clear()
    return measurement


def unregister(name: str) -> None:
    """Remove a registered measurement (tests)."""
    MEASUREMENTS.remove(name)
    _tables.cache_clear()


def registered() -> list[Measurement]:
    """Every measurement, in registration order: those of the entry point group (the built-in
    ones first), then those registered by :func:`register`."""
    return list(MEASUREMENTS)


def for_kind(kind: str) -> list[Measurement]:
    """The measurements that apply to task kind ``kind``."""
    return [m for m in registered() if kind in m.tables]


def optional_tables(kind: str) -> dict[str, str]:
    """The optional tables of ``kind``'s partitions and the ``extract`` flag that writes each."""
    return dict(_tables()[0][kind])


def all_optional_tables() -> tuple[str, ...]:
    """Every optional table of every kind (each once: a table may be of several kinds)."""
    return tuple(dict.fromkeys(t for k in KINDS for t in _tables()[0][k]))


@functools.cache
def _tables() -> tuple[dict[str, dict[str, str]], dict[str, pa.Schema], dict[str, Rules]]:
    """The optional tables of each kind with their flags, every table's schema and the row rules
    of those that have some, as the registry stands (recomputed after :func:`register` and
    :func:`unregister`): a store's reader asks for them once per partition, thousands of times
    on a checkpoint sweep."""
    optional = {k: {t: m.flag for m in for_kind(k) for t in m.tables[k]} for k in KINDS}
    extra = {t: m.schema(t) for m in registered() for ts in m.tables.values() for t in ts}
    rules = {t: r for k in KINDS.values() for t, r in k.rules.items()}
    rules |= {t: r for m in registered() for t, r in m.rules.items()}
    return optional, {**TABLES, **extra}, rules


def ruled_tables(kind: str) -> set[str]:
    """The optional tables of ``kind`` whose measurement declares how their row counts relate
    (:attr:`Measurement.check_rows`): not held to whole rows per instance of a choice task."""
    return {t for m in for_kind(kind) if m.check_rows is not None for t in m.tables[kind]}


def measurement_of(table: str) -> Measurement:
    """The measurement that writes ``table`` (per chunk, or once per partition)."""
    for m in registered():
        if table in m.whole or any(table in ts for ts in m.tables.values()):
            return m
    raise KeyError(table)


def table_schemas() -> dict[str, pa.Schema]:
    """Every table's schema: ``layerdiv.schemas.TABLES`` and the registered measurements'."""
    return dict(_tables()[1])


def table_rules(table: str) -> Rules:
    """The row rules of ``table``: its measurement's (:attr:`Measurement.rules`) or, a task
    kind's required table, its kind's (``layerdiv.schemas.kinds.Kind.rules``); none declared:
    no rule."""
    return _tables()[2].get(table, Rules())


def tables_of(version: int) -> dict[str, pa.Schema]:
    """The tables (and their schemas, :func:`layerdiv.schemas.schema_of`) of a store written with
    schema ``version``: each task kind's required ones from the version the kind appeared in
    (``Kind.since``), each measurement's from the version it declares
    (:attr:`Measurement.since`)."""
    since = {t: kind.since for kind in KINDS.values() for t in kind.required}
    since |= {t: v for m in registered() for t, v in m.since.items()}
    schemas = table_schemas()
    return {t: schema_of(t, version) or schemas[t] for t, v in since.items() if v <= version}


def kind_of_table(table: str) -> str | None:
    """The first task kind whose partitions hold ``table`` (None: no such table)."""
    for name, kind in KINDS.items():
        if table in kind.required or table in optional_tables(name):
            return name
    return None


def tables_of_kind(kind: str) -> tuple[str, ...]:
    """The tables of ``kind``'s partitions: the required ones, then the optional ones."""
    return (*KINDS[kind].required, *optional_tables(kind))


@contextmanager
def plugin_errors(measurements: Iterable[tuple[Measurement, Any]], what: str) -> Iterator[None]:
    """Re-raise an exception whose traceback passes through the code of a measurement declared
    outside layerdiv (:meth:`Measurement.modules`; ``measurements`` pairs each with its attached
    capture, or None) as one line naming it (``MeasurementError``); ``what``: what ran (its
    hooks, its rows). Other exceptions, and running out of accelerator memory (the batch is
    halved), pass unchanged."""
    try:
        yield
    except MeasurementError:
        raise
    except Exception as err:
        if type(err).__name__ == "OutOfMemoryError":
            raise
        owners = {mod: m for m, capture in measurements for mod in m.modules(capture)}
        frames, tb = [], err.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame.f_globals.get("__name__"))
            tb = tb.tb_next
        culprit = next((owners[f] for f in reversed(frames) if f in owners), None)
        if culprit is None:
            raise
        raise MeasurementError(
            f"measurement {culprit.name} ({culprit.flag}) failed in {what}: "
            f"{type(err).__name__}: {err}; nothing of this chunk was written; fix the "
            f"measurement, or extract without {culprit.flag}"
        ) from err
