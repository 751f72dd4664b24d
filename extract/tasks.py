"""Task definitions: one small YAML per task (template, options, label rule, data source, n).

A task YAML has these keys (see ``layerdiv/tasks/*.yaml`` for the built-in ones)::

    name: sst2                      # store partition name
    dataset: {path: nyu-mll/glue, name: sst2, split: validation}   # a hub dataset, or
    data: reviews.jsonl             # a local .jsonl/.json/.csv/.parquet file next to the YAML
                                    # (``data_files``, the hub datasets word, is the same key)
    template: "{{ sentence }}\\nQuestion: ... Answer: {{ answer }}"   # Jinja; ends with the answer
    options: [negative, positive]
    label: "{{ label }}"            # Jinja; renders an option string or a 0-based option index
    filter: "{{ choices.label | length == 4 }}"   # optional; rows rendering False are skipped
    n: 2000                         # default instance count (the first n rows that pass)

The prompt is the template's text before ``{{ answer }}``, without the spaces just before it; the
option token is the first token of ``<those spaces><option>`` as the tokenizer splits it after
the prompt (so ``Answer: negative`` scores the token `` negative``).

A running-text task (``kind: text``) has no template, options or label; instead::

    kind: text
    text: "Question: {{ question }}\nAnswer: {{ answer }}"   # Jinja; renders one document
    max_tokens: 1024                # optional: documents are cut to their first max_tokens tokens
    group_field: level              # optional: a field stored with each document (as a string),
                                    # or a Jinja expression: "{{ orig_triples | length }}"
    answer: " {{ solution }}"       # optional: Jinja; the document is text + answer (methods §10)

Its data is read as a choice task's (a ``.txt`` file: one document per non-empty line, as the
field ``text``, a Windows line end's ``\r`` removed); documents are numbered in file order.

A field that renders a list or an object (a JSON array in the text field) is refused, naming the
row: its Python form would enter the text. Join it in the template instead
(``{{ sentences | join(" ") }}``).
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import pyarrow.csv as pa_csv
import pyarrow.parquet as pq
import yaml

from layerdiv.errors import LayerdivError
from layerdiv.schemas import MAX_OPTIONS
from layerdiv.schemas.kinds import DEFAULT_KIND, KINDS, TASK_FIELDS

ANSWER = "{{ answer }}"


class TaskError(LayerdivError, ValueError):
    """A task definition or its data is unusable; the message names the problem."""


@dataclass(frozen=True)
class HubDataset:
    """A dataset on the HuggingFace hub (needs the ``hf`` extra: ``datasets``)."""

    path: str
    """Dataset id, e.g. ``nyu-mll/glue``."""
    split: str
    """Split to read, e.g. ``validation``."""
    name: str | None = None
    """Configuration name, e.g. ``sst2``."""


@dataclass(frozen=True)
class TaskSpec:
    """One task: how to turn data rows into prompts, options and gold labels."""

    name: str
    """Task name; the store partition ``task=<name>``."""
    template: str = ""
    """Jinja template of the full text; ends with ``{{ answer }}`` (choice tasks)."""
    options: tuple[str, ...] = ()
    """Answer option strings (2 to 4 in the paper; any K from 2 to ``MAX_OPTIONS`` works)."""
    label: str = ""
    """Jinja expression rendering the gold option string or its 0-based index."""
    n: int = 2000
    """Default number of instances: the first n rows that pass ``filter``."""
    dataset: HubDataset | None = None
    """Hub dataset to read (exclusive with ``data``)."""
    data: str | None = None
    """Local data file (.jsonl/.json/.csv/.parquet), relative to the YAML's folder."""
    filter: str | None = None
    """Optional Jinja expression; rows where it renders ``False`` are skipped."""
    description: str = ""
    """Free text: where the task comes from."""
    kind: str = DEFAULT_KIND
    """``choice`` (scored options at the last prompt token) or ``text`` (every token of running
    text; ``layerdiv.schemas.kinds``)."""
    text: str | None = None
    """Text tasks: Jinja template rendering one document."""
    max_tokens: int | None = None
    """Text tasks: documents are cut to their first ``max_tokens`` tokens (default: the model's
    context length)."""
    group_field: str | None = None
    """Text tasks: a data field stored with each document as its ``group``, or a Jinja expression
    of the row's fields (it contains ``{{``) rendering it."""
    answer: str | None = None
    """Text tasks: Jinja template of the answer; the document is text + answer, the answer's
    start found as ``layerdiv.measurements.answer_spans`` does (methods §10)."""
    base_dir: Path = field(default=Path("."), compare=False)
    """Folder of the YAML file (local data paths are relative to it)."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("base_dir")
        for key in TASK_FIELDS - set(KINDS[self.kind].task_fields):
            d.pop(key)  # as before other kinds existed (a stored partition's hash)
        if self.answer is None:  # as before text tasks could name an answer
            d.pop("answer", None)
        return d

    def sha256(self) -> str:
        """Hash of everything that decides the prompts, options and labels (not the
        description)."""
        decisive = {k: v for k, v in self.to_dict().items() if k != "description"}
        return hashlib.sha256(json.dumps(decisive, sort_keys=True).encode()).hexdigest()


def builtin_tasks() -> list[str]:
    """Names of the tasks shipped with layerdiv."""
    root = resources.files("layerdiv.tasks")
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def load_task(name_or_path: str) -> TaskSpec:
    """A built-in task by name, or a user task from a YAML path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise TaskError(f"task file {path} does not exist")
        text, base = path.read_text(), path.resolve().parent
    elif name_or_path in builtin_tasks():
        text = (resources.files("layerdiv.tasks") / f"{name_or_path}.yaml").read_text()
        base = Path(".")
    else:
        raise TaskError(
            f"unknown task {name_or_path!r}: give a task YAML path or one of "
            f"{', '.join(builtin_tasks())}"
        )
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise TaskError(f"{name_or_path}: invalid YAML: {err}") from err
    return parse_task(raw, base, where=name_or_path)


