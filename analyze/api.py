"""The Python API of the analysis stage: every table of the paper from a store, as Polars frames.

>>> from layerdiv.analyze import analyze, scores
>>> results = analyze("layerdiv-store", tasks=["sst2"])     # doctest: +SKIP
>>> results.scores                                          # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path

import polars as pl
from tqdm import tqdm

from layerdiv.analyze import stats
from layerdiv.analyze.decomposition import ESTIMATORS, Lens, instance_curves, partition_scores
from layerdiv.store import PartitionInfo, Store

StoreLike = Store | str | Path


def open_store(store: StoreLike) -> Store:
    """A checked :class:`Store` (a path is opened; raises ``StoreError`` on bad input)."""
    return store if isinstance(store, Store) else Store(store)


@dataclass
class Results:
    """Every result table of one analysis. Scores are fractions (accuracy 0.55, not 55) and
    ``j`` counts components (1 = the embedding alone, L = the full stack)."""

    scores: pl.DataFrame
    """Per (model, task, estimator): accuracy, mse, bias, diversity of the full stack (means over
    instances), n_instances, n_components, n_options, majority_accuracy (METHODS.md 2)."""
    instance_scores: pl.DataFrame
    """Per (model, task, estimator, instance): gold, pred, correct, mse, bias, diversity."""
    curves: pl.DataFrame
    """Per (model, task, estimator, j): accuracy, mse, bias, diversity of the first j components
    (means over instances), and the name and kind of component j (METHODS.md 3)."""
    modules: pl.DataFrame
    """Per (model, task, estimator, kind X): n_components |X|, bias and diversity (means over
    instances and the components of kind X), bias_share and diversity_share (Eqs. 9-10)."""
    correlations: pl.DataFrame
    """Per (model, task, estimator, metric, method): r, p, significant (METHODS.md 4)."""
    correlation_means: pl.DataFrame
    """Fisher-z averages of ``correlations`` over tasks, over models, and overall."""
    depth_curves: pl.DataFrame
    """Per (model, estimator, j): accuracy and mse averaged over tasks, with marginal gains."""
    depth_fits: pl.DataFrame
    """Per (model, estimator): acc = a + b log j and mse = c / j^alpha + L0, with errors."""
    information_curves: pl.DataFrame
    """Per (model, task, j): I(prefix_j; Y), its gain, error and Eq. 12 bounds (METHODS.md 6)."""
    information: pl.DataFrame
    """Per (model, task): H(Y), relevancy, I(full; Y), bounds, error, gains by half."""
    saturation: pl.DataFrame
    """Per (model, task): the depth at which accuracy saturates (see ``stats.saturation``)."""
    manifests: pl.DataFrame
    """Per (model, task): provenance of the analysed partitions (``Store.manifests``)."""
    lens: Lens
    min_params: float

    def tables(self) -> dict[str, pl.DataFrame]:
        """The result tables by name (what ``layerdiv analyze`` writes)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _SETTINGS}


_SETTINGS = {"lens", "min_params"}


def _tagged(frame: pl.DataFrame, info: PartitionInfo) -> pl.DataFrame:
    return frame.select(
        pl.lit(info.model).alias("model"), pl.lit(info.task).alias("task"), pl.all()
    )


def _component_names(parts: list[PartitionInfo]) -> pl.DataFrame:
    return pl.DataFrame(
        [
            {"model": p.model, "task": p.task, "j": j, "component": c.name, "kind": c.kind}
            for p in parts
            for j, c in enumerate(p.manifest.components, start=1)
        ],
        schema={
            "model": pl.String,
            "task": pl.String,
            "j": pl.Int16,
            "component": pl.String,
            "kind": pl.String,
        },
    )


def analyze(
    store: StoreLike,
    models: Iterable[str] = (),
    tasks: Iterable[str] = (),
    lens: Lens = "final",
    min_params: float = 0,
    progress: bool = False,
) -> Results:
    """Compute every table of METHODS.md sections 2-6 for the selected partitions.

    ``models`` (hub ids or slugs) and ``tasks`` filter the store (empty = all); ``lens`` is
    ``final`` or ``prefix`` (METHODS.md 3); ``min_params`` restricts the depth-efficiency tables
    to models with at least that many parameters (the paper's Fig. 6 uses 1e9)."""
    st = open_store(store)
    models, tasks = list(models), list(tasks)
    parts = st.select(models, tasks)
    manifests = st.manifests(models, tasks).filter(pl.col("n_done") > 0)
    bar = tqdm(parts, desc="analysing", unit="partition", disable=None if progress else True)
    done = [(info, partition_scores(info, lens)) for info in bar]

    def gather(name: str) -> pl.DataFrame:
        return pl.concat([_tagged(getattr(s, name), info) for info, s in done])

    curves = gather("curves").join(_component_names(parts), on=["model", "task", "j"])
    curves = curves.sort("model", "task", "estimator", "j")
    instances = gather("instances")
    counts = instances.group_by("model", "task", "estimator").agg(pl.len().alias("n_instances"))
    corr = stats.correlations(curves)
    depth = stats.depth_curves(curves, manifests, min_params)
    info_curves = stats.information_curves(
        gather("prefix_preds"), manifests.select("model", "task", "n_options")
    )
    return Results(
        scores=_score_table(curves, counts, instances, manifests),
        instance_scores=instances.sort("model", "task", "estimator", "instance"),
        curves=curves,
        modules=_module_shares(gather("modules"), counts),
        correlations=corr,
        correlation_means=stats.fisher_z_means(corr),
        depth_curves=depth,
        depth_fits=stats.depth_fits(depth),
        information_curves=info_curves,
        information=stats.information_summary(info_curves, gather("component_preds")),
        saturation=stats.saturation(curves),
        manifests=manifests,
        lens=lens,
        min_params=min_params,
    )


