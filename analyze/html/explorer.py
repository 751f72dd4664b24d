"""The data of the HTML report's per-instance explorer: for each (model, task), a bounded,
deterministic sample of instances stratified by correct / wrong, with every component's option
logits, the model's logits, the prompt and, where extracted, the heads and the layer skips.

Arrays are embedded as base64 of little-endian float32 (the store's own values, bit for bit; the
page decodes them with a ``Float32Array``).
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import polars as pl

from layerdiv.analyze.registry import map_partitions
from layerdiv.store import PartitionInfo

DEFAULT_INSTANCES = 200
"""Instances per (model, task) the explorer embeds unless ``--explorer-instances`` says
otherwise."""

LATE = 0.5
"""An instance *flips late* when its running prediction settles on the final answer after this
fraction of the junctions (:func:`settle_junction`)."""


def stratified_sample(correct: np.ndarray, n: int | None) -> np.ndarray:
    """Positions of at most ``n`` instances (all for None), as many correct and wrong ones as
    their shares give (at least one of each kind present), evenly spaced within each kind;
    deterministic, in ascending order."""
    total = len(correct)
    if n is None or n >= total:
        return np.arange(total)
    groups = [np.flatnonzero(correct), np.flatnonzero(~correct)]
    wanted = [round(n * len(g) / total) for g in groups]
    wanted = [min(len(g), max(w, 1 if len(g) else 0)) for g, w in zip(groups, wanted, strict=True)]
    while sum(wanted) > n:  # the minimum of one may overshoot by one
        wanted[int(np.argmax(wanted))] -= 1
    picks = [
        g[np.linspace(0, len(g) - 1, w).round().astype(int)]
        for g, w in zip(groups, wanted, strict=True)
        if w
    ]
    return np.sort(np.concatenate(picks)) if picks else np.arange(0)


def settle_junction(logits: np.ndarray) -> np.ndarray:
    """For (N, C, K) component logits u_c[k]: the first junction j (1-based) from which the
    running prediction argmax_k sum_(c' <= c) u_c'[k] equals the final prediction at every
    later junction (N,). The final norm's scale is frozen (methods §1, paper Eqs. 2-3), so
    the running sums are the prefix logits of scale ``final``."""
    running = np.cumsum(logits.astype(np.float64), axis=1).argmax(axis=2)
    same = running == running[:, -1:]
    # The last junction that differs from the final prediction (-1 when none does).
    differs = ~same
    last_diff = np.where(
        differs.any(axis=1), logits.shape[1] - 1 - differs[:, ::-1].argmax(axis=1), -1
    )
    return last_diff + 2


def _b64(values: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")


def _dense(frame: pl.DataFrame, keys: list[str], shape: tuple[int, ...]) -> np.ndarray | None:
    """``logit`` of long rows sorted by ``keys`` into an array of ``shape``; None when the rows
    do not fill it (an optional table stored for some of the instances only)."""
    if frame.height != int(np.prod(shape)):
        return None
    return frame.sort(keys)["logit"].to_numpy().reshape(shape)


def partition_data(info: PartitionInfo, n: int | None) -> dict[str, Any]:
    """The explorer's data of one partition (:data:`DEFAULT_INSTANCES` at most by default)."""
    m = info.manifest
    k_opts, n_comp = len(m.options), len(m.components)
    has_prompt = m.schema_version >= 3
    wanted = ["instance", "gold", "model_logits", *(["prompt"] if has_prompt else [])]
    comps, inst = info.read(["logit"], wanted)  # every cell once, sorted (or StoreError)
    every = comps["logit"].to_numpy().reshape(inst.height, n_comp, k_opts)
    pred_all = every.astype(np.float64).sum(axis=1).argmax(axis=1)
    gold_all = inst["gold"].to_numpy().astype(int)
    chosen = stratified_sample(pred_all == gold_all, n)
    ids = inst["instance"].to_numpy()[chosen]
    logits = every[chosen]
    settle = settle_junction(logits)
    data: dict[str, Any] = {
        **dict(info.key.items()),
        "model_id": m.model,
        "schema_version": m.schema_version,
        "options": list(m.options),
        "components": [c.name for c in m.components],
        "n_total": inst.height,
        "instances": ids.tolist(),
        "gold": gold_all[chosen].tolist(),
        "pred": pred_all[chosen].tolist(),
        "settle": settle.tolist(),
        "prompts": inst["prompt"].gather(chosen).to_list() if has_prompt else None,
        "logits": _b64(logits),
        "model_logits": _b64(np.stack(inst["model_logits"].gather(chosen).to_list())),
        "heads": None,
        "skips": None,
    }
    keep = pl.col("instance").is_in(ids.tolist())
    if "heads" in info.tables:
        heads = info.scan("heads").filter(keep).collect()
        attn = sorted(heads["component"].unique().to_list())
        head_ids = sorted(heads["head"].unique().to_list())
        shape = (len(ids), len(attn), len(head_ids), k_opts)
        values = _dense(heads, ["instance", "component", "head", "option"], shape)
        if values is not None:
            data["heads"] = {"components": attn, "head_ids": head_ids, "logits": _b64(values)}
    if "skips" in info.tables:
        skips = info.scan("skips").filter(keep).collect()
        blocks = skips["layer"].n_unique()
        values = _dense(skips, ["instance", "layer", "option"], (len(ids), blocks, k_opts))
        if values is not None:
            data["skips"] = {"n_blocks": blocks, "logits": _b64(values)}
    return data


def explorer_data(parts: list[PartitionInfo], n: int | None = DEFAULT_INSTANCES) -> dict[str, Any]:
    """The explorer's data of every partition (``n`` instances each at most; None: all); those
    with the most optional tables first, so that the explorer opens on one that shows them."""
    parts = sorted(parts, key=lambda p: -len(set(p.tables) & {"heads", "skips"}))
    partitions = list(map_partitions(lambda p: partition_data(p, n), parts))
    return {"per_partition": n, "late": LATE, "partitions": partitions}
