# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Tutorial: the demo store in a notebook
#
# This notebook explores the store that `make demo` writes (`layerdiv-demo/store`: SmolLM2-135M-Instruct
# and Gemma 3 270M on three labelled tasks, 120 instances each, and on running text) with layerdiv's Python API: the store's tables as
# Polars frames, your own SQL, then the analysis and its result tables. Nothing here needs torch or
# a GPU; each cell runs in a fraction of a second once the store exists.
#
# Open it in Jupyter from the repository root (it is a [jupytext](https://jupytext.readthedocs.io)
# percent-format script: `jupytext --to ipynb docs/tutorial.py` makes a `.ipynb` of it). The site's
# copy of this page was executed when the site was built.

# %%
import os
from pathlib import Path

import matplotlib.pyplot as plt
import polars as pl

import layerdiv

# What `make demo` writes, relative to the repository root (`make test` builds this
# site on its quick demo, LAYERDIV_DEMO); where it is missing, this builds it as
# `make demo` does (minutes on 2 CPU cores).
DEMO = Path(os.environ.get("LAYERDIV_DEMO", "layerdiv-demo"))
if not (DEMO / "store").exists():
    from layerdiv.demo import run_demo

    run_demo(DEMO, None, seed=0)

# %% [markdown]
# ## The store
#
# `layerdiv.Store` opens a store folder (or the URL of a published one, `s3://...`) and checks
# every partition's manifest and every Parquet file's columns before serving anything. One
# partition is one (model, task); its manifest records how it was extracted.

# %%
store = layerdiv.Store(DEMO / "store")
store

# %%
store.manifests().select(
    "model_id", "task", "n_done", "n_components", "n_options", "dtype"
)

# %% [markdown]
# ## Tables as Polars frames
#
# `store.scan(table)` is a Polars `LazyFrame` over every partition of one table (the columns are
# listed on [The store](../store/) page); nothing is read until `collect()`. `components` holds one
# row per (instance, component, option): `logit` is the component's contribution u_c[k] to the
# option's logit, so the components of an instance sum to the model's own option logits.

# %%
components = store.scan("components")
components.head(3).collect()

# %% [markdown]
# The full model's prediction is the option with the largest sum of component logits. Its
# accuracy, from the store alone:

# %%
from layerdiv.store.key import KEY  # the partition key columns: model, task, ...

keys = [*KEY, "instance"]
prediction = (
    components.group_by([*keys, "option"])
    .agg(pl.col("logit").sum())
    .sort("logit", descending=True)
    .group_by(keys)
    .first()
)
gold = store.scan("instances").select([*keys, "gold"])
(
    prediction.join(gold, on=keys)
    .group_by(KEY)
    .agg(
        accuracy=(pl.col("option") == pl.col("gold")).mean(),
        n=pl.len(),
    )
    .sort(KEY)
    .collect()
)

# %% [markdown]
# ## Your own SQL
#
# `layerdiv.query` runs DuckDB SQL over the views `components`, `instances` and `manifests` (and
# `heads`, `skips`, `gram` where the store has them) and returns a Polars frame. The store cannot
# be changed through it: file access is switched off. Which single components, alone, predict
# best?

# %%
layerdiv.query(
    store,
    """
    WITH alone AS (
      SELECT model, task, instance, component, name,
             arg_max(option, logit) AS pred
      FROM components GROUP BY ALL
    )
    SELECT model, task, name, avg((pred = gold)::INT) AS accuracy
    FROM alone JOIN instances USING (model, task, instance)
    GROUP BY model, task, component, name
    QUALIFY row_number() OVER (
      PARTITION BY model, task ORDER BY accuracy DESC, component
    ) <= 3
    ORDER BY model, task, accuracy DESC
    """,
)

# %% [markdown]
# ## The analysis
#
# `layerdiv.run_analysis` runs every registered analysis (the [paper's](../analyses/paper/),
# [how depth is used](../analyses/depth/), [heads](../analyses/heads/)) on the selected partitions,
# as `layerdiv analyze` does. Its `Results` hold one Polars frame per result table; in a notebook
# they show as a summary of the tables with their shapes, and the notes of the analyses (what could
# not be computed, and how to get it).

# %%
r = layerdiv.run_analysis(
    store, models="smollm2-135m-instruct", tasks=["bbc5", "tweets2", "tweets3"]
)
r

# %% [markdown]
# `r.scores`: per (model, task, estimator), the full stack's accuracy, MSE, bias and diversity
# (means over instances; fractions, not percentages). With the `paper` estimator the MSE sits near
# the uniform value and MSE = bias - diversity does not hold; with `ensemble` it holds exactly
# ([the formulas](../analyses/paper/#per-instance-scores-methodsmd-section-2)).

# %%
r.scores.select(
    "task", "estimator", "accuracy", "mse", "bias", "diversity",
    "majority_accuracy",
)

# %% [markdown]
# `r.curves`: the same scores for the first j components, j = 1..L (the layer-addition curves).
# SmolLM2 reaches its accuracy only with its last components:

# %%
paper = r.curves.filter(pl.col("estimator") == "paper").sort("task", "j")
fig, ax = plt.subplots(figsize=(7, 3.5))
for (task,), curve in paper.group_by("task", maintain_order=True):
    ax.plot(curve["relative_depth"], 100 * curve["accuracy"], label=task)
ax.set_xlabel("relative depth j / L")
ax.set_ylabel("accuracy of the first j components (%)")
ax.legend()
plt.show()

# %% [markdown]
# ## Next
#
# - `r.write(folder, "parquet", ...)` writes every table as `layerdiv analyze --out` does; the
#   [Python API reference](../api/) lists every function and its arguments.
# - The [depth](../analyses/depth/) and [heads](../analyses/heads/) pages describe the other
#   analyses' tables; `layerdiv extract --skips` adds the block-skipping effects to the demo's
#   other tasks (`tweets2-skips`, the first 20 instances of `tweets2`, has them).