def _score_table(
    curves: pl.DataFrame, counts: pl.DataFrame, instances: pl.DataFrame, manifests: pl.DataFrame
) -> pl.DataFrame:
    """The full-stack scores: the curves at j = L, with sizes and the majority baseline."""
    sizes = manifests.select("model", "task", "n_components", "n_options")
    majority = stats.majority_baseline(instances.filter(pl.col("estimator") == ESTIMATORS[0]))
    return (
        curves.join(sizes, on=["model", "task"])
        .filter(pl.col("j") == pl.col("n_components"))
        .join(counts, on=["model", "task", "estimator"])
        .join(majority, on=["model", "task"])
        .select(
            "model",
            "task",
            "estimator",
            "n_instances",
            "n_components",
            "n_options",
            "accuracy",
            "mse",
            "bias",
            "diversity",
            "majority_accuracy",
            "majority_option",
        )
        .sort("model", "task", "estimator")
    )


def _module_shares(sums: pl.DataFrame, counts: pl.DataFrame) -> pl.DataFrame:
    """bias_X, diversity_X (means over instances and components of kind X) and the shares
    share_X = |X| bias_X / (L bias) = sum over X / sum over all components (paper Eqs. 9-10,
    Fig. 4), from the per-partition sums."""
    by = ["model", "task", "estimator"]
    n = pl.col("n_instances") * pl.col("n_components")
    return (
        sums.join(counts, on=by)
        .with_columns(
            (pl.col("bias_sum") / n).alias("bias"),
            (pl.col("diversity_sum") / n).alias("diversity"),
            (pl.col("bias_sum") / pl.col("bias_sum").sum().over(by)).alias("bias_share"),
            (pl.col("diversity_sum") / pl.col("diversity_sum").sum().over(by)).alias(
                "diversity_share"
            ),
        )
        .select(*by, "kind", "n_components", "bias", "diversity", "bias_share", "diversity_share")
        .sort(*by, "kind")
    )


def scores(
    store: StoreLike, models: Iterable[str] = (), tasks: Iterable[str] = (), lens: Lens = "final"
) -> pl.DataFrame:
    """Per (model, task, estimator): full-stack accuracy, MSE, bias and diversity with the
    majority-class baseline (``analyze(...).scores``)."""
    return analyze(store, models, tasks, lens).scores


def junction_curves(
    store: StoreLike, models: Iterable[str] = (), tasks: Iterable[str] = (), lens: Lens = "final"
) -> pl.DataFrame:
    """Per (model, task, estimator, instance, j): the layer-addition scores of every instance
    before averaging (large: N x L x 2 rows per partition)."""
    st = open_store(store)
    return pl.concat(
        [_tagged(instance_curves(info, lens), info) for info in st.select(models, tasks)]
    )


def task_summary(results: Results, estimator: str = "paper") -> pl.DataFrame:
    """One row per (model, task) for people: accuracy beside the majority-class baseline, MSE,
    bias and diversity of ``estimator``, and the saturation depth of accuracy."""
    return (
        results.scores.filter(pl.col("estimator") == estimator)
        .join(
            results.saturation.select("model", "task", "saturation_j", "saturation_fraction"),
            on=["model", "task"],
        )
        .select(
            "model",
            "task",
            "n_instances",
            "n_components",
            "accuracy",
            "majority_accuracy",
            "mse",
            "bias",
            "diversity",
            "saturation_j",
            "saturation_fraction",
        )
    )


def ls(store: StoreLike) -> pl.DataFrame:
    """What the store holds: one row per (model, task) with instance counts and dates."""
    return (
        open_store(store)
        .manifests()
        .select(
            "model_id",
            "task",
            "n_done",
            "n_requested",
            "n_components",
            "n_options",
            "n_params",
            "dtype",
            "created_at",
        )
    )


def query(
    store: StoreLike, sql: str, models: Iterable[str] = (), tasks: Iterable[str] = ()
) -> pl.DataFrame:
    """Run SQL against the views ``components``, ``instances`` and ``manifests`` (DuckDB)."""
    return open_store(store).duckdb(models, tasks).sql(sql).pl()
