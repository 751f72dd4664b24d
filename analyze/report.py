"""The report: a header, one section per registered analysis (the paper's Table 1 and Figs. 3-6
first), and the provenance of the partitions; as Markdown with PNG figures in ``figures/``
(``report.md``) and/or as one self-contained interactive page with the per-instance explorer
(``report.html``, :mod:`layerdiv.analyze.html`).

Every number is taken from a :class:`~layerdiv.analyze.api.Results` (and, for the explorer, from
the store); nothing is typed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import polars as pl

from layerdiv.analyze import methods, plots
from layerdiv.analyze.api import Results, weights_notes
from layerdiv.analyze.markdown import DASH, markdown_table, model_label
from layerdiv.analyze.methods import PAGE as METHODS_PAGE
from layerdiv.analyze.methods import cite
from layerdiv.analyze.options import REPORT_FORMATS, Estimator
from layerdiv.analyze.output import result_dir
from layerdiv.analyze.overlap import subset_notes
from layerdiv.analyze.registry import Analysis, ReportContext, builtin, origin, registered
from layerdiv.errors import LayerdivError
from layerdiv.store import PartitionInfo, Store
from layerdiv.store.key import KEY
from layerdiv.version import __version__

REPORT_NAME = "report.md"
HTML_NAME = "report.html"
FIGURES = "figures"


NO_EXPLORER = (
    "report.html has no per-instance explorer: it reads the store, and no store was given "
    "(write_report(..., store=PATH))"
)
NO_CHOICE_EXPLORER = (
    "report.html has no per-instance explorer: it shows the instances of choice tasks, and the "
    "report holds none (running text has its own sections)"
)


class ReportFormatError(LayerdivError, ValueError):
    """An unknown report format was asked for."""


def report_formats(spec: str | Iterable[str]) -> tuple[str, ...]:
    """The formats of ``md``, ``html`` or ``md,html`` (in that order); refuses any other."""
    asked = [f.strip().lower() for f in (spec.split(",") if isinstance(spec, str) else spec)]
    unknown = [f for f in asked if f not in REPORT_FORMATS]
    if unknown or not asked:
        raise ReportFormatError(
            f"unknown report format {(unknown or [''])[0]!r}: use md, html or md,html"
        )
    return tuple(f for f in REPORT_FORMATS if f in asked)


def model_names(manifests: pl.DataFrame) -> dict[str, str]:
    """Store slug -> the model id as the user gave it at extraction; and each label
    ``<slug>@<revision>`` of :func:`~layerdiv.analyze.markdown.model_label` ->
    ``<id>@<revision>``."""
    pairs = manifests.select(
        "model", "model_id", label=model_label(), revision=pl.col("revision").fill_null("")
    ).unique()
    names = dict(pairs.select("model", "model_id").iter_rows())
    for _, model_id, label, revision in pairs.iter_rows():
        names.setdefault(label, f"{model_id}@{revision}")
    return names


def revisions_apart(tables: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """``tables`` with the ``model`` column of every table keyed by revision as
    :func:`~layerdiv.analyze.markdown.model_label` names it (``<slug>@<revision>`` for a revision
    other than the default): a section that groups, colours or labels by model then keeps the
    revisions of one model apart, in its tables and its figures, instead of pooling them."""
    return {
        name: frame.with_columns(model_label()) if {"model", "revision"} <= set(frame.columns)
        else frame
        for name, frame in tables.items()
    }  # fmt: skip


def provenance_table(manifests: pl.DataFrame) -> str:
    """Per partition: model id, task, instances done of requested, dtype, revision, date; and
    how a model's weights were made when not loaded as they are."""
    rows = [
        [
            r["model_id"],
            r["task"],
            f"{r['n_done']}/{r['n_requested']}",
            str(r["n_components"]),
            str(r["n_options"]),
            r["dtype"],
            r["revision"] or DASH,
            r["created_at"],
            ", ".join(r.get("subset_of") or []) or DASH,
        ]
        for r in manifests.sort(*KEY).iter_rows(named=True)
    ]
    header = [
        "Model",
        "Task",
        "Instances",
        "Components",
        "Options",
        "dtype",
        "Revision",
        "Extracted",
        "Subset of",
    ]
    made = "".join(f"\n\n{line}." for line in weights_notes(manifests))
    return markdown_table(header, rows) + made


def render(
    results: Results,
    estimator: Estimator,
    store: str,
    figures: Path,
    formats: Sequence[str] = ("md",),
) -> tuple[str, ReportContext]:
    """The report's Markdown, drawing figures into ``figures`` (PNG for ``md``, Plotly figures
    into ``ctx.interactive`` for ``html``); and the context, whose ``notes`` are the analyses'
    notes (what could not be computed or drawn, and how to get it)."""
    manifests = results.manifests
    deferred: list[tuple[Any, Path]] = []
    ctx = ReportContext(
        tables=results.by_name,
        estimator=estimator,
        names=model_names(manifests),
        figures=figures,
        notes=list(results.notes),
        scale=results.scale,
        min_params=results.min_params,
        formats=tuple(formats),
        options=results.settings,
        deferred=deferred,
    )
    apart = replace(ctx, tables=revisions_apart(ctx.tables))  # notes and figures shared
    sections: list[tuple[Analysis, str]] = []
    owners: list[int] = []  # each deferred figure's section
    for a in registered():
        if a.report is not None and a.name in results.analyses:
            sections.append((a, section(a, ctx if a.by_revision else apart)))
            owners += [len(sections) - 1] * (len(deferred) - len(owners))
    sections = _drawn(sections, owners, ctx)
    body = [  # a section that returns "" (nothing asked for) is left out
        f"## {a.title}\n\n{_methods_line(a.methods)}{_coverage(results.coverage.get(a.name))}{text}"
        for a, text in sections
        if text
    ]
    n_models, n_tasks = manifests["model"].n_unique(), manifests["task"].n_unique()
    notes = "".join(
        f"\n\n{line}." for line in [*results.remarks, *subset_notes(manifests, ctx.names)]
    )
    notes += "".join(f"\n\n> {note}" for note in [*results.problems, *ctx.notes])
    choice = "paper" in results.analyses  # estimator and scale apply to the choice analyses only
    how = (
        f"Estimator **`{estimator}`** ({cite(2)}), junction scale **`{results.scale}`** "
        f"({cite(3)}). "
        if choice
        else ""
    )
    header = (
        f"# layerdiv report\n\nStore `{store}`: {n_models} model(s) x {n_tasks} task(s). {how}"
        f"Every formula is defined in [the methods page]({METHODS_PAGE}). Generated by layerdiv "
        f"{__version__} on {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.{notes}"
    )
    parts = [header, *body, "## Provenance\n\n" + provenance_table(manifests)]
    return "\n\n".join(parts) + "\n", ctx


