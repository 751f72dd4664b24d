"""``--igrad`` on a text task with an answer or on a choice task: integrated gradients per block
and position (methods §13; ``igrad`` and ``igrad_ends``), with the settings ``--igrad-site`` and
``--igrad-steps`` and ``--igrad-rule`` (recorded in the manifest, compared on a rerun). Its check
of the plan (:func:`plan_igrad`) refuses a text task without an answer, a step count below one and
an unknown rule, and finds each document's answer span; its hooks are
:class:`layerdiv.measurements.igrad.hooks.IgradCapture`, which take gradients (``needs_grad``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import click
import numpy as np
import pyarrow as pa

from layerdiv.errors import LayerdivError
from layerdiv.measurements.registry import Measurement, ModelShape, Planning, Setting
from layerdiv.schemas import IGRAD, IGRAD_ENDS, SUBLAYERS, Rules
from layerdiv.schemas.kinds import KINDS

STEPS = 256
"""Default steps m of the Riemann sum (the depth-efficiency paper's code)."""

RULES = ("riemann", "gauss")
"""The rules ``--igrad-rule`` integrates the path with (:func:`path_points`): the left Riemann
sum of methods §13 (the authors'), or Gauss-Legendre (layerdiv's, beyond the paper)."""
RULE = "riemann"
"""The default rule, and that of a partition extracted before ``--igrad-rule`` existed."""

MAX_STEPS = 65_536
"""Most steps m a run may ask for (256 times the default: each step is a forward and backward
pass per site and block)."""
MAX_NODES = 1_024
"""Most nodes m of the Gauss rule (numpy's ``leggauss`` solves an m x m eigenproblem; a few dozen
nodes already reach float32's rounding on a smooth integrand)."""


class IgradError(LayerdivError, ValueError):
    """Settings of ``--igrad`` that the task or the model cannot follow."""


@dataclass
class IgradRows:
    """One document's integrated gradients: per site and block."""

    sites: tuple[str, ...]
    """The sites (:func:`sites_of`), in the order of the arrays' first axis."""
    attribution: np.ndarray
    """(sites, L, T) IG(l, t) at the document's positions t = 0..T-1 (NaN, stored as null: a
    document whose answer ``max_tokens`` cut off entirely, which has no target)."""
    f_input: np.ndarray
    """(sites, L) f(x), the target with the site's own activation (NaN as above)."""
    f_baseline: np.ndarray
    """(sites, L) f(b), with every position's activation set to the baseline (NaN as above)."""


SITES = ("block",)
"""The default site: every block's output."""


def sites_of(settings: Mapping[str, Any]) -> tuple[str, ...]:
    """The sites of ``settings`` (``igrad_sites``; absent: :data:`SITES`), each once, in the
    order given."""
    return tuple(dict.fromkeys(settings.get("igrad_sites") or SITES))


def rule_of(settings: Mapping[str, Any]) -> str:
    """The integration rule of ``settings`` (``igrad_rule``; absent, as in a store written before
    the option: :data:`RULE`); refuses (one line) a rule not in :data:`RULES`."""
    rule = str(settings.get("igrad_rule") or RULE)
    if rule not in RULES:
        raise IgradError(
            f"--igrad-rule {rule}: no such integration rule; give one of {', '.join(RULES)} "
            f"(default {RULE})"
        )
    return rule


def path_points(settings: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """The path's points alpha_k (ascending, the first alpha = 0: f(b)) and their weights w_k,
    IG(l, t) = sum_d (x - b)[t, d] sum_k w_k df/dx[t, d] at x(alpha_k) (methods §13), for the
    ``igrad_steps`` m and rule (:func:`rule_of`) of ``settings``: ``riemann`` alpha_k = k/m,
    k = 0..m-1, w_k = 1/m (m points); ``gauss`` the m Gauss-Legendre nodes and weights mapped
    to [0, 1] (exact for a polynomial integrand of degree 2m - 1), after alpha = 0 of weight 0,
    which gives f(b) only (m + 1 points)."""
    steps, rule = int(settings["igrad_steps"]), rule_of(settings)
    if rule == "riemann":
        return np.arange(steps) / steps, np.full(steps, 1 / steps)
    nodes, weights = np.polynomial.legendre.leggauss(steps)
    return np.concatenate([[0.0], (nodes + 1) / 2]), np.concatenate([[0.0], weights / 2])


def _site_key(docs: np.ndarray, sites: Sequence[str], blocks: int, each: np.ndarray) -> dict:
    """The key columns (doc, sublayer, block) of documents ``docs``, the row of each (doc, site,
    block) repeated ``each[i]`` times (``each``: one count per document)."""
    codes = np.array([SUBLAYERS.index(s) for s in sites], np.int8)
    cells = len(sites) * blocks
    repeat = np.repeat(each, cells)
    return {
        "doc": pa.array(np.repeat(np.repeat(docs.astype(np.int32), cells), repeat)),
        "sublayer": pa.DictionaryArray.from_arrays(
            pa.array(np.repeat(np.tile(np.repeat(codes, blocks), len(docs)), repeat)),
            pa.array(SUBLAYERS, pa.string()),
        ),
        "block": pa.array(
            np.repeat(np.tile(np.arange(blocks, dtype=np.int16), len(docs) * len(sites)), repeat)
        ),
    }


def igrad_rows(docs: Sequence[int], values: Sequence[IgradRows]) -> dict[str, pa.Table]:
    """The rows of :data:`~layerdiv.schemas.IGRAD` (doc, sublayer, block, pos) and
    :data:`~layerdiv.schemas.IGRAD_ENDS` (doc, sublayer, block) of documents ``docs`` (ascending)
    from each one's :class:`IgradRows`."""
    doc, sites = np.asarray(docs), values[0].sites
    blocks = values[0].f_input.shape[1]
    lengths = np.array([v.attribution.shape[2] for v in values])
    pos = [np.tile(np.arange(n, dtype=np.int32), len(sites) * blocks) for n in lengths]

    def values_of(attr: str) -> pa.Array:  # NaN (no measurable answer) as null
        flat = [np.asarray(getattr(v, attr), np.float32).reshape(-1) for v in values]
        return pa.array(np.concatenate(flat), from_pandas=True)

    return {
        "igrad": pa.table(
            {
                **_site_key(doc, sites, blocks, lengths),
                "pos": pa.array(np.concatenate(pos)),
                "attribution": values_of("attribution"),
            },
            schema=IGRAD,
        ),
        "igrad_ends": pa.table(
            {
                **_site_key(doc, sites, blocks, np.ones(len(doc), np.int64)),
                "f_input": values_of("f_input"),
                "f_baseline": values_of("f_baseline"),
            },
            schema=IGRAD_ENDS,
        ),
    }


def igrad_row_counts(
    rows: Mapping[str, int], blocks: int, settings: Mapping[str, Any]
) -> tuple[str, str] | None:
    """``igrad`` holds a row per token, site and block of the chunk's documents (a choice task:
    whole rows per site and block of each instance, whose prompt tokens the chunk does not
    count), ``igrad_ends`` one per document or instance, site and block."""
    if "igrad" not in rows and "igrad_ends" not in rows:
        return None
    cells = len(sites_of(settings)) * blocks
    text = (("igrad", "tokens"), ("igrad_ends", "documents"))
    for table, unit in (*text, ("igrad_ends", "instances")):
        found, units = rows.get(table), rows.get(unit)
        if found is not None and units is not None and found != units * cells:
            return table, (
                f"{found} rows where the chunk's {units} {unit} need {units * cells} (one per "
                "site and block)"
            )
    found = rows.get("igrad")
    if "instances" in rows and found is not None and (found == 0 or found % cells):
        return "igrad", f"{found} rows are not whole rows for each site and block"
    return None


def plan_igrad(plan: Planning) -> list[tuple[int, int]] | None:
    """``--igrad``'s check of a task's plan: refuses an unknown rule, a step count outside
    1..:data:`MAX_STEPS` (the Gauss rule: :data:`MAX_NODES`) and a text task without an answer;
    per document of a text task, its answer's start s and length A (methods §10), with a note
    where ``max_tokens`` cuts answers short (their targets sum over the answer tokens kept; a
    document with none kept is stored as missing: null f and attributions); None for a choice
    task."""
    steps, gauss = plan.settings["igrad_steps"], rule_of(plan.settings) == "gauss"
    most, rule, points = (
        (MAX_NODES, "Gauss rule", "nodes") if gauss else (MAX_STEPS, "Riemann sum", "steps")
    )
    if not 1 <= steps <= most:
        raise IgradError(
            f"--igrad-steps {steps}: the {rule} takes 1 to {most} {points}; give a "
            f"number in that range (default {STEPS})"
        )
    if KINDS[plan.task.kind].scored:
        return None
    spans = plan.require_answers(
        "--igrad's target is the probability of the answer's tokens", "drop --igrad"
    )
    cap = plan.task.max_tokens
    cut = [doc for doc, (s, a) in enumerate(spans) if cap is not None and s < cap < s + a]
    if cut:
        plan.notes.append(
            f"{len(cut)} of {len(spans)} documents' answers are cut short by max_tokens {cap} "
            f"(the first: document {cut[0]}): --igrad's target sums over the answer tokens kept"
        )
    return spans


def check_sites(sites: Sequence[str], adapter: Any, blocks: Sequence[Any]) -> None:
    """Refuse (one line) a site whose module the model's blocks lack (``attn``, ``mlp``: the
    adapter's path to it)."""
    for site in sites:
        if site == "block":
            continue
        path = getattr(adapter, site, None)
        try:
            for block in blocks:
                for part in (path or "").split("."):
                    block = getattr(block, part)
        except AttributeError:
            path = None
        if not path:
            raise IgradError(
                f"--igrad-site {site}: this {adapter.family} model's blocks have no separate "
                f"{site} output; use --igrad-site block"
            )


def igrad_cost(shape: ModelShape, kind: str, tokens: int, settings: Mapping[str, Any]) -> float:
    """FLOPs of the integrated gradients of a document of ``tokens`` tokens: the pass with
    gradients on (one more forward), then per site and block l, the points of the path
    (:func:`path_points`; alpha = 1 is the clean pass) each run forward and backward (the input
    gradients only: the weights' FLOPs again, twice the attention's for its three products)
    through the blocks after the site (with block l itself for ``attn`` and ``mlp``) and the
    readout of the answer forward and backward (counted as ``tokens`` / 4 positions; a choice
    task: the last prompt token)."""
    L, points = shape.layers, len(path_points(settings)[0])
    answer = shape.readout(1 if KINDS[kind].scored else max(1, tokens // 4))
    block = 2 * shape.block(tokens) + shape.attention * tokens * (tokens + 1) / 2
    total = shape.forward(tokens)
    for site in sites_of(settings):
        runs = L * (L - 1) / 2 if site == "block" else L * (L + 1) / 2
        total += points * (runs * block + 2 * L * answer)
    return total


IGRAD_MEASUREMENT = Measurement(
    name="igrad",
    flag="--igrad",
    help="Text tasks with an answer, choice tasks: also store the integrated gradients of "
    "the answer's (the gold option's) probability w.r.t. every block's output at every "
    "position (methods §13; forward and backward passes per step, block and site: long).",
    tables={"text": ("igrad", "igrad_ends"), "choice": ("igrad", "igrad_ends")},
    settings=(
        Setting(
            "igrad_sites",
            click.Option(
                ["--igrad-site", "igrad_sites"],
                type=click.Choice(list(SUBLAYERS)),
                multiple=True,
                help="With --igrad: the activation attributed: the block's output (default), "
                "its attention's or its MLP's output; repeat for several.",
            ),
            SITES,
            unordered=True,
        ),
        Setting(
            "igrad_steps",
            click.Option(
                ["--igrad-steps"],
                type=int,
                default=None,
                help=f"With --igrad: steps m of the path's integral: points of the Riemann "
                f"sum, nodes of the Gauss rule (default {STEPS}).",
            ),
            STEPS,
        ),
        Setting(
            "igrad_rule",
            click.Option(
                ["--igrad-rule"],
                type=click.Choice(list(RULES)),
                default=None,
                help="With --igrad: how the path's integral is summed: the left Riemann sum "
                f"of methods §13 (default {RULE}), or Gauss-Legendre nodes on [0, 1] (gauss: "
                "layerdiv's, not the paper's; smaller completeness gaps where the integrand "
                "is smooth at the nodes' spacing).",
            ),
            RULE,
        ),
    ),
    needs_grad=True,
    attribution=True,
    attach=f"{__name__}.hooks:IgradCapture",
    rows=igrad_rows,
    check_rows=igrad_row_counts,
    flops=igrad_cost,
    plan_check=plan_igrad,
    rules={
        "igrad": Rules(grid=(("sublayer", "shared"), ("block", "blocks"), ("pos", "tokens"))),
        "igrad_ends": Rules(
            grid=(("sublayer", "shared"), ("block", "blocks")),
            bounds={"f_input": (0, "A"), "f_baseline": (0, "A")},
        ),
    },
    since={"igrad": 7, "igrad_ends": 7},
    order=70,
)
