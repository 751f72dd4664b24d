"""Running-text extraction cost on the CPU: ``ModelRunner.run`` for a text task against a plain
forward pass over the same documents and batches (SmolLM2-135M-Instruct, fp32, BBC News).

    python benchmarks/bench_text_extract.py [--docs 4] [--max-tokens 256] [--batch-size 4]
                                             [--repeats 3] [--rows text,lens,...] [--threads 1]
                                             [--quick]

``--docs`` packaged BBC News articles (title and first paragraphs, evenly spread over the corpus)
are tokenized as a text task does (``tokenize_documents``, cut to ``--max-tokens``) and grouped
into the length-sorted batches of ``ModelRunner.run_chunk`` (``--batch-size`` documents each).
Rows (:func:`rows`: a list of (name, run, flops) entries; ``run`` takes the batches):

- ``plain``: ``model(**inputs)`` on the left-padded inputs ``ModelRunner`` builds, with its
  ``use_cache=False`` and ``logits_to_keep=1``;
- ``text``: ``ModelRunner.run`` of a text task without options (hooks, per-token dot products,
  the model's own loss at every token, moved to the CPU);
- ``lens``: the same with ``--lens`` (final norm + unembedding over the full vocabulary at every
  block input and the model's output: KL, top-5 overlap, cross-entropy);
- ``lens last-block``: ``--lens last-block`` (the last block applied to each block input first);
- ``skips`` (only when ``--rows`` names it: it costs tens of forwards): ``--skips``, the future
  effects with the default random split points (documents numbered in batch order);
  ``skips answer`` with ``--skip-split answer:4:4`` and ``skips local`` with ``--skip-mode local``
  as well (each article's second half taken as its answer; also only when named).

FLOPs (:func:`flop_counts`), from the model's config, over every padded token the passes compute:
the forward is 2 x (q, k, v, o and gated-MLP weights) per token and block, plus the attention
scores and values (4 x heads x head size per token and earlier position in its row, causal), plus
the unembedding at one position per row; a text task adds one readout of every token (2 x d x V
per token: the model's own loss, ``tokens.loss``), the lens L + 1 readouts in all (its layer L is
the loss's; its softmax, KL and top-k are not counted), ``--lens last-block`` L applications of
one block. ``--skips`` adds (:func:`future_flops`), per document and split point t, the blocks
l..L-1 over the batch's width for every skipped block l, the readout at the positions p >= t once
per skipped block, and one readout of every padded token (the clean distributions).

Targets: a row that adds no FLOPs at most 1.10 x plain; a row that adds FLOPs (every row but plain)
at most 1.15 x (its FLOPs / the forward's). Each repeat runs every row once, in rotating order,
after an untimed warm-up on a short batch; the table shows median wall and CPU seconds (the
process's, all threads) and the median over repeats of (row / plain) within a repeat. The verdict is
on the CPU-time ratio: on a machine shared with other work, wall time also measures their load.
Torch runs ``--threads`` threads (default 1): with one, CPU time is the work itself; with more, on a
busy machine, it also counts the threads of every parallel operation spinning while they wait for
each other, which inflates the many small operations of the forward far more than the large readout
matmuls.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import Any

import torch
from common import add_quick, record

import layerdiv.measurements.lens.hooks as lens_module
from layerdiv.demo import DEMO_MODEL, bbc_articles
from layerdiv.extract.adapters import adapter_for
from layerdiv.extract.batching import CPU_TOKEN_BUDGET, batches, tokenize_documents
from layerdiv.extract.forward import ModelRunner, left_padded
from layerdiv.extract.models import LoadedModel, load_model, load_tokenizer, resolve_source
from layerdiv.extract.readout import Readout
from layerdiv.measurements.future import FUTURE
from layerdiv.measurements.future.hooks import SkipSettings, split_points
from layerdiv.measurements.lens import LENS

Batches = list[list[list[int]]]
"""Batches of documents, each document its token ids."""
Row = tuple[str, Callable[[Batches], Any], float]
"""(name, run over the batches, FLOPs of that run)."""

OVERHEAD_TARGET = 1.10
"""A row that adds no FLOPs to the forward: at most this multiple of the plain forward's time."""
FLOP_TARGET = 1.15
"""A row that adds FLOPs: at most this multiple of (its FLOPs / the forward's) in time."""


def load() -> LoadedModel:
    source = resolve_source(DEMO_MODEL, None, None, False)
    return load_model(source, load_tokenizer(source), torch.device("cpu"), torch.float32)


