"""A measurement laid out as a built-in one is (``measurements/<name>/``: the declaration in
``__init__.py``, its hooks in ``hooks.py``, its analysis and figure in ``analysis.py``), written
here into a folder of its own and registered by one entry point line per group, as layerdiv's own
``pyproject.toml`` registers the built-in ones: its table is stored by its declaration's rows,
and its section and figure reach ``report.md`` and ``report.html`` without its hooks (torch) ever
being imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

DECLARATION = '''
"""``--toy``: per instance and block, a made-up score."""

import numpy as np
import pyarrow as pa

from layerdiv.measurements import Measurement

SCHEMA = pa.schema([("instance", pa.int32()), ("layer", pa.int16()), ("score", pa.float32())])


def toy_rows(ids, values):
    """Rows (instance, layer) of ``toy_scores`` from each instance's (L,) scores."""
    scores = np.stack([np.asarray(v, np.float32) for v in values])
    n, blocks = scores.shape
    return {"toy_scores": pa.table({
        "instance": pa.array(np.repeat(np.asarray(ids, np.int32), blocks)),
        "layer": pa.array(np.tile(np.arange(blocks, dtype=np.int16), n)),
        "score": pa.array(scores.reshape(-1)),
    }, schema=SCHEMA)}


TOY = Measurement(
    name="toy",
    flag="--toy",
    help="Also store a made-up score per block.",
    tables={"choice": ("toy_scores",)},
    schemas={"toy_scores": SCHEMA},
    since={"toy_scores": 7},
    attach=f"{__name__}.hooks:ToyCapture",
    rows=toy_rows,
)
'''

HOOKS = '''
"""The hooks: the only module of the folder that imports torch."""

import torch


class ToyCapture:
    def __init__(self, ctx):
        self.values = torch.zeros(0)
'''

ANALYSIS = '''
"""The toy's analysis: the mean score per block, and its figure."""

import polars as pl

from layerdiv.analyze import plots
from layerdiv.analyze.frames import tag
from layerdiv.analyze.registry import Analysis, map_partitions


def means(info):
    scores = info.scan("toy_scores").group_by("layer").agg(pl.col("score").mean()).sort("layer")
    return tag(scores.collect(), info)


def tables(ctx, prior):
    return {"toy_means": pl.concat(list(map_partitions(means, ctx.parts)))}


def spec(table):
    panel = plots.Panel("Mean toy score", xlabel="block", ylabel="score")
    for label, color in plots.model_colors(sorted(table["task"].unique())).items():
        sub = table.filter(pl.col("task") == label)
        panel.series.append(
            plots.Series(label, sub["layer"].to_list(), sub["score"].to_list(), color)
        )
    return plots.Figure("Toy scores per block", [panel])


def report(ctx):
    table = ctx.tables["toy_means"]
    return f"Toy scores of {table['task'].n_unique()} task(s).\\n\\n" + plots.figure_link(
        ctx, "toy.png", "Toy scores", lambda: spec(table)
    )


ANALYSIS = Analysis(
    name="toy", title="Toy scores", tables=tables, report=report, needs=("toy_scores",)
)
'''

SCRIPT = """
import json, sys
import numpy as np
from layerdiv.analyze.synthetic import random_partition, write_partition
from layerdiv.cli import main

store, out = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(0)
for task, toy in (("boolq", True), ("mnli", False)):
    logits, gold, rms, kinds = random_partition(rng, 12, 3, 2)
    scores = {"toy_scores": rng.random((12, 3))} if toy else {}
    write_partition(store, "org/m", task, logits, gold, kinds, rms, chunk=6, optional=scores)
main(["report", "--store", store, "--out", out, "--format", "md,html"], standalone_mode=False)
print(json.dumps(sorted(m for m in sys.modules if m.startswith(("toy_depth", "torch")))))
"""


def test_a_measurement_folder_reaches_the_report(tmp_path: Path) -> None:
    site = tmp_path / "site"
    folder = site / "toy_depth"
    folder.mkdir(parents=True)
    for name, text in (("__init__", DECLARATION), ("hooks", HOOKS), ("analysis", ANALYSIS)):
        (folder / f"{name}.py").write_text(textwrap.dedent(text))
    info = site / "toy_depth-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-depth\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[layerdiv.measurements]\ntoy = toy_depth:TOY\n"
        "[layerdiv.analyses]\ntoy = toy_depth.analysis:ANALYSIS\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
    }
    store, out = tmp_path / "store", tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(store), str(out)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == '["toy_depth", "toy_depth.analysis"]'
    text = (out / "report.md").read_text()
    section = text[text.index("## Toy scores") :]
    note = section.split("\n\n")[1]  # the partition without the table, named with the flag
    assert note.startswith("Toy scores: not extracted for ") and "mnli" in note
    assert note.endswith("(`layerdiv extract --toy` adds it).")
    assert "Toy scores of 1 task(s)." in section and "](figures/toy.png)" in section
    assert (out / "figures" / "toy.png").stat().st_size > 5_000
    page = (out / "report.html").read_text()
    assert 'data-figure="toy.png"' in page and "Toy scores per block" in page
