"""What the attribution maps share (integrated gradients of a text task, methods §13; residual
erasure of a text or choice task, methods §14): where each document's answer starts, the tokens on
a map's axis, and the per-document (instance) heatmap of a map.

Each document's answer start s (methods §10) is the one the extraction stored in ``documents``
(``answer_start``, :func:`answer_starts`).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.markdown import fmt, key_rows, verdict
from layerdiv.analyze.overlap import one_verdict
from layerdiv.analyze.registry import Analysis, Context, NoData, ReportContext, with_data
from layerdiv.analyze.stats import MIN_INTERVAL_N, bootstrap_mean, depth_score
from layerdiv.errors import LayerdivError
from layerdiv.schemas import SUBLAYERS
from layerdiv.schemas.kinds import CHOICE as CHOICE_KIND
from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY

MAP_DOCUMENTS = 2
"""The maps kept and drawn per partition by default: its first documents (by index), each site
of each."""
DOCUMENTS_OPTION = "attribution_documents"
"""The option (``analyze(..., options={"attribution_documents": N})``) that keeps and draws the
maps of each partition's first N documents instead (0: none)."""
OPTIONS = {
    DOCUMENTS_OPTION: f"the maps of how many documents per partition the integrated-gradients "
    f"and erasure sections keep and draw, the first by index (default {MAP_DOCUMENTS})"
}
"""The analysis options of both attribution analyses."""
CHOICE = CHOICE_KIND.name
"""The choice task kind's name (its attribution analyses are sections of their own)."""
SITE_ORDER = pl.col("sublayer").replace_strict(SUBLAYERS, range(len(SUBLAYERS)))
"""Sorts rows by site in :data:`~layerdiv.schemas.SUBLAYERS` order."""


def choice(info: PartitionInfo) -> bool:
    """Whether ``info`` is a choice partition (its units instances, keyed ``doc`` in the
    attribution tables; no answer's start; the prompt tokens in ``instances.pieces``)."""
    return info.kind.scored


def with_answer(parts: list[PartitionInfo]) -> list[PartitionInfo]:
    """The partitions of ``parts`` whose task names an answer (the document is text + answer):
    the only ones ``--igrad`` and ``--erase`` apply to, so the others get no note."""
    return [p for p in parts if p.manifest.task_spec.get("answer")]


def answer_starts(info: PartitionInfo) -> pl.DataFrame:
    """Per document (``doc``) of ``info`` its answer's start ``answer_start`` s, as the
    extraction stored it in ``documents`` (methods §10: s = T - A); none for a document without
    one."""
    return (
        info.scan("documents")
        .select("doc", "answer_start")
        .filter(pl.col("answer_start").is_not_null())
        .collect()
        .sort("doc")
    )