def documents(loaded: LoadedModel, n: int, max_tokens: int, batch_size: int) -> Batches:
    """``n`` BBC News articles spread over the corpus, tokenized as a text task does, in the
    length-sorted batches ``ModelRunner.run_chunk`` forms."""
    rows = bbc_articles(paragraphs=4)
    texts = [r["text"] for r in rows[:: max(1, len(rows) // n)][:n]]
    seqs, _ = tokenize_documents(loaded.tokenizer, texts, max_tokens)
    ids = list(range(len(seqs)))
    groups = batches([len(s) for s in seqs], ids, batch_size, CPU_TOKEN_BUDGET)
    return [[seqs[i] for i in group] for group in groups]


def flop_counts(config: Any, data: Batches) -> dict[str, float]:
    """FLOPs over ``data`` (every padded token): ``forward`` (one pass as ``ModelRunner`` runs
    it), ``block`` (one block applied to every position once), ``readout`` (final norm's
    negligible cost aside, one unembedding of every position)."""
    d, n_layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    weights = 2 * d * heads * head_dim + 2 * d * kv * head_dim + 3 * d * config.intermediate_size
    block = readout = rows = 0.0
    for batch in data:
        width = max(len(s) for s in batch)
        tokens = len(batch) * width
        causal = len(batch) * width * (width + 1) / 2  # (position, earlier position) pairs
        block += 2 * weights * tokens + 4 * heads * head_dim * causal
        readout += 2 * d * vocab * tokens
        rows += len(batch)
    forward = n_layers * block + 2 * d * vocab * rows  # logits_to_keep=1: one row each
    return {"forward": forward, "block": block, "readout": readout, "layers": n_layers,
            "weights": weights, "attention": 4 * heads * head_dim}  # fmt: skip


def answers(data: Batches) -> list[tuple[int, int]]:
    """Per document (numbered in order) an answer (start s, length A): its second half, for the
    answer-anchored rows (the BBC articles name none)."""
    return [(len(seq) // 2, len(seq) - len(seq) // 2) for batch in data for seq in batch]


def future_flops(
    config: Any,
    data: Batches,
    flops: dict[str, float],
    settings: SkipSettings,
    answer: list[tuple[int, int]] | None = None,
) -> float:
    """FLOPs ``--skips`` with ``settings`` adds to the forward over ``data`` (documents numbered
    in order; ``answer`` per document for answer-anchored split points): per split point, a
    ``total`` row runs blocks l..L-1 and a readout after t per skipped block l, a ``local`` row
    blocks l+1..L-1 and no readout."""
    n_layers, per_token = int(flops["layers"]), 2 * config.hidden_size * config.vocab_size
    total, doc = flops["readout"], 0  # the clean distributions: one readout of every token
    for batch in data:
        width = max(len(s) for s in batch)
        row = 2 * flops["weights"] * width + flops["attention"] * width * (width + 1) / 2
        for seq in batch:
            where = None if answer is None else answer[doc]
            for t in split_points(len(seq), doc, settings, where):
                for mode in settings.modes:
                    blocks = n_layers if mode == "total" else n_layers - 1
                    total += sum(blocks - skipped for skipped in range(n_layers)) * row
                    if mode == "total":
                        total += n_layers * per_token * (len(seq) - t)
            doc += 1
    return total


ANSWER = SkipSettings(split="answer:4:4")
"""The answer-anchored row: up to 4 split points among the answer's offsets 0, 4, 8, ...
(methods §10; the answer is each article's second half)."""
LOCAL = SkipSettings(split="answer:4:4", modes=("local",))
"""The local row: the same split points, local (direct-only) effects."""


def plain_forward(loaded: LoadedModel) -> Callable[[Batches], None]:
    """The reference row's run: ``model(**inputs)`` on the left-padded batches, as
    ``ModelRunner`` runs it (``use_cache=False``, ``logits_to_keep=1``)."""
    pad = loaded.tokenizer.pad_token_id or 0

    def plain(data: Batches) -> None:
        with torch.inference_mode():
            for batch in data:
                loaded.model(**left_padded(batch, pad), use_cache=False, logits_to_keep=1)

    return plain


def measured(
    loaded: LoadedModel, run_settings: dict[str, Any], planned: dict[str, Any]
) -> Callable[[Batches], None]:
    """A row's run: ``ModelRunner.run`` of a text task with ``run_settings`` (by name: settings) and
    ``planned``, the documents numbered in order."""
    adapter = adapter_for(loaded.model.config)

    def run(data: Batches) -> None:
        with ModelRunner(loaded, adapter, [], CPU_TOKEN_BUDGET, kind="text",
                         run_settings=run_settings, planned=planned) as text:  # fmt: skip
            doc = 0
            for batch in data:
                text.run(batch, list(range(doc, doc + len(batch))))
                doc += len(batch)

    return run


def rows(loaded: LoadedModel, flops: dict[str, float], data: Batches) -> list[Row]:
    """The timed rows: the plain forward first (the reference), then ``ModelRunner`` for a text
    task without options, with each lens and with the future effects."""
    model = loaded.model
    adapter = adapter_for(model.config)

    def runner(lens: str | None) -> Callable[[Batches], None]:
        run_settings = {LENS.name: {"lens": lens}} if lens else {}

        def run(data: Batches) -> None:
            with ModelRunner(
                loaded, adapter, [], CPU_TOKEN_BUDGET, kind="text", run_settings=run_settings
            ) as text:
                for batch in data:
                    text.run(batch)

        return run

    def skips(settings: SkipSettings) -> Callable[[Batches], None]:
        run_settings = {FUTURE.name: {"skip_split": settings.split, "skip_seed": settings.seed,
                                  "skip_sublayers": list(settings.sublayers),
                                  "skip_modes": list(settings.modes)}}  # fmt: skip
        return measured(loaded, run_settings, {FUTURE.name: answers(data)})

    def future(settings: SkipSettings) -> float:
        return (
            forward
            + flops["readout"]
            + future_flops(model.config, data, flops, settings, answers(data))
        )

    layers, forward = flops["layers"], flops["forward"]
    lens = forward + (layers + 1) * flops["readout"]
    return [
        ("plain", plain_forward(loaded), forward),
        ("text", runner(None), forward + flops["readout"]),  # the loss: every token read out
        ("lens", runner("final"), lens),
        ("lens last-block", runner("last-block"), lens + layers * flops["block"]),
        ("skips", skips(SkipSettings()), future(SkipSettings())),
        ("skips answer", skips(ANSWER), future(ANSWER)),
        ("skips local", skips(LOCAL), future(LOCAL)),
    ]


def target(flops: float, forward: float) -> float:
    """The time ratio to the plain forward a row must stay within."""
    return OVERHEAD_TARGET if flops == forward else FLOP_TARGET * flops / forward


def timed(run: Callable[[Batches], Any], data: Batches) -> tuple[float, float]:
    """Wall and CPU seconds (this process, all its threads) of one run."""
    wall, cpu = time.perf_counter(), time.process_time()
    run(data)
    return time.perf_counter() - wall, time.process_time() - cpu


@contextmanager
def lens_split() -> Iterator[dict[str, float]]:
    """CPU seconds spent in the lens's readouts and in its statistics while the context is open
    (``Readout.logits`` and the ``lens_stats`` the text task's lens calls, wrapped)."""
    spent = {"readout": 0.0, "statistics": 0.0}
    logits, stats = Readout.logits, lens_module.lens_stats

    def timed_call(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.process_time() - start

        return call

    Readout.logits = timed_call("readout", logits)  # type: ignore[method-assign]
    lens_module.lens_stats = timed_call("statistics", stats)
    try:
        yield spent
    finally:
        Readout.logits = logits  # type: ignore[method-assign]
        lens_module.lens_stats = stats


def repeated(
    table: list[Row], data: Batches, repeats: int, short: Batches
) -> tuple[dict[str, list[tuple[float, float]]], list[float]]:
    """Every row run on ``short`` (an untimed warm-up: first calls, weights paged in), then
    ``repeats`` times on ``data`` in rotating order: each row's (wall, CPU) seconds per repeat,
    and the load averages seen."""
    for _, run, _ in table:
        run(short)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in table}
    loads = [os.getloadavg()[0]]
    for r in range(repeats):
        k = r % len(table)
        for name, run, _ in table[k:] + table[:k]:
            times[name].append(timed(run, data))
        loads.append(os.getloadavg()[0])
        done = ", ".join(f"{n} {t[-1][0]:.2f} s ({t[-1][1]:.2f} CPU s)" for n, t in times.items())
        print(f"repeat {r + 1}: {done}; load average {loads[-1]:.2f}")
    return times, loads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=4, help="BBC News articles")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per article (cut)")
    parser.add_argument("--batch-size", type=int, default=4, help="documents per forward pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of every row")
    parser.add_argument("--rows", default="text,lens,lens last-block",
                        help="rows besides plain, comma-separated (also: skips)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.docs, args.max_tokens, args.batch_size, args.repeats = 2, 24, 2, 1
    torch.set_num_threads(args.threads)
    print(f"command: {shlex.join(['python', *sys.argv])}")
    versions = ", ".join(f"{d} {metadata.version(d)}" for d in ("torch", "transformers"))
    print(f"machine: {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; {versions}")
    loaded = load()
    data = documents(loaded, args.docs, args.max_tokens, args.batch_size)
    real = sum(len(s) for b in data for s in b)
    padded = sum(len(b) * max(len(s) for s in b) for b in data)
    print(f"model: {DEMO_MODEL} fp32 cpu ({loaded.model.config._attn_implementation} attention); "
          f"{sum(len(b) for b in data)} documents, {real} tokens, {len(data)} batches, "
          f"{padded} padded tokens")  # fmt: skip
    flops = flop_counts(loaded.model.config, data)
    wanted = {"plain", *args.rows.split(",")}
    table = [row for row in rows(loaded, flops, data) if row[0] in wanted]
    times, loads = repeated(table, data, args.repeats, [[data[0][0][:32]]])
    results = report(table, times, flops["forward"])
    shares = split(table, data, statistics.median(t[1] for t in times["plain"]))
    loads.append(os.getloadavg()[0])
    # the defaults' results file, or one named after the rows and threads asked for
    suffix = "" if args.rows == parser.get_default("rows") else "-" + args.rows
    suffix += "" if args.threads == parser.get_default("threads") else f"-{args.threads}threads"
    name = f"bench_text_extract{suffix}".replace(" ", "-").replace(",", "-")
    record(name, COLUMNS, results, loads,
           formats=FORMATS, forward_gflop=round(flops["forward"] / 1e9, 1),
           repeats=args.repeats, threads=args.threads, split=shares)  # fmt: skip


COLUMNS = ["row", "wall s", "wall ratio", "CPU s", "CPU ratio", "FLOP ratio", "target", "result"]
FORMATS = ["", ".2f", ".3f", ".2f", ".3f", ".3f", ".3f", ""]
"""The table's columns (those of the results file) and how the docs print them."""


def split(table: list[Row], data: Batches, plain_cpu: float) -> dict[str, Any]:
    """Run each lens row once more, its readouts and statistics timed: print its CPU time split
    into the forward (the plain row's median), the readout matmuls, the statistics and the rest;
    returned as a table for the results file."""
    lens_rows = [(name, run) for name, run, _ in table if name.startswith("lens")]
    columns = ["row", "CPU s", "forward", "readout", "statistics", "rest"]
    out: dict[str, Any] = {"columns": columns, "formats": [""] + [".2f"] * 5, "rows": []}
    print("\nsplit of the lens rows' CPU time (one more run each; forward: plain's median)")
    print(f"{'row':<16} {'CPU s':>8} {'forward':>8} {'readout':>8} {'stats':>8} {'rest':>8}")
    for name, run in lens_rows:
        with lens_split() as spent:
            _, cpu = timed(run, data)
        rest = cpu - plain_cpu - spent["readout"] - spent["statistics"]
        print(f"{name:<16} {cpu:8.2f} {plain_cpu:8.2f} {spent['readout']:8.2f} "
              f"{spent['statistics']:8.2f} {rest:8.2f}")  # fmt: skip
        values = [cpu, plain_cpu, spent["readout"], spent["statistics"], rest]
        out["rows"].append([name, *(round(v, 2) for v in values)])
    return out


def report(
    table: list[Row], times: dict[str, list[tuple[float, float]]], forward: float
) -> list[list[Any]]:
    """The table: per row median wall and CPU seconds, their ratios to the plain forward (median
    over repeats of the ratio within a repeat), the FLOP ratio, the target and the verdict (on
    the CPU-time ratio, which load from other processes on a shared machine disturbs less);
    returned as the results file's rows."""
    print(f"\n{'row':<16} {'wall s':>8} {'ratio':>6} {'CPU s':>8} {'ratio':>6} "
          f"{'FLOP ratio':>10} {'target':>7}  result")  # fmt: skip
    out = []
    for name, _, count in table:
        ratios = []
        for k in (0, 1):
            pairs = zip(times[name], times["plain"], strict=True)
            ratios.append(statistics.median(a[k] / b[k] for a, b in pairs))
        limit = target(count, forward)
        verdict = "-" if name == "plain" else ("pass" if ratios[1] <= limit else "FAIL")
        wall, cpu = (statistics.median(t[k] for t in times[name]) for k in (0, 1))
        print(f"{name:<16} {wall:8.2f} {ratios[0]:6.3f} {cpu:8.2f} {ratios[1]:6.3f} "
              f"{count / forward:10.3f} {limit:7.3f}  {verdict}")  # fmt: skip
        out.append([name, round(wall, 2), round(ratios[0], 3), round(cpu, 2), round(ratios[1], 3),
                    round(count / forward, 3), round(limit, 3), verdict])  # fmt: skip
    print(f"\nforward {forward / 1e9:.1f} GFLOP; ratio: median over repeats of (row s / plain s)"
          f" in the same repeat; target: {OVERHEAD_TARGET} without added FLOPs, else "
          f"{FLOP_TARGET} x FLOP ratio; result on the CPU-time ratio")  # fmt: skip
    return out


if __name__ == "__main__":
    main()