DATA_ALIAS = "data_files"
"""Accepted in a task YAML for ``data`` (the word of the hub's ``datasets`` library)."""


def parse_task(raw: Any, base_dir: Path, where: str) -> TaskSpec:
    """Check a task mapping and build its :class:`TaskSpec`."""
    if not isinstance(raw, dict):
        raise TaskError(f"{where}: a task YAML must be a mapping")
    if DATA_ALIAS in raw:
        if "data" in raw:
            raise TaskError(f"{where}: give 'data' or its alias '{DATA_ALIAS}', not both")
        raw = {("data" if k == DATA_ALIAS else k): v for k, v in raw.items()}
    allowed = {f for f in TaskSpec.__dataclass_fields__ if f != "base_dir"}
    unknown = set(raw) - allowed
    if unknown:
        raise TaskError(f"{where}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    if ("dataset" in raw) == ("data" in raw):
        raise TaskError(f"{where}: give exactly one of 'dataset' (hub) or 'data' (local file)")
    parse = _PARSERS.get(str(raw.get("kind", DEFAULT_KIND)))
    if parse is None:
        raise TaskError(f"{where}: 'kind' must be {' or '.join(_PARSERS)}, got {raw['kind']!r}")
    return parse(raw, base_dir, where)


def _parse_choice_task(raw: dict[str, Any], base_dir: Path, where: str) -> TaskSpec:
    """Check a choice task mapping (the default kind) and build its :class:`TaskSpec`."""
    text_only = sorted((set(raw) - {"kind"}) & TASK_FIELDS)
    if text_only:
        raise TaskError(f"{where}: {text_only} belong to text tasks; add 'kind: text'")
    missing = [k for k in ("name", "template", "options", "label") if k not in raw]
    if missing:
        raise TaskError(f"{where}: missing keys {missing}")
    options = raw["options"]
    if not isinstance(options, list) or len(options) < 2 or len(set(options)) != len(options):
        raise TaskError(f"{where}: 'options' must list at least two distinct strings")
    if len(options) > MAX_OPTIONS:
        raise TaskError(
            f"{where}: {len(options)} options; a task may have at most {MAX_OPTIONS} (the "
            "store's option index is one signed byte)"
        )
    template = str(raw["template"])
    if not template.rstrip().endswith(ANSWER):
        raise TaskError(f"{where}: the template must end with {ANSWER!r}")
    name, n, hub = _common(raw, where)
    for key in ("template", "label", "filter"):
        if raw.get(key) is not None:
            _compile(str(raw[key]), f"{where}: the {key}")
    return TaskSpec(
        name=name,
        template=template,
        options=tuple(str(o) for o in options),
        label=str(raw["label"]),
        n=n,
        dataset=hub,
        data=raw.get("data"),
        filter=raw.get("filter"),
        description=str(raw.get("description", "")),
        base_dir=base_dir,
    )


def _common(raw: dict[str, Any], where: str) -> tuple[str, int, HubDataset | None]:
    """The name, ``n`` and hub dataset of a task mapping of either kind, checked."""
    if "name" not in raw:
        raise TaskError(f"{where}: missing keys ['name']")
    n = raw.get("n", 2000)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TaskError(f"{where}: 'n' must be a positive whole number, got {n!r}")
    dataset = raw.get("dataset")
    try:
        hub = HubDataset(**dataset) if dataset else None
    except TypeError as err:
        raise TaskError(f"{where}: 'dataset' needs path, split and optional name ({err})") from err
    from layerdiv.store.paths import check_task_name

    try:
        return check_task_name(str(raw["name"])), n, hub
    except ValueError as err:
        raise TaskError(f"{where}: {err}") from err


def _parse_text_task(raw: dict[str, Any], base_dir: Path, where: str) -> TaskSpec:
    """Check a ``kind: text`` task mapping and build its :class:`TaskSpec`."""
    if "text" not in raw:
        raise TaskError(
            f"{where}: a text task needs 'text', the Jinja template of one document "
            '(e.g. text: "{{ text }}")'
        )
    choice_only = sorted(set(raw) & {"template", "options", "label"})
    if choice_only:
        raise TaskError(f"{where}: {choice_only} belong to choice tasks; a text task has 'text'")
    name, n, hub = _common(raw, where)
    max_tokens = raw.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise TaskError(
            f"{where}: 'max_tokens' must be a positive whole number, got {max_tokens!r}"
        )
    for key in ("text", "filter", "answer", "group_field"):
        if raw.get(key) is not None:
            _compile(str(raw[key]), f"{where}: the {key}")
    group = raw.get("group_field")
    return TaskSpec(
        name=name,
        n=n,
        dataset=hub,
        data=raw.get("data"),
        filter=raw.get("filter"),
        description=str(raw.get("description", "")),
        kind="text",
        text=str(raw["text"]),
        max_tokens=max_tokens,
        group_field=None if group is None else str(group),
        answer=None if raw.get("answer") is None else str(raw["answer"]),
        base_dir=base_dir,
    )


_PARSERS = {"choice": _parse_choice_task, "text": _parse_text_task}
"""The check of a task mapping of each kind (``layerdiv.schemas.kinds.KINDS``)."""


@dataclass(frozen=True)
class Instance:
    """One prompt with its gold option, or one document of a text task (gold -1)."""

    prompt: str
    gold: int
    group: str | None = None
    """Text tasks: the value of the task's ``group_field`` as a string."""
    answer: str | None = None
    """Text tasks with an answer: the rendered answer (the end of ``prompt``)."""


def _environment() -> Any:
    from jinja2 import StrictUndefined
    from jinja2.sandbox import SandboxedEnvironment

    return SandboxedEnvironment(
        undefined=StrictUndefined, keep_trailing_newline=True, finalize=_finalize
    )


def _finalize(value: Any) -> Any:
    """Refuse a value that would enter a prompt or label as its Python form (``None``,
    ``b'...'``, ``['a', 'b']``, ``{'k': 'v'}``)."""
    if value is None:
        raise TaskError("a field used here is null")
    if isinstance(value, bytes):
        raise TaskError("a field used here is binary data, not text")
    if isinstance(value, list | tuple | dict):
        what = "an object" if isinstance(value, dict) else "a list"
        raise TaskError(
            f"a field used here is {what}, not text: pick its parts or join them in the template "
            '(e.g. {{ field | join(" ") }})'
        )
    return value


def _compile(source: str, what: str) -> Any:
    """A Jinja template; a syntax error is a :class:`TaskError` naming ``what`` and the line."""
    from jinja2 import TemplateSyntaxError

    try:
        return _environment().from_string(source)
    except TemplateSyntaxError as err:
        raise TaskError(f"{what} is not valid Jinja (line {err.lineno}: {err.message})") from err


def split_template(spec: TaskSpec) -> tuple[Any, str]:
    """The compiled template and the separator (spaces) between prompt and answer."""
    template = spec.template.rstrip()
    head = template[: -len(ANSWER)]
    prompt_part = head.rstrip(" ")
    return _compile(prompt_part, f"task {spec.name}: the template"), head[len(prompt_part) :]


def _rows(spec: TaskSpec) -> Any:
    if spec.dataset is not None:
        try:
            import datasets
        except ImportError as err:
            raise TaskError(
                f"task {spec.name} reads the hub dataset {spec.dataset.path}: install the 'hf' "
                "extra (pip install 'layerdiv[hf]')"
            ) from err
        try:
            # A text task reads its first n documents of corpora far larger than that: streamed.
            stream = {} if KINDS[spec.kind].scored else {"streaming": True}
            return datasets.load_dataset(
                spec.dataset.path, spec.dataset.name, split=spec.dataset.split, **stream
            )
        except Exception as err:  # hub and network errors come in many types
            raise TaskError(
                f"task {spec.name}: cannot load {spec.dataset.path} ({spec.dataset.name}, "
                f"{spec.dataset.split}): {err}. Without hub access, write a local task YAML with "
                "'data: file.jsonl'."
            ) from err
    path = spec.base_dir / str(spec.data)
    if path.suffix not in _READERS:
        raise TaskError(f"task {spec.name}: data file {path} must be one of {sorted(_READERS)}")
    if not path.is_file():
        raise TaskError(f"task {spec.name}: data file {path} does not exist")
    try:
        return _READERS[path.suffix](path)
    except (OSError, ValueError) as err:  # pyarrow's parse errors are ValueErrors
        raise TaskError(f"task {spec.name}: cannot read {path}: {err}") from err


def _text(path: Path) -> str:
    """A data file's text; a byte that is not UTF-8 is an error naming its line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw.count(b"\n", 0, err.start) + 1
        raise ValueError(
            f"line {line}: byte 0x{raw[err.start]:02x} is not UTF-8 text; save the file as UTF-8"
        ) from err


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """One object per line, each with only its own keys (a missing field stays missing)."""
    rows = []
    for number, line in enumerate(_text(path).split("\n"), 1):  # not splitlines: U+2028 is data
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"line {number} is not one complete JSON object ({err.msg})") from err
        if not isinstance(row, dict):
            raise ValueError(f"line {number} is not a JSON object")
        rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        rows = json.loads(_text(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"line {err.lineno}: not valid JSON ({err.msg})") from err
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("a .json data file must hold a list of objects")
    return rows


_READERS: dict[str, Callable[[Path], list[dict[str, Any]]]] = {
    ".jsonl": _read_jsonl,
    ".json": _read_json,
    ".csv": lambda p: pa_csv.read_csv(io.BytesIO(_text(p).encode())).to_pylist(),
    ".parquet": lambda p: pq.read_table(p).to_pylist(),
    ".txt": lambda p: [
        {"text": line.removesuffix("\r")} for line in _text(p).split("\n") if line.strip()
    ],
}
"""Local data readers by file suffix (pyarrow: extraction nodes need no dataframe library)."""


def instances(spec: TaskSpec, limit: int | None = None) -> list[Instance]:
    """The first ``limit`` (default ``spec.n``) instances of a task, in data order."""
    from jinja2 import UndefinedError

    n = spec.n if limit is None else limit
    text = spec.text is not None
    prompt_template = (
        _compile(str(spec.text), f"task {spec.name}: the text") if text else split_template(spec)[0]
    )
    label_template = None if text else _compile(spec.label, f"task {spec.name}: the label")
    answer_template = (
        _compile(spec.answer, f"task {spec.name}: the answer") if spec.answer else None
    )
    group_template = (
        _compile(spec.group_field, f"task {spec.name}: the group_field")
        if spec.group_field and "{{" in spec.group_field
        else None
    )
    keep = _compile(spec.filter, f"task {spec.name}: the filter") if spec.filter else None
    source = f" of {spec.base_dir / spec.data}" if spec.data else ""
    out: list[Instance] = []
    for i, row in enumerate(_rows(spec)):
        if len(out) >= n:
            break
        where = f"task {spec.name}, data row {i}{source}"
        try:
            if keep is not None and keep.render(**row).strip() == "False":
                continue
            prompt = prompt_template.render(**row)
            if label_template is None:
                if group_template is not None:
                    group = group_template.render(**row).strip()
                elif spec.group_field and spec.group_field not in row:
                    raise TaskError(
                        f"no field {spec.group_field!r} (the task's group_field); its "
                        f"fields: {', '.join(map(str, row))}"
                    )
                else:
                    group = spec.group_field and row[spec.group_field]
                answer = None if answer_template is None else answer_template.render(**row)
                document = prompt if answer is None else prompt + answer
                out.append(Instance(document, -1, None if group is None else str(group), answer))
                continue
            label = label_template.render(**row).strip()
        except (UndefinedError, KeyError) as err:
            raise TaskError(f"{where}: {err} (its fields: {', '.join(map(str, row))})") from err
        except Exception as err:  # jinja raises several types for a bad field or expression
            raise TaskError(f"{where}: {err}") from err
        out.append(Instance(prompt, _gold_index(spec, label, i)))
    if not out:
        raise TaskError(f"task {spec.name}: no instances (empty data, or the filter drops all)")
    return out


def _gold_index(spec: TaskSpec, label: str, row: int) -> int:
    if label in spec.options:
        return spec.options.index(label)
    if label.lstrip("-").isdigit() and 0 <= int(label) < len(spec.options):
        return int(label)
    raise TaskError(
        f"task {spec.name}, data row {row}: label {label!r} is neither an option "
        f"({', '.join(spec.options)}) nor an option index 0..{len(spec.options) - 1}"
    )


def option_token_ids(spec: TaskSpec, tokenizer: Any, prompt: str) -> list[int]:
    """The token scored for each option: the first token of ``separator + option`` as the
    tokenizer splits it right after ``prompt`` (one of the task's prompts). Two options sharing
    it is an error that names them."""
    _, sep = split_template(spec)
    base = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = []
    for option in spec.options:
        full = tokenizer(prompt + sep + option, add_special_tokens=False)["input_ids"]
        if full[: len(base)] != base or len(full) == len(base):
            raise TaskError(
                f"task {spec.name}: option {option!r} merges with the prompt's last token; "
                "change the template's text before {{ answer }}"
            )
        ids.append(full[len(base)])
    dupes = [
        (a, b)
        for i, a in enumerate(spec.options)
        for j, b in enumerate(spec.options)
        if i < j and ids[i] == ids[j]
    ]
    if dupes:
        pairs = "; ".join(f"{a!r} and {b!r}" for a, b in dupes)
        raise TaskError(
            f"task {spec.name}: options {pairs} start with the same token "
            f"{tokenizer.convert_ids_to_tokens(ids[spec.options.index(dupes[0][0])])!r}; "
            "reword them so their first tokens differ"
        )
    return ids


def data_sha256(items: list[Instance]) -> str:
    """sha256 over the prompts and gold labels of ``items``: the content of a task's data as
    extraction sees it (editing the data file changes it; moving the file does not)."""
    h = hashlib.sha256()
    for item in items:
        fields = [item.prompt, item.gold] + ([] if item.group is None else [item.group])
        fields += [] if item.answer is None else [item.answer]
        h.update(json.dumps(fields).encode())
        h.update(b"\n")
    return h.hexdigest()
