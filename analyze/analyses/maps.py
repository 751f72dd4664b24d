"""Linear maps between two models' layers (``--maps``, methods §11; the
depth-efficiency paper's fourth finding): for two partitions of one task extracted with
``--states`` over the same tokens, a closed-form ridge map from every source layer i to every
target layer j, on the residual states and on the block updates. Not run by default.

Tables:

- ``layer_maps``: per (task, source_model, target_model, space, source_layer, target_layer):
  ``rel_error`` (mean over held-out rows of ||y_hat - y|| / max(||y||, 1e-6)), ``r2``,
  ``n_train`` and ``n_heldout`` rows. ``space`` is ``states`` (layer l = h_l, l = 0..L) or
  ``updates`` (layer l = h_(l+1) - h_l, block l's update, l = 0..L-1).
- ``layer_map_best``: per source layer the target layer of least rel_error and both relative
  depths: states i / L_A and j / L_B over i, j >= 1 (methods §11); updates, block l's
  output depth (l + 1) / L over every block.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import polars as pl
from scipy.stats import spearmanr

from layerdiv.analyze import plots
from layerdiv.analyze.layer_maps import ArrayLayers, fit_maps
from layerdiv.analyze.markdown import fmt, markdown_table
from layerdiv.analyze.registry import Analysis, Context, ReportContext, register
from layerdiv.errors import LayerdivError
from layerdiv.store import PartitionInfo
from layerdiv.store.paths import slug

SPACES = ("states", "updates")
"""What is mapped: the residual states, or the block updates (the paper's ``diff_only``)."""

HELD_OUT = (5, 4)
"""Documents with doc % 5 == 4 are held out (methods §11)."""

FOLLOWS = 0.5
"""The report says the best target follows relative depth where Spearman's rho exceeds this."""

DEFAULT_RIDGE = 1e-3
"""lambda = ridge * trace(G) / d_A (methods §11)."""


class MapsError(LayerdivError, ValueError):
    """``--maps`` asked for partitions that cannot be mapped (no states, two tasks, other
    tokens)."""


def _pairs(parts: list[PartitionInfo], spec: str) -> list[tuple[PartitionInfo, PartitionInfo]]:
    """The (source, target) partitions that ``spec`` (``all`` or ``A:B[,C:D]``, models by id or
    slug) names in the selection ``parts``; refuses what cannot be mapped, in one line."""
    with_states = [p for p in parts if "states" in p.tables]
    tasks = sorted({p.task for p in with_states})
    if not with_states:
        raise MapsError(
            "--maps: no selected partition has states; extract a text task with --states K|all "
            "for both models"
        )
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
            raise MapsError(f"--maps {spec}: give all, or SOURCE:TARGET pairs (model ids or slugs)")
        pairs.append((_find(parts, names[0], task), _find(parts, names[1], task)))
    return pairs


def _find(parts: list[PartitionInfo], name: str, task: str) -> PartitionInfo:
    """The partition of model ``name`` (id or slug) on ``task``, refusing one without states."""
    found = [
        p
        for p in parts
        if p.task == task and (name in (p.manifest.model, p.model) or p.model == slug(name))
    ]
    if not found:
        have = ", ".join(sorted({p.manifest.model for p in parts if p.task == task}))
        raise MapsError(f"--maps: no partition of model {name} on task {task}; it has {have}")
    if "states" not in found[0].tables:
        raise MapsError(
            f"--maps: {found[0].where} has no states; add them with "
            f"`{found[0].extract_command('states')} 1024`"
        )
    return found[0]


def _check_rows(a: PartitionInfo, b: PartitionInfo, ka: np.ndarray, ta: np.ndarray,
                kb: np.ndarray, tb: np.ndarray) -> None:  # fmt: skip
    """Refuse two partitions whose stored (doc, pos, token) differ, naming the first row that
    does."""
    n = min(len(ka), len(kb))
    same = (ka[:n] == kb[:n]).all(axis=1) & (ta[:n] == tb[:n])
    if n == len(ka) == len(kb) and same.all():
        return
    r = int(np.argmin(same)) if not same.all() else n

    def row(k: np.ndarray, t: np.ndarray) -> str:
        return f"(doc {k[r, 0]}, pos {k[r, 1]}, token {t[r]})" if r < len(k) else "no row"

    raise MapsError(
        f"--maps {a.manifest.model}:{b.manifest.model} on task {a.task}: stored row {r} is "
        f"{row(ka, ta)} in the first and {row(kb, tb)} in the second (another tokenizer, "
        "--states K or --states-seed, or other documents); extract both alike"
    )


def _split(key: np.ndarray, where: str) -> tuple[np.ndarray, int, int]:
    """Row order (train rows, then held-out rows: doc % 5 == 4) and both counts."""
    held = key[:, 0] % HELD_OUT[0] == HELD_OUT[1]
    n_train, n_held = int((~held).sum()), int(held.sum())
    if n_held == 0 or n_train < 2:
        raise MapsError(
            f"--maps: {where} has {n_train} training and {n_held} held-out rows (documents with "
            "doc % 5 == 4 are held out): extract at least 5 documents"
        )
    return np.concatenate([np.flatnonzero(~held), np.flatnonzero(held)]), n_train, n_held


States = tuple[np.ndarray, np.ndarray, np.ndarray]
"""A partition's stored (doc, pos) rows, their token ids and states (``PartitionInfo.states``)."""


def pair_table(
    a: PartitionInfo, b: PartitionInfo, ridge: float, cache: dict[str, States]
) -> pl.DataFrame:
    """``layer_maps`` of source partition ``a`` onto target ``b`` (both spaces)."""
    for p in (a, b):
        if p.model not in cache:
            cache[p.model] = p.states()
    (ka, ta, sa), (kb, tb, sb) = cache[a.model], cache[b.model]
    _check_rows(a, b, ka, ta, kb, tb)
    order, n_train, n_held = _split(ka, a.where)
    frames = []
    for space in SPACES:
        updates = space == "updates"
        src, tgt = ArrayLayers(sa, order, updates), ArrayLayers(sb, order, updates)
        scores = fit_maps(src, tgt, n_train, n_held, ridge)
        i, j = np.meshgrid(np.arange(src.n_layers), np.arange(tgt.n_layers), indexing="ij")
        frames.append(
            pl.DataFrame(
                {
                    "task": a.task,
                    "source_model": a.model,
                    "target_model": b.model,
                    "space": space,
                    "source_layer": i.ravel().astype(np.int16),
                    "target_layer": j.ravel().astype(np.int16),
                    "rel_error": scores.rel_error.ravel(),
                    "r2": scores.r2.ravel(),
                    "n_train": n_train,
                    "n_heldout": n_held,
                }
            )
        )
    return pl.concat(frames)


def best_table(maps: pl.DataFrame) -> pl.DataFrame:
    """``layer_map_best``: per source layer the target layer of least rel_error (states: i, j >=
    1) with both relative depths (methods §11)."""
    pair = ["task", "source_model", "target_model", "space"]
    key = [*pair, "source_layer"]
    updates = (pl.col("space") == "updates").cast(pl.Int16)

    def depth(layer: str) -> pl.Expr:  # i / L (states), (l + 1) / L (updates, L = blocks)
        return ((pl.col(layer) + updates) / (pl.col(layer).max().over(pair) + updates)).alias(
            layer.replace("layer", "depth")
        )

    first = (updates == 1) | ((pl.col("source_layer") >= 1) & (pl.col("target_layer") >= 1))
    return (
        maps.with_columns(depth("source_layer"), depth("target_layer"))
        .filter(first)
        .sort([*key, "rel_error"])
        .group_by(key, maintain_order=True)
        .first()
        .select(*key, "target_layer", "rel_error", "source_depth", "target_depth")
    )


def spearman(best: pl.DataFrame) -> pl.DataFrame:
    """Per (task, source, target, space): Spearman's correlation of the source and best target
    relative depths over source layers (methods §11), and its p-value."""
    rows = []
    for key, group in best.group_by("task", "source_model", "target_model", "space",
                                    maintain_order=True):  # fmt: skip
        rho, p = spearmanr(group["source_depth"], group["target_depth"])
        rows.append((*key, float(rho), float(p), group.height))
    return pl.DataFrame(
        rows,
        schema=["task", "source_model", "target_model", "space", "spearman", "p_value", "n"],
        orient="row",
    )


def tables(ctx: Context, prior: Mapping[str, pl.DataFrame]) -> dict[str, pl.DataFrame]:
    """The registry's entry point: nothing unless the ``maps`` option names pairs."""
    spec = ctx.options.get("maps")
    if not spec:
        return {}
    ridge = float(ctx.options.get("maps_ridge") or DEFAULT_RIDGE)
    cache: dict[str, States] = {}
    maps = pl.concat([pair_table(a, b, ridge, cache) for a, b in _pairs(ctx.parts, spec)])
    return {"layer_maps": maps, "layer_map_best": best_table(maps)}


# --- report ----------------------------------------------------------------------------------


def maps_figure(maps: pl.DataFrame, best: pl.DataFrame, path: Path, names: dict[str, str]) -> Path:
    """Per (source, target, space), one row: the source x target heatmap of rel_error on
    relative-depth axes with the diagonal drawn and the best targets marked, and the best-target
    curve (relative depth of the best target layer against the source layer's)."""
    pairs = maps.select("source_model", "target_model", "space").unique(maintain_order=True)
    fig = plots.new_figure(figsize=(10, 4 * pairs.height), layout="constrained")
    axes = fig.subplots(pairs.height, 2, squeeze=False)
    for (ax_map, ax_best), (src, tgt, space) in zip(axes, pairs.iter_rows(), strict=True):
        sub = maps.filter(
            (pl.col("source_model") == src)
            & (pl.col("target_model") == tgt)
            & (pl.col("space") == space)
        )
        n_a = int(sub["source_layer"].max()) + 1  # type: ignore[arg-type]
        n_b = int(sub["target_layer"].max()) + 1  # type: ignore[arg-type]
        grid = np.full((n_a, n_b), np.nan)
        grid[sub["source_layer"].to_numpy(), sub["target_layer"].to_numpy()] = sub["rel_error"]
        u = int(space == "updates")  # a cell's depth: l / L (states), (l + 1) / L (updates)
        l_a, l_b = n_a - 1 + u, n_b - 1 + u
        extent = ((u - 0.5) / l_b, (n_b - 0.5 + u) / l_b, (u - 0.5) / l_a, (n_a - 0.5 + u) / l_a)
        image = ax_map.imshow(grid, origin="lower", extent=extent, aspect="auto", cmap="viridis")
        fig.colorbar(image, ax=ax_map, label="held-out rel_error")
        ax_map.plot([0, 1], [0, 1], "w--", linewidth=1, label="same relative depth")
        ax_map.set_xlim(extent[0], extent[1])
        ax_map.set_ylim(extent[2], extent[3])
        b = best.filter(
            (pl.col("source_model") == src)
            & (pl.col("target_model") == tgt)
            & (pl.col("space") == space)
        )
        ax_map.plot(b["target_depth"], b["source_depth"], "r.", markersize=5, label="best target")
        ax_map.set_xlabel(f"target relative depth ({names.get(tgt, tgt)})")
        ax_map.set_ylabel(f"source relative depth ({names.get(src, src)})")
        ax_map.set_title(f"{space}: rel_error of the map i -> j", fontsize=10)
        ax_map.legend(fontsize=7, loc="upper left")
        ax_best.plot(b["source_depth"], b["target_depth"], "o-", markersize=3, label="best target")
        ax_best.plot([0, 1], [0, 1], "k--", linewidth=1, label="same relative depth")
        ax_best.set_xlabel("source relative depth")
        ax_best.set_ylabel("relative depth of the best target")
        ax_best.set_title(f"{space}: best target layer", fontsize=10)
        ax_best.legend(fontsize=7)
        ax_best.grid(alpha=0.3)
    fig.suptitle("Linear maps between layers (methods §11)", fontsize=11)
    return plots.save(fig, path)


def report(ctx: ReportContext) -> str:
    """The maps section: per pair and space, Spearman's correlation of the relative depths (one
    sentence each), the best-target table, and the figure."""
    if "layer_maps" not in ctx.tables:
        return ""
    maps, best = ctx.tables["layer_maps"], ctx.tables["layer_map_best"]
    names = plots.short_names(ctx.names)
    sentences = []
    for r in spearman(best).iter_rows(named=True):
        follows = "follows" if r["spearman"] > FOLLOWS else "does not follow"
        p = f", p {r['p_value']:.2g}" if np.isfinite(r["p_value"]) else ""
        sentences.append(
            f"- {names.get(r['source_model'], r['source_model'])} -> "
            f"{names.get(r['target_model'], r['target_model'])}, {r['space']}: the best target "
            f"{follows} relative depth (Spearman {fmt(r['spearman'], digits=2)}{p}, "
            f"{r['n']} source layers)."
        )
    rows = [
        [
            names.get(r["source_model"], r["source_model"]),
            names.get(r["target_model"], ""),
            r["space"],
            str(r["source_layer"]),
            str(r["target_layer"]),
            fmt(r["source_depth"], digits=2),
            fmt(r["target_depth"], digits=2),
            fmt(r["rel_error"], digits=3),
        ]
        for r in best.iter_rows(named=True)
    ]
    header = ["Source", "Target", "Space", "i", "best j", "i / L_A", "j / L_B", "rel_error"]
    n_train, n_held = maps["n_train"][0], maps["n_heldout"][0]
    return "\n\n".join(
        [
            "A ridge map from every layer i of the source model to every layer j of the target, "
            f"fitted in closed form on {n_train} token rows and scored on {n_held} held-out rows "
            "(documents with doc % 5 == 4), on the residual states and on the block updates. "
            "Where the best target's relative depth rises with the source's, the deeper model "
            "spreads the same computation over more layers.",
            "\n".join(sentences),
            markdown_table(header, rows),
            plots.figure_link(
                ctx, "layer_maps.png", "Layer maps", lambda p: maps_figure(maps, best, p, names)
            ),
        ]
    )


register(
    Analysis(
        name="maps",
        title="Linear maps between two models' layers",
        methods=(11,),
        tables=tables,
        report=report,
        options={
            "maps": "all or SOURCE:TARGET[,...]: ridge maps between the layers of two "
            "models' states (not run by default)",
            "maps_ridge": f"the ridge of --maps (default {DEFAULT_RIDGE})",
        },
        kinds=("choice", "text"),
    )
)
