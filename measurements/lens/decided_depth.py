"""Running text, decided-at depth (methods §16): the block from which the final logit lens
(``extract --lens``), or a learned lens (``--lens-ls``, ``--lens-tuned``, methods §17), already
ranks the model's own prediction first, and stays so.

Per token p < T-1, y_p the model's own top-1 next token (``top1`` at layer L) and rank_l(p) its
``final_rank`` under p_l: decided(p) = the smallest block l in 0..L-1 with rank_k(p) = 1 for every
k in l..L-1, and L when rank_(L-1)(p) > 1; relative (decided + 1) / L.

Tables:

- ``decided_depth``: per (model, revision, task, ``lens``, ``group``), ``lens`` the lens read
  (``logit``, ``ls``, ``tuned``; :func:`~layerdiv.measurements.lens.stored_lenses`):
  ``n_tokens``, ``n_documents``,
  ``mean`` relative decided depth over the group's tokens (token-weighted), ``ci_low``/
  ``ci_high`` (bootstrap 95% percentile interval over documents, 1,000 seeded resamples, the
  mean recomputed from the resampled documents' tokens; none from fewer than
  :data:`~layerdiv.analyze.stats.MIN_INTERVAL_N` documents). Groups: ``all``; ``correct`` /
  ``incorrect`` (y_p is / is not the actual next token); ``q1``..``q4``, the frequency quartile
  of y_p: the predictions ordered by y_p's count in a stated corpus (ties by token id) and cut
  into four of equal size (q1 the rarest). The corpus (:func:`corpus_counts`): every token of
  every text partition of the model in the store (its tokenizer's), not the task's own tokens
  alone; ``decided_lens`` gives its size (``corpus_tokens``) and tasks (``corpus_tasks``).
- ``decided_depth_hist``: per (model, revision, task, ``lens``, ``decided`` = 0..L): ``n_tokens``,
  ``share`` and ``relative`` (decided + 1) / L, the distribution.
- ``decided_lens``: per (model, revision, task, ``lens``): the lens-quality gate and the
  frequency finding, each under that lens (the gate shows where the logit lens fails to read the
  stream and a learned lens may not).
  ``lens_failed``: the blocks l = 0..L-1 whose mean lens cross-entropy (over the tokens with a next
  token) exceeds log V (``uniform_ce``), the uniform distribution's: there the lens reads the
  stream worse than knowing nothing, so a token not ranked first there may be the lens's failure,
  not the model's; ``worst_ce`` the largest mean; ``lens_limited``: the share of tokens whose
  decided depth d > 0 follows such a block (d - 1 failed): for them the lens, not the model,
  sets the depth. ``q1_minus_q4``: the mean relative decided depth of the rarest quartile minus
  the most frequent's, with its bootstrap interval over documents (``ci_low``, ``ci_high``, the
  same resamples for both), ``n_documents``; ``corpus_tokens`` and ``corpus_tasks``, the corpus
  the quartiles count in.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import tag
from layerdiv.analyze.markdown import fmt, key_rows, markdown_table, verdict
from layerdiv.analyze.overlap import one_verdict
from layerdiv.analyze.registry import (
    Analysis,
    Context,
    NoData,
    ReportContext,
    map_partitions,
)
from layerdiv.analyze.stats import (
    LEVEL,
    MIN_INTERVAL_N,
    RESAMPLES,
    percentile_interval,
    resample_weights,
)
from layerdiv.analyze.text import BATCH_TOKENS, TEXT_KIND, batches
from layerdiv.measurements import tables_of
from layerdiv.measurements.lens import readout_of, stored_lenses
from layerdiv.store import PartitionInfo, StoreError
from layerdiv.store.key import KEY, SERIES

GROUPS = ("all", "correct", "incorrect", "q1", "q2", "q3", "q4")
"""The token groups of ``decided_depth``, in table and figure order."""

SCHEMA = {
    **dict.fromkeys(KEY, pl.String),
    "lens": pl.String,
    "group": pl.String,
    "n_tokens": pl.Int64,
    "n_documents": pl.Int64,
    "mean": pl.Float64,
    "ci_low": pl.Float64,
    "ci_high": pl.Float64,
}
"""The columns of ``decided_depth``."""


def decided(rank: np.ndarray) -> np.ndarray:
    """decided(p) of ranks (tokens, L) at the block inputs l = 0..L-1 (methods §16): the
    smallest l from which every rank is 1, L where the last one is not."""
    blocks = rank.shape[1]
    off = rank != 1
    last_off = np.where(off.any(axis=1), blocks - 1 - off[:, ::-1].argmax(axis=1), -1)
    return last_off + 1


def predictions(info: PartitionInfo, table: str = "token_lens") -> pl.DataFrame:
    """Per token p < T-1 of ``info`` (a text partition with the final lens's ``final_rank``):
    ``doc``, ``pos``, ``decided`` (methods §16) and ``top1`` y_p, read from its lens ``table``
    in batches of whole tokens."""
    blocks = info.manifest.n_blocks
    layers = blocks + 1
    frames = []
    columns = ["doc", "pos", "layer", "final_rank", "top1", "ce"]
    for frame in batches(info, table, columns, BATCH_TOKENS * layers):
        layer = frame["layer"].to_numpy().reshape(-1, layers)
        if (layer != np.arange(layers)).any():
            raise StoreError(
                f"{info.where}: {table} rows are not sorted by (doc, pos, layer) with every "
                "layer of every token; re-extract it with --overwrite"
            )
        rank = frame["final_rank"].to_numpy().reshape(-1, layers)[:, :blocks]
        last = frame[layers - 1 :: layers]  # layer L: the model's own output
        frames.append(
            last.select("doc", "pos", "top1", has_next=pl.col("ce").is_not_null()).with_columns(
                decided=pl.Series(decided(rank), dtype=pl.Int32)
            )
        )
    return pl.concat(frames).filter("has_next").drop("has_next")


Corpus = tuple[pl.DataFrame, int, str]
"""Token counts (``token``, ``count``), the tokens counted and the tasks they come from."""


def corpus_counts(parts: list[PartitionInfo], models: set[str]) -> dict[str, Corpus]:
    """Per model of ``models``: how often each token occurs among every token of every text
    partition of it in ``parts`` (one tokenizer: its revisions and tasks together), the frequency
    count the quartiles rest on (a larger corpus than one task's own tokens), its size and its
    tasks."""
    out = {}
    for model in sorted(models):
        mine = [p for p in parts if p.model == model and p.manifest.kind == TEXT_KIND]
        tokens = pl.concat([p.scan("tokens").select("token").collect() for p in mine])
        counts = tokens.group_by("token").agg(pl.len().alias("count"))
        tasks = ", ".join(sorted({p.task for p in mine}))
        out[model] = (counts, tokens.height, tasks)
    return out


def token_groups(
    info: PartitionInfo, table: str = "token_lens", counts: pl.DataFrame | None = None
) -> pl.DataFrame:
    """:func:`predictions` of the lens ``table`` with ``relative`` (decided + 1) / L, ``correct``
    (y_p is the token at p + 1) and ``quartile`` 1..4 of y_p's count in ``counts`` (token, count;
    the partition's own tokens without it)."""
    blocks = info.manifest.n_blocks
    tokens = info.scan("tokens").select("doc", "pos", "token").collect()
    if counts is None:
        counts = tokens.group_by("token").agg(pl.len().alias("count"))
    following = tokens.select(
        "doc", (pl.col("pos") - 1).alias("pos"), pl.col("token").alias("next")
    )
    out = (
        predictions(info, table)
        .join(following, on=["doc", "pos"], how="left")
        .join(counts, left_on="top1", right_on="token", how="left")
        .with_columns(
            relative=(pl.col("decided") + 1) / blocks,
            correct=pl.col("top1") == pl.col("next"),
            count=pl.col("count").fill_null(0),
        )
    )
    # quartiles of equal size: predictions ordered by the count of their token (then by the token,
    # so that a token's predictions stay together but at a quartile's edge)
    order = pl.struct("count", "top1").rank("ordinal") - 1
    return out.with_columns(quartile=(1 + 4 * order // pl.len()).cast(pl.Int8))


FILTERS = {
    "all": pl.lit(True),
    "correct": pl.col("correct"),
    "incorrect": ~pl.col("correct"),
    **{f"q{q}": pl.col("quartile") == q for q in range(1, 5)},
}
"""Each group of :data:`GROUPS` as a filter of :func:`token_groups`' rows."""


def partition_decided(
    info: PartitionInfo, corpus: Corpus
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """``decided_depth``, ``decided_depth_hist`` and ``decided_lens`` of one text partition, under
    each lens it holds (:func:`~layerdiv.measurements.lens.stored_lenses`), the frequency
    quartiles counted in ``corpus`` (:func:`corpus_counts`)."""
    found = [lens_decided(info, lens, source, corpus) for lens, source in stored_lenses(info)]
    table, hist, gate = (pl.concat(frames) for frames in zip(*found, strict=True))
    return table, hist, gate


def lens_decided(
    info: PartitionInfo, lens: str, source: str, corpus: Corpus
) -> tuple[pl.DataFrame, pl.DataFrame, pl.DataFrame]:
    """``decided_depth``, ``decided_depth_hist`` and ``decided_lens`` of one text partition under
    one lens, read from its table ``source``."""
    blocks = info.manifest.n_blocks
    frequencies, corpus_tokens, corpus_tasks = corpus
    tokens = token_groups(info, source, frequencies)
    if not tokens.height:
        raise NoData(f"{info.where} has no token with a next token")
    docs = np.unique(tokens["doc"].to_numpy())
    index = np.searchsorted(docs, tokens["doc"].to_numpy())
    weights = resample_weights(len(docs))
    rows, samples = [], {}
    for group, mask in FILTERS.items():
        keep = tokens.with_columns(keep=mask)["keep"].fill_null(False).to_numpy()
        # per document: the sum of the group's relative decided depths and their count, so that
        # a resample's mean is token-weighted: W @ sums / W @ counts
        sums = np.bincount(index[keep], tokens["relative"].to_numpy()[keep], minlength=len(docs))
        counts = np.bincount(index[keep], minlength=len(docs)).astype(float)
        with np.errstate(invalid="ignore", divide="ignore"):
            means = (weights @ sums) / (weights @ counts)
        samples[group] = means
        n_docs = int((counts > 0).sum())
        low, high = percentile_interval(means if n_docs >= MIN_INTERVAL_N else np.full(1, np.nan))
        n = int(counts.sum())
        rows.append(
            {
                "group": group,
                "n_tokens": n,
                "n_documents": n_docs,
                "mean": float(sums.sum() / n) if n else None,
                "ci_low": None if np.isnan(low) else float(low),
                "ci_high": None if np.isnan(high) else float(high),
            }
        )
    table = pl.DataFrame(
        [{"lens": lens, **r} for r in rows],
        schema={k: v for k, v in SCHEMA.items() if k not in KEY},
    )
    means = dict(zip(table["group"], table["mean"], strict=True))
    diff = None if means["q1"] is None or means["q4"] is None else means["q1"] - means["q4"]
    enough = len(docs) >= MIN_INTERVAL_N and diff is not None
    low, high = percentile_interval(samples["q1"] - samples["q4"] if enough else np.full(1, np.nan))
    gate = {
        "lens": lens,
        "n_blocks": blocks,
        **lens_gate(info, source, tokens),
        "q1_minus_q4": diff,
        "ci_low": None if np.isnan(low) else float(low),
        "ci_high": None if np.isnan(high) else float(high),
        "n_documents": len(docs),
        "corpus_tokens": corpus_tokens,
        "corpus_tasks": corpus_tasks,
    }
    hist = (
        pl.DataFrame({"decided": np.arange(blocks + 1, dtype=np.int32)})
        .join(tokens.group_by("decided").agg(n_tokens=pl.len()), on="decided", how="left")
        .with_columns(pl.col("n_tokens").fill_null(0).cast(pl.Int64))
        .with_columns(
            share=pl.col("n_tokens") / tokens.height, relative=(pl.col("decided") + 1) / blocks
        )
        .select(pl.lit(lens).alias("lens"), pl.all())
    )
    return tag(table, info), tag(hist, info), tag(pl.DataFrame([gate], schema=LENS_SCHEMA), info)


LENS_SCHEMA = {
    "lens": pl.String,
    "n_blocks": pl.Int64,
    "lens_failed": pl.Int64,
    "worst_ce": pl.Float64,
    "uniform_ce": pl.Float64,
    "lens_limited": pl.Float64,
    "q1_minus_q4": pl.Float64,
    "ci_low": pl.Float64,
    "ci_high": pl.Float64,
    "n_documents": pl.Int64,
    "corpus_tokens": pl.Int64,
    "corpus_tasks": pl.String,
}
"""The columns of ``decided_lens`` after the key."""


def lens_ce(info: PartitionInfo, table: str = "token_lens") -> np.ndarray:
    """The mean cross-entropy of the lens ``table`` at each block input l = 0..L-1 over the
    tokens that have a next token (``ce`` is null at the last position)."""
    blocks = info.manifest.n_blocks
    means = (
        info.scan(table)
        .filter(pl.col("layer") < blocks)
        .group_by("layer")
        .agg(pl.col("ce").mean())
        .collect()
    )
    out = np.full(blocks, np.nan)
    out[means["layer"].to_numpy()] = means["ce"].cast(pl.Float64).fill_null(np.nan).to_numpy()
    return out


def lens_gate(
    info: PartitionInfo, table: str, tokens: pl.DataFrame
) -> dict[str, float | int | None]:
    """The lens-quality columns of ``decided_lens`` of one partition under the lens ``table``
    from its :func:`token_groups` rows (see the module docstring)."""
    ce = lens_ce(info, table)
    vocab = info.manifest.vocab_size
    uniform = float(np.log(vocab)) if vocab else None
    failed = ce > uniform if uniform is not None else np.zeros(len(ce), dtype=bool)
    d = tokens["decided"].to_numpy()
    limited = (d > 0) & failed[np.clip(d - 1, 0, len(ce) - 1)]
    return {
        "lens_failed": int(failed.sum()),
        "worst_ce": float(np.nanmax(ce)) if np.isfinite(ce).any() else None,
        "uniform_ce": uniform,
        "lens_limited": float(limited.mean()) if len(d) else None,
    }


def has_ranks(info: PartitionInfo) -> bool:
    """Whether ``info``'s lens stores ``final_rank`` (schema version 6 on)."""
    return "final_rank" in tables_of(info.manifest.schema_version)["token_lens"].names


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: the three tables of the text partitions holding the final
    lens with its ranks, under each lens they hold; notes name the others."""
    lensed = ctx.parts
    old = [p.key.label for p in lensed if not has_ranks(p)]
    if old:
        ctx.notes.append(
            f"No decided-at depth for {', '.join(old)}: their lens was stored before it kept "
            "final_rank (schema version 6); re-extract them with `--lens --overwrite`."
        )
    other = [p.key.label for p in lensed if has_ranks(p) and readout_of(p.manifest) != "final"]
    if other:
        ctx.notes.append(
            f"No decided-at depth for {', '.join(other)}: they hold the last-block lens; "
            "methods §16 reads the final one (`layerdiv extract --lens`)."
        )
    parts = [p for p in lensed if has_ranks(p) and readout_of(p.manifest) == "final"]
    if not parts:
        raise NoData("no text partition holds the final lens with final_rank")
    corpus = corpus_counts(ctx.store.select(), {p.model for p in parts})
    found = list(map_partitions(lambda p: partition_decided(p, corpus[p.model]), parts))
    return {
        "decided_depth": pl.concat([t for t, _, _ in found]),
        "decided_depth_hist": pl.concat([h for _, h, _ in found]),
        "decided_lens": pl.concat([g for _, _, g in found]),
    }


# --- report ------------------------------------------------------------------------------------


def decided_figure(table: pl.DataFrame, hist: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """Two panels: the share of tokens decided at each relative depth (a line per model and
    task), and the mean relative decided depth per token group with its bootstrap interval."""
    # the key with the most groups first: the group axis takes its categories in order of
    # appearance, and a key may lack a group (no correct prediction)
    series = [*SERIES, "lens"]
    counts = table.filter(pl.col("mean").is_not_null()).group_by(*series).len()
    ranked = counts.sort("len", *series, descending=[True, False, False, False])
    keys = [(m, t, lens) for m, t, lens, _ in ranked.iter_rows()]
    color = dict(zip(keys, plots.colors(len(keys)), strict=False))
    lenses = table["lens"].n_unique() > 1
    share = plots.Panel(
        "Where the prediction is decided",
        xlabel="relative decided depth (decided + 1) / L",
        ylabel="share of tokens",
    )
    means = plots.Panel(
        f"Mean by token group, {LEVEL:g}% CI",
        xlabel="tokens",
        ylabel="mean (decided + 1) / L",
        yrange=(0, 1.1),
    )
    for model, task, lens in keys:
        name = f"{names.get(model, model)} · {task}" + (f" · {lens} lens" if lenses else "")
        key = (pl.col("model") == model, pl.col("task") == task, pl.col("lens") == lens)
        sub = hist.filter(*key).sort("decided")
        share.series.append(
            plots.Series(
                name,
                sub["relative"].to_list(),
                sub["share"].to_list(),
                color=color[(model, task, lens)],
            )
        )
        rows = table.filter(*key)
        rows = rows.filter(pl.col("mean").is_not_null())
        rows = rows.sort(pl.col("group").replace_strict(GROUPS, range(len(GROUPS))))
        means.series.append(
            plots.Series(
                name,
                rows["group"].to_list(),
                rows["mean"].to_list(),
                color=color[(model, task, lens)],
                line=False,
                interval=plots.interval_ends(rows),
            )
        )
    share.lines.append(plots.RefLine(1.0, axis="x", label="last block", dash="dot", color="gray"))
    return plots.Figure(
        "Decided-at depth of the model's own prediction (methods §16)",
        [share, means],
        caption="q1..q4: frequency quartile of the predicted token among every token of the "
        "model's text tasks in the store (q1 the rarest); beyond 1: decided only at the output",
    )


def corpus_line(lens: pl.DataFrame) -> str:
    """The corpora the frequency quartiles count in, per model: its tokens and tasks."""
    rows = lens.select("model", "corpus_tokens", "corpus_tasks").unique().sort("model")
    return "; ".join(
        f"{r['model']}: {r['corpus_tokens']:,} tokens of {r['corpus_tasks']}"
        for r in rows.iter_rows(named=True)
    )


LENS_DECIDES = 0.5
"""The share of tokens whose decided depth the lens sets (``lens_limited``) above which the
frequency verdict is not given: the depths say more about the lens than about the model."""


def decided_verdicts(lens: pl.DataFrame, manifests: pl.DataFrame, names: dict[str, str]) -> str:
    """Per (model, revision, task) and lens, one per set of tasks with the same documents: the
    verdict on Gupta et al.'s finding that frequent predictions are decided earlier (the rarest
    quartile's mean relative decided depth minus the most frequent's above 0, its interval over
    documents), with the lens-quality gate's caveat where the lens's cross-entropy exceeds log V
    at some block, and no verdict where it sets the depth of more than :data:`LENS_DECIDES` of
    the tokens."""
    judged, note = one_verdict(lens, manifests, by=("lens",))
    lines = []
    for r in judged.iter_rows(named=True):
        who = f"{names.get(r['model'], r['model'])}, {r['task']}, {r['lens']} lens"
        caveat = ""
        if r["lens_failed"]:
            caveat = (
                f"the lens's cross-entropy exceeds log V = {r['uniform_ce']:.1f} nats at "
                f"{r['lens_failed']} of {r['n_blocks']} blocks (up to {r['worst_ce']:.1f}); "
                f"for {r['lens_limited']:.0%} of the tokens the block before their decided depth "
                "is one of them, so there the lens, not the model, decides"
            )
        if (r["lens_limited"] or 0) > LENS_DECIDES:
            lines.append(f"- **No verdict: the lens decides.** {who}: {caveat}.")
            continue
        line = verdict(
            f"{who}: frequent predictions are decided earlier",
            "mean (decided + 1) / L, q1 (rarest) − q4 (most frequent)", r["q1_minus_q4"],
            (r["ci_low"], r["ci_high"]), r["n_documents"], 0.0, min_n=MIN_INTERVAL_N,
            unit="documents", digits=3)  # fmt: skip
        lines.append(f"- {line}" + (f" Caveat: {caveat}." if caveat else ""))
    return "\n".join([*lines, *([note] if note else [])])


def report(ctx: ReportContext) -> str:
    """The decided-at depth section: the means per token group with their intervals, and the
    figure."""
    table = ctx.tables.get("decided_depth")
    if table is None or not table.height:
        return ""
    hist = ctx.tables["decided_depth_hist"]
    order = pl.col("group").replace_strict(GROUPS, range(len(GROUPS)))
    rows = key_rows(
        table.sort(*KEY, "lens", order),
        ctx.names,
        lambda r: [
            r["lens"],
            r["group"],
            str(r["n_tokens"]),
            fmt(r["mean"], digits=3),
            f"[{fmt(r['ci_low'], digits=3)}, {fmt(r['ci_high'], digits=3)}]",
        ],
    )
    header = [
        "Model",
        "Task",
        "Lens",
        "Group",
        "Tokens",
        "Mean (decided + 1) / L",
        f"{LEVEL:g}% CI",
    ]
    return "\n\n".join(
        [
            "For every token with a next token, the block from which the lens (the final logit "
            "lens, and each learned lens stored: methods §17) already "
            "ranks the model's own prediction first and keeps it there (L: only at the output). "
            "Means over tokens of the relative depth (decided + 1) / L, for all tokens, split by "
            "whether the prediction is the actual next token, and by the frequency quartile of "
            "the predicted token, counted in a stated corpus: every token of every text task of "
            f"the model in the store ({corpus_line(ctx.tables['decided_lens'])}), not the "
            "task's own tokens alone; intervals: bootstrap over documents "
            f"({RESAMPLES} resamples). The lens-quality gate, per lens: where the lens's mean "
            "cross-entropy at a block exceeds log V (the uniform distribution's), it reads the "
            "stream worse than knowing nothing, and a token whose decided depth follows such a "
            "block may be decided earlier by the model than the lens can show: for it the lens, "
            "not the model, decides (where the logit lens fails, a learned lens may not). The "
            "verdict, per lens, tests Gupta et al.'s finding that frequent "
            "predictions are decided earlier (q1 − q4 above 0, the same resamples of the "
            f"documents for both); none where the lens sets the depth of over {LENS_DECIDES:.0%} "
            "of the tokens.",
            markdown_table(header, rows),
            decided_verdicts(ctx.tables["decided_lens"], ctx.tables["manifests"], ctx.names),
            plots.figure_link(
                ctx,
                "decided_depth.png",
                "Decided-at depth",
                lambda: decided_figure(table, hist, plots.short_names(ctx.names)),
            ),
        ]
    )


ANALYSIS = Analysis(
    name="decided_depth",
    title="Running text: decided-at depth",
    methods=(16,),
    tables=tables,
    report=report,
    kinds=(TEXT_KIND,),
    needs=("token_lens",),
    order=140,
)
