"""Tasks that overlap: a partition whose instances are all instances of another partition of the
same model and revision (the same prompts, or for running text the same token sequences) adds
no new data to an average over tasks; it would count those instances twice.

Detected once, from the stored data (never from task names), into the ``subset_of`` column of
the ``manifests`` table (:func:`mark_subsets`); every average over tasks reads its rows through
:func:`independent`, and a section whose only data is such a subset says so with its n
(:func:`lone_subsets`).
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from layerdiv.store import PartitionInfo
from layerdiv.store.key import KEY, MODEL_KEY


def instance_hashes(info: PartitionInfo) -> pl.Series:
    """One hash per stored instance of a partition: of its prompt and gold option on a choice
    task (schema version 3 on; an older partition stored no prompt and gives an empty series),
    of its document's token sequence on running text."""
    if info.kind.scored:
        rows = info.scan("instances").select("prompt", "gold").drop_nulls().collect()
        return rows.select(pl.struct("prompt", "gold").hash(seed=0))["prompt"]
    tokens = info.scan("tokens").select("doc", "pos", "token").collect()
    docs = tokens.sort("doc", "pos").group_by("doc", maintain_order=True).agg("token")
    return docs["token"].hash(seed=0)


def subsets(parts: Sequence[PartitionInfo]) -> pl.DataFrame:
    """Per partition whose instances are all among another partition's of the same model,
    revision and task kind: its key, ``subset_of`` (every such other task, sorted) and
    ``n_instances``. Two partitions with the same instances: the later task name is the subset."""

    def peers(p: PartitionInfo) -> list[PartitionInfo]:
        same = (p.model, p.key.revision, p.manifest.kind)
        return [
            q for q in parts if q is not p and (q.model, q.key.revision, q.manifest.kind) == same
        ]

    # only partitions that have a peer are read
    hashes = {p.key.values(): set(instance_hashes(p).to_list()) for p in parts if peers(p)}
    rows = []
    for p in parts:
        mine = hashes.get(p.key.values())
        if not mine:
            continue
        within = [
            q.task
            for q in peers(p)
            if mine <= (theirs := hashes[q.key.values()])
            and (len(mine) < len(theirs) or q.task < p.task)
        ]
        if within:
            rows.append(
                {**dict(p.key.items()), "subset_of": sorted(within), "n_instances": len(mine)}
            )
    schema = pl.Schema(
        {
            **dict.fromkeys(KEY, pl.String()),
            "subset_of": pl.List(pl.String),
            "n_instances": pl.Int64(),
        }
    )
    return pl.DataFrame(rows, schema=schema)


def mark_subsets(manifests: pl.DataFrame, parts: Sequence[PartitionInfo]) -> pl.DataFrame:
    """``manifests`` with the ``subset_of`` column of :func:`subsets` (null: no other partition
    holds all of its instances)."""
    found = subsets(parts).select(*KEY, "subset_of")
    return manifests.join(found, on=[*KEY], how="left")


def _covered(frame: pl.DataFrame, manifests: pl.DataFrame, by: Sequence[str]) -> pl.DataFrame:
    """The keys (and ``by`` values) of ``frame``'s rows of a partition that is a subset of
    another task whose rows ``frame`` holds with the same ``by`` values."""
    if "subset_of" not in manifests.columns:
        return frame.select(*KEY, *by).clear()
    held = frame.select(*MODEL_KEY, *by, pl.col("task").alias("subset_of")).unique()
    subsets = (
        manifests.filter(pl.col("subset_of").is_not_null())
        .select(*KEY, "subset_of")
        .explode("subset_of")
    )
    return (
        frame.select(*KEY, *by)
        .unique()
        .join(subsets, on=[*KEY])
        .join(held, on=[*MODEL_KEY, *by, "subset_of"], how="semi")
        .select(*KEY, *by)
        .unique()
    )


def independent(
    frame: pl.DataFrame, manifests: pl.DataFrame, by: Sequence[str] = ()
) -> pl.DataFrame:
    """``frame`` (with the key columns) without the rows of a partition whose instances are a
    subset of another task's that ``frame`` also holds: what every average over tasks reads.
    With ``by`` (columns of a setting the average keeps apart, e.g. the lens readout), only
    where the larger task has rows of the same setting. A subset whose larger task lacks these
    rows stays (it is then their only data)."""
    return frame.join(_covered(frame, manifests, by), on=[*KEY, *by], how="anti")


def subset_notes(manifests: pl.DataFrame, names: dict[str, str]) -> list[str]:
    """A line per partition marked ``subset_of``: its n, the tasks that hold its instances, and
    that averages over tasks leave it out (``names``: slug -> model id)."""
    if "subset_of" not in manifests.columns:
        return []
    return [
        f"{r['task']} ({names.get(r['model'], r['model'])}): its {r['n_done']} "
        f"{'documents' if r['kind'] == 'text' else 'instances'} are all also in "
        f"{' and '.join(r['subset_of'])} (same model, same "
        f"{'token sequences' if r['kind'] == 'text' else 'prompts'}); its own rows are shown, and "
        "every average over tasks leaves it out"
        for r in manifests.filter(pl.col("subset_of").is_not_null())
        .sort(*KEY)
        .iter_rows(named=True)
    ]


def left_out(frame: pl.DataFrame, manifests: pl.DataFrame) -> str:
    """A sentence naming the tasks of ``frame`` that :func:`independent` leaves out of its
    averages over tasks ("" when none)."""
    covered = _covered(frame, manifests, ())
    if not covered.height:
        return ""
    tasks = ", ".join(sorted(set(covered["task"])))
    return f"Averages over tasks leave out {tasks}: every instance of it is in another task."


def lone_subsets(frame: pl.DataFrame, manifests: pl.DataFrame, by: Sequence[str] = ()) -> str:
    """A sentence naming the partitions of ``frame`` that are a subset of another task and the
    only data here (:func:`independent` keeps them), with their n ("" when there is none)."""
    if "subset_of" not in manifests.columns:
        return ""
    kept = independent(frame, manifests, by).select(*KEY).unique()
    lone = manifests.join(kept, on=[*KEY], how="semi").filter(pl.col("subset_of").is_not_null())
    said = [
        f"{r['task']} alone, n = {r['n_done']} instances ({r['model']}; a subset of "
        f"{' and '.join(r['subset_of'])}, which lacks these measurements)"
        for r in lone.sort(*KEY).iter_rows(named=True)
    ]
    return ("; ".join(said) + ".") if said else ""


def one_verdict(
    frame: pl.DataFrame, manifests: pl.DataFrame, by: Sequence[str] = ()
) -> tuple[pl.DataFrame, str]:
    """The rows of ``frame`` that get a verdict, one per set of tasks with the same instances
    (:func:`independent`: the largest task's, with ``by`` as there), and a line naming the tasks
    left out and whose verdict is theirs ("" when none): a verdict counted once per task would
    count the same documents or instances again."""
    covered = _covered(frame, manifests, by)
    if not covered.height:
        return frame, ""
    said = (
        covered.select(*KEY)
        .unique()
        .join(manifests.select(*KEY, "subset_of", "kind"), on=[*KEY])
        .sort(*KEY)
        .iter_rows(named=True)
    )
    lines = [
        f"{r['task']} (its {'documents' if r['kind'] == 'text' else 'instances'} are all in "
        f"{' and '.join(r['subset_of'])})"
        for r in said
    ]
    return independent(frame, manifests, by), (
        "- No verdict of its own for " + "; ".join(lines) + ": the verdict of the task that "
        "holds them is theirs (counted once, not once per task)."
    )