def section(analysis: Analysis, ctx: ReportContext) -> str:
    """``analysis``'s report section; "" with a note naming it where one of another
    distribution raises or returns no text (the other sections are written)."""
    assert analysis.report is not None
    try:
        text = analysis.report(ctx)
    except Exception as err:
        if builtin(analysis):
            raise
        ctx.notes.append(f"{origin(analysis)}: its report section left out: "
                         f"{type(err).__name__}: {err}")  # fmt: skip
        return ""
    if isinstance(text, str) or builtin(analysis):
        return text
    ctx.notes.append(f"{origin(analysis)}: its report section left out: it returned a "
                     f"{type(text).__name__}, not Markdown text")  # fmt: skip
    return ""


def _drawn(
    sections: list[tuple[Analysis, str]], owners: list[int], ctx: ReportContext
) -> list[tuple[Analysis, str]]:
    """``sections`` once ``ctx.deferred``'s figures are drawn (at once: ``plots.draw_all``),
    a section of another distribution whose figure failed left out with a note; a built-in
    one's failure raised (drawn again here, for its traceback)."""
    assert ctx.deferred is not None
    failed: dict[int, str] = {}
    for (spec, path), owner, error in zip(
        ctx.deferred, owners, plots.draw_all(ctx.deferred), strict=True
    ):
        analysis = sections[owner][0]
        if error is not None and builtin(analysis):
            plots.to_matplotlib(spec, path)
        elif error is not None:
            failed.setdefault(owner, f"{origin(analysis)}: its report section left out: {error}")
    ctx.notes.extend(failed.values())
    return [(a, "" if i in failed else text) for i, (a, text) in enumerate(sections)]


def _coverage(lines: Sequence[str] | None) -> str:
    """The lines that open a section computed on some of its partitions only: which lack a
    table it needs, and the option that adds it."""
    return "".join(f"{line}\n\n" for line in lines or ())


def _methods_line(sections: Sequence[int | str]) -> str:
    """The line under a section's heading that links the methods it uses."""
    return f"Methods: {cite(*sections)}.\n\n" if sections else ""


def explorer_parts(results: Results, store: str | Path) -> list[PartitionInfo]:
    """The partitions of a scored kind (choice) of ``store`` that ``results`` analysed (the
    explorer shows instances; running text has its own sections)."""
    pairs = set(results.manifests.select(*KEY).iter_rows())
    return [
        p
        for p in Store(store).partitions
        if p.key.values() in pairs and p.n_done > 0 and p.kind.scored
    ]


def write_report(
    results: Results,
    out: str | Path,
    estimator: Estimator = "paper",
    store: str = "",
    formats: str | Iterable[str] = ("md",),
    explorer_instances: int | None = 200,
) -> tuple[Path, list[str]]:
    """Write the report into ``out``, all at once (nothing is left behind on failure): for
    ``md``, ``report.md``, the methods page it links (``methods.md``) and, when matplotlib is
    installed, ``figures/*.png``; for ``html``, ``report.html`` and ``methods.html``, with the
    explorer (``explorer_instances`` per (model, task), None: all) over the partitions of
    ``store``. Returns the path of the first report and the notes to show."""
    chosen = report_formats(formats)
    if "html" in chosen:
        from layerdiv.analyze.html import check_available

        check_available()
    names = {"md": REPORT_NAME, "html": HTML_NAME}
    index = {
        "report": [names[f] for f in chosen],
        "estimator": estimator,
        "scale": results.scale,
        "store": store,
    }
    with result_dir(out, index) as tmp:
        text, ctx = render(results, estimator, store, tmp / FIGURES, chosen)
        if "md" in chosen:
            (tmp / REPORT_NAME).write_text(text)
            (tmp / METHODS_PAGE).write_text(methods.source())
        if "html" in chosen:
            from layerdiv.analyze.html import render_methods, render_page
            from layerdiv.analyze.html.explorer import explorer_data

            parts = explorer_parts(results, store) if store else []
            data = explorer_data(parts, explorer_instances) if parts else None
            if data is None:
                ctx.notes.append(NO_CHOICE_EXPLORER if store else NO_EXPLORER)
            page = render_page(text, ctx.interactive, data)
            (tmp / HTML_NAME).write_text(page)
            (tmp / methods.HTML_PAGE).write_text(render_methods())
    return Path(out) / names[chosen[0]], ctx.notes
