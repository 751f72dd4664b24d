"""Linear maps between two models' layers (``--maps``, methods §11; the
depth-efficiency paper's fourth finding): for two partitions of one task extracted with
``--states`` over the same tokens (a text task's sampled positions, or a choice task's last
prompt tokens), a closed-form ridge map from every source layer i to every target layer j, on
the residual states and on the block updates. Not run by default.

Tables:

- ``layer_maps``: per (task, source_model, source_revision, target_model, target_revision, space,
  source_layer, target_layer) (the source and target columns are ``layerdiv.store.key.KEY``'s
  model columns; a map is between two (model, revision) partitions of one task):
  ``rel_error`` (mean over held-out rows of ||y_hat - y|| / max(||y||, 1e-6)), ``r2``,
  ``mean_rel_error`` (the mean predictor's: y_hat = the train mean of target layer j),
  ``beats_mean`` (r2 > 0 and rel_error below the mean predictor's), ``ridge`` (the value the
  map was fitted with: cross-validated, or ``--maps-ridge``), ``n_train`` and ``n_heldout``
  rows, ``few_rows`` (n_train < 10 d_A: the fit rests on its ridge more than on its data).
  ``space`` is ``states`` (layer l = h_l, l = 0..L) or ``updates`` (layer l = h_(l+1) - h_l,
  block l's update, l = 0..L-1).
- ``layer_map_best``: per source layer the target layer of the largest held-out R² among the
  maps that beat the mean predictor (null where none does), ``clears_gate`` (its R² reaches
  :data:`R2_GATE`) and both relative depths i / L_A and j / L_B (methods §11; L the model's
  blocks): states over i, j >= 1, updates (block l's, l = 0..L-1) over every block. R², not
  rel_error, ranks the targets: rel_error is relative to ||y||, so a target of large mean and
  little spread (an early layer, a sink-dominated one) has a small rel_error whatever predicts
  it, and ranking by it picks such targets for every source; R² = 1 - SSE / SS is the error
  relative to the mean predictor's on the same rows.
- ``layer_map_intervals``: per (pair, space) the bootstrap 95% interval (``low``, ``high``) of
  the verdict's Spearman rho over the held-out units (documents of a text task, instances of a
  choice task: ``units``), ``n_units`` of them resampled (:data:`~layerdiv.analyze.stats.RESAMPLES`
  resamples; null below :data:`~layerdiv.analyze.stats.MIN_INTERVAL_N`): per resample every
  map's R² and rel_error recomputed from the units' sums, the best targets, the gate and rho
  again; ``gate_changed``, the share of resamples whose gated source layers differ from the
  whole held-out set's, and ``defined``, the share where rho is defined.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import click
import numpy as np
import polars as pl
from scipy.stats import rankdata, spearmanr
from tqdm import tqdm

from layerdiv.analyze import plots
from layerdiv.analyze.layer_maps import ArrayLayers, DocumentSums, MapScores, fit_maps
from layerdiv.analyze.markdown import DASH, fmt, markdown_table, verdict
from layerdiv.analyze.registry import Analysis, Context, ReportContext, not_extracted
from layerdiv.analyze.stats import (
    MIN_INTERVAL_N,
    RESAMPLES,
    percentile_interval,
    resample_weights,
)
from layerdiv.errors import LayerdivError
from layerdiv.measurements.states import WORDS
from layerdiv.store import PartitionInfo
from layerdiv.store.key import DEFAULT_REVISION, MODEL_KEY, PartitionKey
from layerdiv.store.paths import slug

SPACES = ("states", "updates")
"""What is mapped: the residual states, or the block updates (the paper's ``diff_only``)."""

HELD_OUT = (5, 4)
"""Documents with doc % 5 == 4 are held out (methods §11); the training documents' doc % 5
(0..3) are the folds of the ridge's cross-validation."""

FOLLOWS = 0.5
"""The report says the best target follows relative depth where Spearman's rho exceeds this."""

MIN_LAYERS = 5
"""Source layers with a best target below which Spearman's rho cannot tell (with 4 points no
ranking reaches p < 0.05)."""

R2_GATE = 0.5
"""The held-out R² a source layer's best map must reach to count in the verdict: the map
explains at least half the target's held-out variance. Below it the chosen target says little
about where the source's information lies, and no verdict rests on it."""

PERMUTATIONS = 10_000
"""Seeded permutations of the best targets over the gated source layers: the null of the
correspondence test (no relation between a source layer's depth and its target's)."""

SIGNIFICANCE = 0.05
"""The permutation p-value below which a correspondence counts as more than chance."""

RIDGES = (1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
"""The ridge values cross-validated per map (lambda = ridge * trace(G) / d_A, methods §11)."""

ROWS_PER_DIM = 10
"""Training rows per source dimension below which a map is flagged ``few_rows``."""


PAIR = ("task", *(f"source_{c}" for c in MODEL_KEY), *(f"target_{c}" for c in MODEL_KEY))
"""The key of one map: the task, and the source's and target's (model, revision) key columns."""


def _pair_key(a: PartitionInfo, b: PartitionInfo) -> dict[str, str]:
    """:data:`PAIR`'s values of source ``a`` and target ``b``."""
    return {
        "task": a.task,
        **{f"source_{c}": getattr(a.key, c) for c in MODEL_KEY},
        **{f"target_{c}": getattr(b.key, c) for c in MODEL_KEY},
    }


def _label(row: Mapping[str, object], side: str, names: dict[str, str]) -> str:
    """A source's or target's model name, with its revision unless that is ``main``."""
    model, rev = str(row[f"{side}_model"]), str(row[f"{side}_revision"])
    return names.get(model, model) + ("" if rev == DEFAULT_REVISION else f"@{rev}")


class MapsError(LayerdivError, ValueError):
    """``--maps`` asked for partitions that cannot be mapped (no states, two tasks, other
    tokens)."""


def _pairs(parts: list[PartitionInfo], spec: str) -> list[tuple[PartitionInfo, PartitionInfo]]:
    """The (source, target) partitions that ``spec`` (``all`` or ``A:B[,C:D]``, models by id or
    slug) names in the selection ``parts``; refuses what cannot be mapped, in one line."""
    with_states = [p for p in parts if "states" in p.tables]
    tasks = sorted({p.task for p in with_states})
    if not with_states:
        raise MapsError(not_extracted(parts, "states", "--maps (the layers' states)"))
    if len(tasks) > 1:
        raise MapsError(
            f"--maps maps two partitions of one task, and the selection has states of tasks "
            f"{', '.join(tasks)}; choose one with --task"
        )
    task = tasks[0]
    if spec == "all":
        if len(with_states) < 2:
            only = with_states[0].manifest.model
            raise MapsError(
                f"--maps all: task {task} has the states of one model only ({only}); extract a "
                f"second model with --states, or ask for --maps {only}:{only} (the model onto "
                "itself)"
            )
        return [(a, b) for a in with_states for b in with_states if a is not b]
    pairs = []
    for item in spec.split(","):
        names = item.split(":")
        if len(names) != 2 or not all(names):
            raise MapsError(
                f"--maps {spec}: give all, or SOURCE:TARGET pairs (model ids or slugs, each "
                "MODEL@REVISION where the store holds several revisions)"
            )
        pairs.append((_find(parts, names[0], task), _find(parts, names[1], task)))
    return pairs


def _find(parts: list[PartitionInfo], name: str, task: str) -> PartitionInfo:
    """The partition of ``name`` (a model id or slug, ``@REVISION`` where the task has several)
    on ``task``, refusing one without states."""
    model, _, rev = name.partition("@")
    found = [
        p
        for p in parts
        if p.task == task
        and (model in (p.manifest.model, p.model) or p.model == slug(model))
        and rev in ("", p.key.revision)
    ]
    if not found:
        have = ", ".join(sorted({p.manifest.model for p in parts if p.task == task}))
        raise MapsError(f"--maps: no partition of model {name} on task {task}; it has {have}")
    if len(found) > 1:
        revs = ", ".join(p.key.revision for p in found)
        raise MapsError(
            f"--maps: model {name} has revisions {revs} on task {task}; name one as {model}@REV"
        )
    if "states" not in found[0].tables:
        raise MapsError(
            not_extracted([found[0]], "states", f"--maps {name} (its states)")
            or f"--maps: the states of {found[0].where} are incomplete; complete them with "
            f"`{found[0].extract_command('states')}`"
        )
    return found[0]


def _paired_rows(a: PartitionInfo, b: PartitionInfo, ra: States, rb: States) -> np.ndarray | None:
    """The (row of ``a``, row of ``b``) pairs a map is fitted on (n, 2): None (every row) where both
    partitions store the same (doc, pos, token) rows; else, where both stored their word ends
    (``--states words``: two tokenizers), the rows whose tokens end at the same character of
    the same document (``char_end``, methods §11). Refuses two partitions that share no such
    rows, naming the first row that differs."""
    (ka, ta, _, ca), (kb, tb, _, cb) = ra, rb
    n = min(len(ka), len(kb))
    same = (ka[:n] == kb[:n]).all(axis=1) & (ta[:n] == tb[:n])
    if n == len(ka) == len(kb) and same.all():
        return None
    if all(p.manifest.settings.get("states", {}).get("states") == WORDS for p in (a, b)):
        left = pl.DataFrame({"doc": ka[:, 0], "char_end": ca, "a": np.arange(len(ka))})
        right = pl.DataFrame({"doc": kb[:, 0], "char_end": cb, "b": np.arange(len(kb))})
        on = ["doc", "char_end"]
        both = left.filter(pl.col("char_end") >= 0).join(right, on=on).sort(on)
        if both.height:
            return both.select("a", "b").to_numpy()
    r = int(np.argmin(same)) if not same.all() else n

    def row(k: np.ndarray, t: np.ndarray) -> str:
        return f"(doc {k[r, 0]}, pos {k[r, 1]}, token {t[r]})" if r < len(k) else "no row"

    raise MapsError(
        f"--maps {a.manifest.model}:{b.manifest.model} on task {a.task}: stored row {r} is "
        f"{row(ka, ta)} in the first and {row(kb, tb)} in the second (another tokenizer, "
        "--states K or --states-seed, or other documents) and no row of the two ends at the same "
        "character of a document; extract both alike, or both with --states words (word "
        "ends, shared by any two tokenizers)"
    )


def _split(key: np.ndarray, where: str) -> tuple[np.ndarray, int, int, list[int]]:
    """Row order (train rows by fold doc % 5, then held-out rows: doc % 5 == 4), both counts,
    and the boundaries of the folds' rows."""
    fold = key[:, 0] % HELD_OUT[0]
    held = fold == HELD_OUT[1]
    n_train, n_held = int((~held).sum()), int(held.sum())
    train = np.flatnonzero(~held)
    train = train[np.argsort(fold[train], kind="stable")]
    sizes = np.bincount(fold[train], minlength=HELD_OUT[1])
    if n_held == 0 or (sizes > 0).sum() < 2:
        raise MapsError(
            f"--maps: {where} has {n_train} training and {n_held} held-out rows (documents with "
            "doc % 5 == 4 are held out, the others are cross-validated in folds doc % 5): "
            "extract at least 5 documents"
        )
    bounds = [0, *np.cumsum(sizes[sizes > 0]).tolist()]
    return np.concatenate([train, np.flatnonzero(held)]), n_train, n_held, bounds


def ridges(value: object) -> tuple[float, ...]:
    """The ridge values of the ``maps_ridge`` option: :data:`RIDGES` (cross-validated) for
    ``cv`` or none, else the one positive number given."""
    if value is None or value == "cv":
        return RIDGES
    try:
        ridge = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        ridge = float("nan")
    if not ridge > 0:
        raise MapsError(f"--maps-ridge {value}: give cv or a positive number")
    return (ridge,)


States = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""A partition's stored (doc, pos) rows, their token ids, states and where their tokens end in
the text (``PartitionInfo.states``)."""


def pair_table(
    a: PartitionInfo,
    b: PartitionInfo,
    ridge: tuple[float, ...],
    cache: dict[PartitionKey, States],
    progress: Callable[[float], object] = lambda share: None,
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """``layer_maps`` and ``layer_map_intervals`` of source partition ``a`` onto target ``b``
    (both spaces); ``progress`` is told the share of one space's maps done after each source
    layer."""
    for p in (a, b):
        if p.key not in cache:
            cache[p.key] = p.states()
    (key, _, sa, _), (_, _, sb, _) = cache[a.key], cache[b.key]
    rows = _paired_rows(a, b, cache[a.key], cache[b.key])
    if rows is not None:  # two tokenizers: the rows whose tokens end at one character
        key, sa, sb = key[rows[:, 0]], sa[rows[:, 0]], sb[rows[:, 1]]
    order, n_train, n_held, folds = _split(key, a.where)
    units = key[order[n_train:], 0]  # the held-out rows' documents (instances)
    frames, intervals = [], []
    for space in SPACES:
        updates = space == "updates"
        src, tgt = ArrayLayers(sa, order, updates), ArrayLayers(sb, order, updates)
        done = _per_layer(progress, src.n_layers)
        scores = fit_maps(src, tgt, n_train, n_held, ridge, folds, progress=done, documents=units)
        few = n_train < ROWS_PER_DIM * src.width
        frames.append(score_rows(_pair_key(a, b), space, scores, n_train, n_held, few))
        assert scores.documents is not None
        intervals.append({**_pair_key(a, b), "space": space, "units": a.kind.units,
                          **resampled_rho(scores.documents, updates)})  # fmt: skip
    return pl.concat(frames), pl.DataFrame(intervals, schema=INTERVALS_SCHEMA)


def _per_layer(progress: Callable[[float], object], layers: int) -> Callable[[int], None]:
    """What ``fit_maps`` calls after each of ``layers`` source layers: ``progress`` told 1 /
    ``layers`` of one space's maps."""

    def done(layer: int) -> None:
        progress(1 / layers)

    return done


def score_rows(
    key: Mapping[str, str], space: str, scores: MapScores, n_train: int, n_held: int, few: bool
) -> pl.DataFrame:
    """The ``layer_maps`` rows of one pair's (:data:`PAIR` values ``key``) maps in ``space``."""
    i, j = np.meshgrid(*(np.arange(n) for n in scores.r2.shape), indexing="ij")
    return pl.DataFrame(
        {
            **key,
            "space": space,
            "source_layer": i.ravel().astype(np.int16),
            "target_layer": j.ravel().astype(np.int16),
            "rel_error": scores.rel_error.ravel(),
            "r2": scores.r2.ravel(),
            "mean_rel_error": scores.mean_rel_error[j.ravel()],
            "ridge": scores.ridge.ravel(),
            "n_train": n_train,
            "n_heldout": n_held,
            "few_rows": few,
        }
    ).with_columns(
        beats_mean=beats_mean(pl.col("r2"), pl.col("rel_error"), pl.col("mean_rel_error"))
    )


def beats_mean(r2: Any, rel_error: Any, mean_rel_error: Any) -> Any:
    """Whether a map beats the mean predictor: R² > 0 and its rel_error below the mean
    predictor's (methods §11), of numpy arrays or of Polars expressions alike (``layer_maps``'
    ``beats_mean`` and the resamples' best targets, :func:`best_targets`)."""
    return (r2 > 0) & (rel_error < mean_rel_error)


def best_table(maps: pl.DataFrame) -> pl.DataFrame:
    """``layer_map_best``: per source layer the target layer of the largest held-out R² among
    the maps that beat the mean predictor (states: i, j >= 1; methods §11), whether that R²
    reaches :data:`R2_GATE` (``clears_gate``), with both relative depths; null where no map of
    the source layer beats it."""
    pair = [*PAIR, "space"]
    key = [*pair, "source_layer"]
    updates = (pl.col("space") == "updates").cast(pl.Int16)

    def depth(layer: str) -> pl.Expr:  # i / L, L = blocks (states 0..L, updates 0..L-1)
        return (pl.col(layer) / (pl.col(layer).max().over(pair) + updates)).alias(
            layer.replace("layer", "depth")
        )

    first = (updates == 1) | ((pl.col("source_layer") >= 1) & (pl.col("target_layer") >= 1))
    maps = maps.with_columns(depth("source_layer"), depth("target_layer")).filter(first)
    sources = maps.select(*key, "source_depth").unique(maintain_order=True)
    columns = ["target_layer", "rel_error", "r2", "mean_rel_error", "ridge"]
    best = (
        maps.filter(pl.col("beats_mean") & pl.col("r2").is_not_nan())
        .sort([*key, "r2", "target_layer"], descending=[*[False] * len(key), True, False])
        .group_by(key, maintain_order=True)
        .first()
        .select(*key, *columns, "target_depth")
    )
    return (
        sources.join(best, on=key, how="left", nulls_equal=True)
        .with_columns(clears_gate=pl.col("r2").fill_null(-np.inf) >= R2_GATE)
        .select(*key, *columns, "clears_gate", "source_depth", "target_depth")
    )


INTERVALS_SCHEMA = {**dict.fromkeys([*PAIR, "space", "units"], pl.String), "low": pl.Float64,
                    "high": pl.Float64, "n_units": pl.Int64, "gate_changed": pl.Float64,
                    "defined": pl.Float64}  # fmt: skip
"""``layer_map_intervals``' columns."""


def best_targets(r2: np.ndarray, rel: np.ndarray, mean_rel: np.ndarray) -> np.ndarray:
    """Per source layer (the last axis but one) the index of its best target (the last axis):
    the largest R² among the maps that beat the mean predictor (r2 > 0 and rel_error below
    ``mean_rel``'s), the smallest j on ties, -1 where none does: :func:`best_table`'s rule, over
    any leading axes (resamples)."""
    ranked = np.where(beats_mean(r2, rel, mean_rel[..., None, :]), r2, -np.inf)
    best = ranked.argmax(axis=-1)
    return np.where(np.isfinite(ranked.max(axis=-1)), best, -1)


def resampled_rho(sums: DocumentSums, updates: bool) -> dict[str, float | int | None]:
    """The ``layer_map_intervals`` values of one pair and space from its held-out units' sums:
    per bootstrap resample of the units (:func:`~layerdiv.analyze.stats.resample_weights`) every
    map's R² and rel_error, the best targets (:func:`best_targets`; states over i, j >= 1), the
    gated layers (best R² >= :data:`R2_GATE`) and Spearman's rho of (i, best j) over them
    (undefined below :data:`MIN_LAYERS` or with one target: rank-equal to the relative depths');
    the percentile interval of the defined rhos; none below
    :data:`~layerdiv.analyze.stats.MIN_INTERVAL_N` units."""
    n = len(sums.rows)
    out: dict[str, float | int | None] = {"low": None, "high": None, "n_units": n,
                                          "gate_changed": None, "defined": None}  # fmt: skip
    if n < MIN_INTERVAL_N:
        return out
    first = 0 if updates else 1
    r2, rel, mean_rel = sums.scores(np.vstack([np.ones(n), resample_weights(n)]))
    r2, rel, mean_rel = r2[:, first:, first:], rel[:, first:, first:], mean_rel[:, first:]
    best = best_targets(r2, rel, mean_rel)
    gated = np.take_along_axis(r2, np.maximum(best, 0)[..., None], -1)[..., 0] >= R2_GATE
    gated &= best >= 0
    rho = np.full(RESAMPLES, np.nan)
    for r in range(RESAMPLES):
        g = gated[r + 1]
        if g.sum() >= MIN_LAYERS and np.ptp(best[r + 1, g]) > 0:
            rho[r] = spearmanr(np.flatnonzero(g), best[r + 1, g])[0]
    low, high = percentile_interval(rho)
    changed = (gated[1:] != gated[0]).any(axis=1).mean()
    return {**out, "low": None if np.isnan(low) else float(low),
            "high": None if np.isnan(high) else float(high),
            "gate_changed": float(changed), "defined": float(np.isfinite(rho).mean())}  # fmt: skip


def permutation_p(x: np.ndarray, y: np.ndarray, rho: float, seed: int = 0) -> float:
    """One-sided p-value of Spearman's ``rho`` of (x, y) against :data:`PERMUTATIONS` seeded
    permutations of y over the rows: (1 + #{rho_perm >= rho}) / (1 + permutations)."""
    rng = np.random.default_rng(seed)
    rank_x = rankdata(x)
    ranks = rankdata(y)
    shuffled = np.array([rng.permutation(ranks) for _ in range(PERMUTATIONS)])
    # Spearman's rho is Pearson's correlation of the ranks (ties: mid-ranks)
    cx = rank_x - rank_x.mean()
    cy = shuffled - ranks.mean()
    with np.errstate(invalid="ignore", divide="ignore"):
        null = (cy @ cx) / (np.linalg.norm(cx) * np.linalg.norm(cy, axis=1))
    return float((1 + np.sum(null >= rho - 1e-12)) / (1 + PERMUTATIONS))


def spearman(best: pl.DataFrame, intervals: pl.DataFrame) -> pl.DataFrame:
    """Per (task, source, target, space): Spearman's correlation of the source and best target
    relative depths over the source layers whose best map clears :data:`R2_GATE` (methods §11)
    and its one-sided permutation p-value (targets permuted over those layers,
    :func:`permutation_p`); null below :data:`MIN_LAYERS` layers or where every best target is
    the same; with the pair's ``layer_map_intervals`` row (``intervals``: the interval over the
    held-out units). ``n``: the gated layers, ``n_best``: those with a best target,
    ``n_sources``: every source layer."""
    rows = []
    for key, group in best.group_by(*PAIR, "space", maintain_order=True):
        found = group.drop_nulls("target_layer")
        gated = found.filter("clears_gate")
        rho = p = None
        if gated.height >= MIN_LAYERS and gated["target_depth"].n_unique() > 1:
            x, y = gated["source_depth"].to_numpy(), gated["target_depth"].to_numpy()
            rho = float(spearmanr(x, y)[0])
            p = permutation_p(x, y, rho)
        rows.append((*key, rho, p, gated.height, found.height, group.height))
    keys = [*PAIR, "space"]
    schema = {**dict.fromkeys(keys, pl.String), "spearman": pl.Float64, "p_value": pl.Float64,
              "n": pl.Int64, "n_best": pl.Int64, "n_sources": pl.Int64}  # fmt: skip
    found = pl.DataFrame(rows, schema=schema, orient="row")
    return found.join(intervals, on=keys, how="left", nulls_equal=True)


def maps_verdict(row: Mapping[str, Any]) -> str:
    """The verdict line of one row of :func:`spearman`: none where fewer than
    :data:`MIN_LAYERS` source layers' best maps clear :data:`R2_GATE`; *cannot tell* where the
    correspondence does not beat permuted targets (p >= :data:`SIGNIFICANCE`); else the verdict
    on Spearman's rho against :data:`FOLLOWS` with its interval over the held-out units (n:
    those units), and how often resampling them changes the gated layers."""
    gate = f"R² >= {R2_GATE:g}"
    units = f"held-out {row['units']}"
    if row["n_units"] < MIN_INTERVAL_N:
        stable = f"No interval: fewer than {MIN_INTERVAL_N} {units} to resample."
    else:
        stable = (
            f"Over {RESAMPLES:,} resamples of the {units}, the gated source layers differ from "
            f"the whole set's in {row['gate_changed']:.0%} of them and rho is defined in "
            f"{row['defined']:.0%}."
        )
    counts = (
        f"{row['n']} of {row['n_sources']} source layers have a best map with {gate} "
        f"({row['n_best']} beat the mean predictor)"
    )
    if row["n"] < MIN_LAYERS:
        return (
            f"{counts}. **No verdict:** fewer than {MIN_LAYERS} source layers' best maps clear "
            f"the gate ({gate}), so the best targets say too little to test a correspondence."
        )
    p = row["p_value"]
    if p is None or p >= SIGNIFICANCE:
        shown = "undefined (every best target is the same)" if p is None else f"p = {p:.3g}"
        shown_rho = fmt(row["spearman"], digits=2)  # no interval of an undefined rho
        if row["spearman"] is not None:
            shown_rho += f" [{fmt(row['low'], digits=2)}, {fmt(row['high'], digits=2)}]"
        return (
            f"{counts}. **Verdict: cannot tell.** the best target follows relative depth: "
            f"Spearman {shown_rho} does not beat targets permuted over the "
            f"{row['n']} gated layers ({PERMUTATIONS:,} permutations, one-sided: {shown}; "
            f"n = {row['n_units']} {units}). {stable}"
        )
    line = verdict("the best target follows relative depth", "Spearman", row["spearman"],
                   (row["low"], row["high"]), row["n_units"], FOLLOWS, min_n=MIN_INTERVAL_N,
                   unit=f"{units}, resampled")  # fmt: skip
    return (
        f"{counts}; against targets permuted over them p = {p:.3g} ({PERMUTATIONS:,} "
        f"permutations). {line} {stable}"
    )


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: nothing unless the ``maps`` option names pairs."""
    spec = ctx.options.get("maps")
    if not spec:
        return {}
    ridge = ridges(ctx.options.get("maps_ridge"))
    cache: dict[PartitionKey, States] = {}
    pairs = _pairs(ctx.parts, spec)
    shown = "{l_bar}{bar}| {n:.1f}/{total} maps [{elapsed}<{remaining}]"
    off = None if ctx.progress else True
    total = len(pairs) * len(SPACES)
    with tqdm(total=total, desc="layer maps", disable=off, bar_format=shown) as bar:
        done = [pair_table(a, b, ridge, cache, bar.update) for a, b in pairs]
    maps = pl.concat([m for m, _ in done])
    intervals = pl.concat([i for _, i in done])
    return {
        "layer_maps": maps,
        "layer_map_best": best_table(maps),
        "layer_map_intervals": intervals,
    }


# --- report ----------------------------------------------------------------------------------


def _nearest_same_depth(n_a: int, n_b: int, updates: bool) -> list[int]:
    """Per source layer, the target layer nearest the same relative depth (methods §11: i / L_A
    = j / L_B, L the blocks: n - 1 states, n block updates): the heatmap's diagonal."""
    l_a, l_b = (n_a, n_b) if updates else (n_a - 1, n_b - 1)
    return [min(n_b - 1, round(i * l_b / l_a)) for i in range(n_a)]


def maps_figure(maps: pl.DataFrame, best: pl.DataFrame, names: dict[str, str]) -> plots.Figure:
    """Per (pair, space), two panels: the source x target heatmap of held-out R² (what selects
    the best target; coloured from 0 to 1, a negative R² as 0) with the same-relative-depth
    diagonal and the best targets marked, and the best-target curve
    (the best target's relative depth against the source layer's, beside the diagonal)."""
    panels = []
    for key in maps.select(*PAIR, "space").unique(maintain_order=True).iter_rows(named=True):
        match = [pl.col(c) == v for c, v in key.items()]
        sub, b = maps.filter(match), best.filter(match).drop_nulls("target_layer")
        n_a = int(sub["source_layer"].max()) + 1  # type: ignore[arg-type]
        n_b = int(sub["target_layer"].max()) + 1  # type: ignore[arg-type]
        grid = np.full((n_a, n_b), np.nan)
        grid[sub["source_layer"].to_numpy(), sub["target_layer"].to_numpy()] = sub["r2"]
        src, tgt, space = _label(key, "source", names), _label(key, "target", names), key["space"]
        layers = "block" if space == "updates" else "layer"
        heat = plots.Heatmap(
            z=[[None if np.isnan(v) else float(v) for v in row] for row in grid],
            x=list(range(n_b)),
            y=list(range(n_a)),
            colorbar="held-out R²",
            origin="lower",
            zmin=0.0,
            zmax=1.0,
        )
        diagonal = _nearest_same_depth(n_a, n_b, space == "updates")
        panels.append(
            plots.Panel(
                f"{space}: R² of the map i -> j",
                heatmap=heat,
                series=[
                    plots.Series(
                        "same relative depth",
                        diagonal,
                        list(range(n_a)),
                        color="gray",
                        dash="dash",
                        marker=None,
                    ),
                    plots.Series(
                        "best target",
                        b["target_layer"].to_list(),
                        b["source_layer"].to_list(),
                        color="red",
                        line=False,
                    ),
                ],
                xlabel=f"target {layers} j ({tgt})",
                ylabel=f"source {layers} i ({src})",
            )
        )
        panels.append(
            plots.Panel(
                f"{space}: best target of {src}'s layers",
                series=[
                    plots.Series(
                        "best target",
                        b["source_depth"].to_list(),
                        b["target_depth"].to_list(),
                        color="red",
                    ),
                    plots.Series(
                        "same relative depth",
                        [0, 1],
                        [0, 1],
                        color="gray",
                        dash="dash",
                        marker=None,
                    ),
                ],
                xlabel="source relative depth",
                ylabel="relative depth of the best target",
                xrange=(0, 1.02),
                yrange=(0, 1.02),
            )
        )
    return plots.Figure("Linear maps between layers (methods §11)", panels, cols=2)


def report(ctx: ReportContext) -> str:
    """The maps section: per pair and space, how many source layers have a map that beats the
    mean predictor and the verdict on Spearman's correlation of the relative depths, a warning
    where training rows are fewer than 10 d_A, the best-target table, and the figure."""
    if "layer_maps" not in ctx.tables:
        return ""
    maps, best = ctx.tables["layer_maps"], ctx.tables["layer_map_best"]
    names = plots.short_names(ctx.names)
    sentences = []
    for r in spearman(best, ctx.tables["layer_map_intervals"]).iter_rows(named=True):
        pair = f"{_label(r, 'source', names)} -> {_label(r, 'target', names)}, {r['space']}"
        sentences.append(f"- {pair}: {maps_verdict(r)}")
    rows = [
        [
            _label(r, "source", names),
            _label(r, "target", names),
            r["space"],
            str(r["source_layer"]),
            "none beats the mean" if r["target_layer"] is None else str(r["target_layer"]),
            fmt(r["source_depth"], digits=2),
            fmt(r["target_depth"], digits=2),
            fmt(r["rel_error"], digits=3),
            fmt(r["mean_rel_error"], digits=3),
            fmt(r["r2"], digits=2),
            "yes" if r["clears_gate"] else "no",
            DASH if r["ridge"] is None else f"{r['ridge']:g}",
        ]
        for r in best.iter_rows(named=True)
    ]
    header = ["Source", "Target", "Space", "i", "best j", "i / L_A", "j / L_B", "rel_error",
              "mean predictor's rel_error", "R²", f"R² >= {R2_GATE:g}", "ridge"]  # fmt: skip
    n_train, n_held = (_count_range(maps[c]) for c in ("n_train", "n_heldout"))
    cv = len(ridges(ctx.options.get("maps_ridge"))) > 1
    ridge = (
        f"its ridge cross-validated per map over the training documents' folds (doc % 5 = 0..3;"
        f" ridge in {', '.join(f'{r:g}' for r in RIDGES)})"
        if cv
        else f"with ridge {maps['ridge'][0]:g}"
    )
    edge = maps.filter(pl.col("ridge") == max(RIDGES)).height if cv else 0
    if edge:
        ridge += (
            f"; {edge} of {maps.height} maps chose the largest ridge of the grid, so their best "
            "may lie beyond it"
        )
    few = maps.filter("few_rows").select(*PAIR).unique().height
    warning = (
        f"**Warning: {_count_range(maps.filter('few_rows')['n_train'])} training rows, fewer "
        f"than {ROWS_PER_DIM} x d_A for "
        f"{few} map pair(s)** (column `few_rows` of `layer_maps`): such maps rest on their ridge "
        "more than on their data; extract more documents or positions."
        if few
        else f"Every map has at least {ROWS_PER_DIM} x d_A training rows."
    )
    return "\n\n".join(
        [
            "A ridge map from every layer i of the source model to every layer j of the target, "
            f"fitted in closed form on {n_train} token rows per pair, {ridge}, and scored on "
            f"{n_held} held-out rows (documents with doc % 5 == 4), on the residual states and "
            "on the "
            "block updates. A map counts only where it beats the mean predictor (the train "
            "mean of target layer j: R² > 0 and rel_error below the mean predictor's); the best "
            "target of a source layer is the largest held-out R² among those (not the least "
            "rel_error, which is relative to ||y|| and so favours targets of large mean and "
            "little spread whatever predicts them). The correspondence is tested only over the "
            f"source layers whose best map reaches R² >= {R2_GATE:g} (at least {MIN_LAYERS} of "
            "them): Spearman's rho of the relative depths, against the best targets permuted "
            f"over those layers ({PERMUTATIONS:,} seeded permutations, one-sided p < "
            f"{SIGNIFICANCE:g} needed), with its bootstrap interval over the held-out documents "
            f"(instances of a choice task; {RESAMPLES:,} resamples of them, each recomputing "
            "every map's held-out R², the best targets, the gate and rho; the n printed is "
            f"theirs, and no interval below {MIN_INTERVAL_N}). Where the "
            "best target's relative depth rises with the source's, the deeper model spreads "
            "the same computation over more layers.",
            warning,
            "\n".join(sentences),
            markdown_table(header, rows),
            plots.figure_link(
                ctx, "layer_maps.png", "Layer maps", lambda: maps_figure(maps, best, names)
            ),
        ]
    )


def _count_range(counts: pl.Series) -> str:
    """The counts of the pairs' rows: one number, or the least and the most."""
    low, high = int(counts.min()), int(counts.max())  # type: ignore[arg-type]
    return f"{low:,}" if low == high else f"{low:,} to {high:,}"


ANALYSIS = Analysis(
    name="maps",
    title="Linear maps between two models' layers",
    methods=(11,),
    tables=tables,
    report=report,
    options={
        "maps": click.Option(
            ["--maps"],
            default=None,
            metavar="all|A:B[,C:D]",
            help="Also fit ridge maps from every layer of model A's residual states to every "
            "layer of model B's on one task extracted with --states (all: every pair of models; "
            "methods §11; tables layer_maps, layer_map_best and layer_map_intervals). Not run by "
            "default.",
        ),
        "maps_ridge": click.Option(
            ["--maps-ridge"],
            default=None,
            metavar="cv|RIDGE",
            help="The ridge of --maps, lambda = ridge * trace(G) / d: cv (the default) "
            "cross-validates it per map over the training documents and the grid "
            f"{', '.join(f'{r:g}' for r in RIDGES)}, a positive number fixes it.",
        ),
    },
    kinds=("choice", "text"),
    order=220,
)