def profiles(rows: pl.DataFrame, row: str, value: str, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The documents (D,) of ``rows`` and their profiles v (D, ``width``): ``value`` at the
    block or state ``row`` of each (``doc``, ``row``) row, 0 where a document has none (a
    ``row`` outside 0..``width`` - 1 never gets here: the store's rules refuse its part)."""
    ids = np.unique(rows["doc"].to_numpy())
    at = rows[row].to_numpy()
    v = np.zeros((len(ids), width))
    v[np.searchsorted(ids, rows["doc"].to_numpy()), at] = rows[value]
    return ids, v


DEPTH_FLOATS = ("score", "ci_low", "ci_high", "relative", "relative_low", "relative_high")


def depth_row(v: np.ndarray, blocks: int, first: int) -> dict[str, Any]:
    """The depth-score columns of the profiles ``v`` (documents, rows): methods §10's
    sum_l l v(l) / sum_l v(l) per document, the mean over the documents whose score is defined
    with its bootstrap interval, and ``relative`` = (score + ``first``) / ``blocks`` (``first``:
    the relative depth of row 0 times L, 1 for block 0's output, 0 for the embeddings). NaN where
    undefined (:func:`depth_frame` makes it null)."""
    scores = depth_score(v)
    score, low, high = bootstrap_mean(scores[np.isfinite(scores)])
    return {
        "n_blocks": blocks,
        "n_documents": len(v),
        "n_scored": int(np.isfinite(scores).sum()),
        "score": score,
        "ci_low": low,
        "ci_high": high,
        "relative": (score + first) / blocks,
        "relative_low": (low + first) / blocks,
        "relative_high": (high + first) / blocks,
    }


def depth_frame(rows: list[dict[str, Any]]) -> pl.DataFrame:
    """:func:`depth_row` rows as a frame, NaN as null (Float64 however few documents)."""
    frame = pl.DataFrame(rows, schema_overrides=dict.fromkeys(DEPTH_FLOATS, pl.Float64))
    return frame.with_columns(pl.col(c).fill_nan(None) for c in DEPTH_FLOATS)


def depth_rows(table: pl.DataFrame, names: dict[str, str]) -> list[list[str]]:
    """Report rows of a depth-score table (``score``, ``relative`` and their intervals; the
    ``sublayer`` first where it has one)."""
    return key_rows(
        table,
        names,
        lambda r: [
            *([r["sublayer"]] if "sublayer" in r else []),
            str(r["n_scored"]),
            fmt(r["score"], digits=2),
            f"[{fmt(r['ci_low'], digits=2)}, {fmt(r['ci_high'], digits=2)}]",
            fmt(r["relative"], digits=3),
            f"[{fmt(r['relative_low'], digits=3)}, {fmt(r['relative_high'], digits=3)}]",
        ],
    )


FIRST_HALF = 0.5
"""The depth-efficiency paper's finding for its attribution and erasure maps (what a position
contributes to the answer comes mostly from the first half of the stack) holds where the
relative depth score's interval lies below this."""


def depth_verdicts(
    table: pl.DataFrame,
    manifests: pl.DataFrame,
    names: dict[str, str],
    finding: str,
    units: str,
    unreliable: Mapping[tuple[Any, ...], str] | None = None,
) -> str:
    """Per row of a depth-score table (:func:`depth_frame` rows with the key and, where it has
    one, the ``sublayer``), one per set of tasks with the same units
    (:func:`~layerdiv.analyze.overlap.one_verdict`): the verdict on the depth-efficiency paper's
    ``finding``, the relative depth score below :data:`FIRST_HALF`, its bootstrap interval over
    ``units`` (documents or instances; never blocks). A row whose (key..., sublayer) is in
    ``unreliable`` gets no verdict, only the reason given there."""
    judged, note = one_verdict(table, manifests)
    lines = []
    for r in judged.iter_rows(named=True):
        site = r.get("sublayer")
        who = f"{names.get(r['model'], r['model'])}, {r['task']}" + (f", {site}" if site else "")
        key = (*(r[k] for k in KEY), *([site] if site else []))
        reason = (unreliable or {}).get(key)
        if reason:
            lines.append(f"- **No verdict: unreliable.** {who}: {reason}.")
            continue
        interval = (r["relative_low"], r["relative_high"])
        lines.append("- " + verdict(
            f"{who}: {finding}", "relative depth score", r["relative"], interval, r["n_scored"],
            FIRST_HALF, min_n=MIN_INTERVAL_N, unit=units, above=False, digits=3))  # fmt: skip
    return "\n".join([*lines, *([note] if note else [])])


def partition_tables(
    ctx: Context, fn: Callable[[PartitionInfo, int], dict[str, pl.DataFrame]], what: str
) -> dict[str, pl.DataFrame]:
    """The tables ``fn`` gives each partition of ``ctx`` (with the number of documents whose maps
    to keep, :data:`DOCUMENTS_OPTION`), concatenated; a partition without rows left out with a
    note naming ``what``."""
    count = ctx.options.get(DOCUMENTS_OPTION, MAP_DOCUMENTS)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise LayerdivError(
            f"option {DOCUMENTS_OPTION}={count!r}: give a number of documents, 0 or more"
        )
    parts = with_data(lambda p: fn(p, count), ctx.parts, ctx.notes, what)
    if not parts:
        raise NoData("no partition has rows to compute from")
    return {name: pl.concat([p[name] for p in parts]) for name in parts[0]}


class Section(Protocol):
    """What an attribution analysis's section (one task kind's) names: the kind it reads, its
    title and the start of its tables' and figures' names."""

    @property
    def kind(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def prefix(self) -> str: ...


def section_analysis(
    section: Section,
    tables_of: Callable[[str, PartitionInfo, int], dict[str, pl.DataFrame]],
    report: Callable[..., str],
    methods: tuple[int, ...],
    needs: tuple[str, ...],
    among: Callable[[list[PartitionInfo]], list[PartitionInfo]] | None,
    order: int,
) -> Analysis:
    """The analysis of one attribution ``section``: ``tables_of(prefix, partition, count)`` of
    every partition it gets (:func:`partition_tables`), its report section ``report(ctx,
    section=section)``, the options :data:`OPTIONS`; ``methods``, ``needs``, ``among`` and
    ``order`` as :class:`~layerdiv.analyze.registry.Analysis` takes them."""

    def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
        return partition_tables(ctx, partial(tables_of, section.prefix), section.title)

    tables.__module__ = tables_of.__module__  # the registry names the measurement's module
    return Analysis(
        name=section.prefix,
        title=section.title,
        methods=methods,
        tables=tables,
        report=partial(report, section=section),
        kinds=(section.kind,),
        among=among,
        options=OPTIONS,
        needs=needs,
        order=order,
    )


def first_documents(info: PartitionInfo, table: str, count: int, value: str) -> list[int]:
    """The first ``count`` documents of ``info`` that hold rows of ``table`` whose ``value`` is
    known (not a document stored as missing)."""
    rows = info.scan(table).filter(pl.col(value).is_not_null())
    docs = rows.select("doc").unique().sort("doc").head(count).collect()
    return docs["doc"].to_list()


def document_tokens(info: PartitionInfo, docs: Sequence[int]) -> pl.DataFrame:
    """The ``doc``, ``pos``, ``token`` id and ``piece`` (the token as the vocabulary spells it;
    null in stores of schema version 6 and older) of every token of ``docs``; a choice
    partition's prompt tokens from ``instances.pieces`` (no ids; none before schema version
    10)."""
    if not choice(info):
        rows = info.scan("tokens").filter(pl.col("doc").is_in(list(docs)))
        return rows.select("doc", "pos", "token", "piece").sort("doc", "pos").collect()
    schema = pl.Schema({"doc": pl.Int32, "pos": pl.Int32, "token": pl.Int32, "piece": pl.String})
    prompts = (  # a store before version 10 reads its pieces as null: no rows
        info.scan("instances")
        .filter(pl.col("instance").is_in(list(docs)), pl.col("pieces").is_not_null())
        .select(pl.col("instance").alias("doc"), pl.col("pieces").alias("piece"))
        .collect()
    )
    return (
        prompts.with_columns(pos=pl.int_ranges(pl.col("piece").list.len()))
        .explode("piece", "pos")
        .select("doc", "pos", pl.lit(None).alias("token"), "piece")
        .cast(schema)
        .sort("doc", "pos")
    )


def labelled(info: PartitionInfo, rows: pl.DataFrame, docs: Sequence[int]) -> pl.DataFrame:
    """Per-position map ``rows`` of ``docs`` with each position's token (``token``, ``piece``:
    :func:`document_tokens`, where stored) and, running text, the document's ``answer_start``
    (:func:`answer_starts`)."""
    tokens = document_tokens(info, docs)
    if tokens.height:
        rows = rows.join(tokens, on=["doc", "pos"], how="left")
    if not choice(info):
        rows = rows.join(answer_starts(info), on="doc", how="left")
    return rows


def _byte_level_alphabet() -> dict[str, int]:
    """The character a byte-level BPE vocabulary (GPT-2's, SmolLM2's) spells each byte with:
    the printable Latin-1 bytes as themselves, every other byte as chr(256 + n), n counting
    those bytes in order."""
    own = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    rest = [b for b in range(256) if b not in own]
    return {**{chr(b): b for b in own}, **{chr(256 + n): b for n, b in enumerate(rest)}}


BYTE_LEVEL = _byte_level_alphabet()
"""Byte-level spelling character -> the byte it stands for."""
SHOWN = {" ": "␣", "▁": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
"""How a space (a SentencePiece word mark too) and line breaks are drawn on a map's axis."""


def token_text(piece: str) -> str:
    """A token as text to draw (methods §13, §14's maps): a byte-level spelling decoded to the
    text it stands for (``ðŁĺĢ`` -> the emoji; bytes that are no whole character as ``\\xNN``),
    spaces and line breaks as :data:`SHOWN`, and every other invisible character (control,
    format such as the bidi override U+202E, private, unassigned) as its ``\\uNNNN`` escape, so
    that a label never reorders, hides or breaks the axis it is on. The renderers escape what
    their own markup reads (:mod:`layerdiv.analyze.plots`)."""
    text = piece
    if piece and all(c in BYTE_LEVEL for c in piece):
        raw = bytes(BYTE_LEVEL[c] for c in piece)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character, or a vocabulary of other spelling
            if any(ord(c) > 0xFF for c in piece):
                text = raw.decode("utf-8", "backslashreplace")
    return "".join(
        SHOWN.get(c)
        or (f"\\u{ord(c):04x}" if unicodedata.category(c)[0] in "CZ" and c != " " else c)
        for c in text
    )


def token_labels(tokens: pl.DataFrame) -> list[str]:
    """The axis label of each token of one document: ``<position>:<token>`` as text
    (:func:`token_text` of its vocabulary spelling), ``<position>:<token id>`` where the store
    has no spelling (schema version 6 and older)."""
    return [
        f"{p}:{t if piece is None else token_text(piece)}"
        for p, t, piece in zip(tokens["pos"], tokens["token"], tokens["piece"], strict=True)
    ]


def map_figure(
    title: str,
    rows: pl.DataFrame,
    names: dict[str, str],
    row: str,
    value: str,
    colorbar: str,
    signed: bool,
    note: str = "",
    unit: str = "document",
) -> plots.Figure:
    """One :func:`map_panel` per drawn document (``unit``) of each partition (and per
    ``sublayer`` where ``rows`` has one, in the order of its first rows): ``value`` at each
    ``row`` (``block`` or ``layer``) and token, its colour bar titled ``colorbar``; the tokens
    by position alone and no answer's start where ``rows`` have no ``token`` or
    ``answer_start`` (a choice task's)."""
    site = ["sublayer"] if "sublayer" in rows.columns else []
    shown = int(rows.group_by(*KEY).agg(pl.col("doc").n_unique())["doc"].max())  # type: ignore[arg-type]
    panels = []
    for key, one in rows.group_by(*KEY, "doc", *site, maintain_order=True):
        lines = sorted(one[row].unique().to_list())
        tokens = one.filter(pl.col(row) == lines[0]).sort("pos")
        z = one.sort(row, "pos")[value].to_numpy().reshape(len(lines), -1)
        short = "doc" if unit == "document" else unit
        label = " · ".join([names.get(str(key[0]), str(key[0])), str(key[2]), f"{short} {key[3]}",
                            *map(str, key[4:])])  # fmt: skip
        ylabel = "block l" if row == "block" else "state l"
        spelled = "token" in one.columns
        labels = token_labels(tokens) if spelled else [str(p) for p in tokens["pos"]]
        start = one["answer_start"][0] if "answer_start" in one.columns else None
        panels.append(map_panel(label, z, labels, lines, ylabel, colorbar, start, signed,
                                "position:token" if spelled else "position"))  # fmt: skip
    answer = "; dotted: where the answer starts" if "answer_start" in rows.columns else ""
    return plots.Figure(
        title,
        panels,
        cols=1,
        panel_size=(10.0, 3.4),
        caption=f"the first {shown} {unit}(s) of each model and task; colour range from "
        f"positions 1..T-1 (position 0 drawn clipped){note}{answer}",
    )


def maps_link(ctx: ReportContext, table: str, title: str, **draw: Any) -> list[str]:
    """The link to the figure of the maps in ``ctx.tables[table]`` (:func:`map_figure` with
    ``draw``), drawn as ``<table>.png``; none where no map was kept."""
    rows = ctx.tables[table]
    if not rows.height:
        return []
    if "sublayer" in rows.columns:
        rows = rows.sort(*KEY, "doc", SITE_ORDER)
    names = plots.short_names(ctx.names)
    return [plots.figure_link(ctx, f"{table}.png", title,
                              lambda: map_figure(title, rows, names, **draw))]  # fmt: skip


def map_panel(
    title: str,
    z: np.ndarray,
    labels: list[str],
    rows: list[int],
    ylabel: str,
    colorbar: str,
    start: int | None,
    signed: bool,
    xlabel: str = "position:token",
) -> plots.Panel:
    """The row x token heatmap ``z`` (rows, T) of one document: ``signed``, diverging colours
    centred at 0 (symmetric range), else sequential from 0; the colour range set by the
    positions 1..T-1 (position 0, the attention sink, would take all of it and is drawn clipped);
    a dotted line before the answer's first token ``start``; the x axis titled ``xlabel``."""
    rest = np.abs(z[:, 1:]) if z.shape[1] > 1 else np.abs(z)
    top = float(rest.max()) if rest.size and rest.max() > 0 else 1.0
    heat = plots.Heatmap(
        z.tolist(),
        labels,
        rows,
        colorbar,
        cmap="RdBu_r" if signed else "viridis",
        zmin=-top if signed else 0.0,
        zmax=top,
        zmid=0.0 if signed else None,
        origin="lower",
    )
    lines = (
        []
        if start is None
        else [
            plots.RefLine(start - 0.5, axis="x", label="answer starts", dash="dot", color="black")
        ]
    )
    return plots.Panel(title, heatmap=heat, xlabel=xlabel, ylabel=ylabel, lines=lines)
