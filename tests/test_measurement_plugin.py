"""A measurement defined here, outside the package, and registered the public way
(``layerdiv.measurements.register`` in this process, the ``layerdiv.measurements`` entry point
group in a fresh one): ``extract --help`` offers it, ``extract`` writes it and resumes it after a
kill -9, ``ls`` lists it, ``query`` reads it, ``merge`` merges it, and a rerun with other settings
is refused before anything is written. Its analysis, figure and report section, defined here too,
come through the ``layerdiv.analyses`` entry point group into ``report.md`` and ``report.html``.
docs/development.md, "Adding a measurement" and "Adding an analysis", walk through this module."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import click
import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from click.testing import CliRunner
from polars.testing import assert_frame_equal

from layerdiv.analyze import plots
from layerdiv.analyze.frames import tag
from layerdiv.analyze.registry import Analysis, Context, ReportContext, map_partitions
from layerdiv.cli import main
from layerdiv.measurements import Attachment, Measurement, Setting, register, unregister
from layerdiv.store import PartitionInfo, Store

BLOCK_NORMS_SCHEMA = pa.schema(
    [
        pa.field("instance", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("norm", pa.float32(), nullable=False),
    ],
    metadata={"layerdiv.table": "block_norms"},
)
"""One row per (instance, block): the p-norm of the block's output at the last prompt token."""


class BlockNorms:
    """Forward hooks on every decoder block; the p-norm of each block's output at the last
    position (prompts are left-padded, so that is the last prompt token)."""

    def __init__(self, ctx: Attachment) -> None:
        from layerdiv.extract.adapters import get_module

        self.ord = int(ctx.settings["norm_ord"])
        self.norms: list[Any] = []
        blocks = get_module(ctx.model, ctx.adapter.blocks)
        self.handles = [b.register_forward_hook(self._hook) for b in blocks]

    def _hook(self, module: Any, args: Any, out: Any) -> None:
        hidden = out[0] if isinstance(out, tuple) else out
        self.norms.append(hidden[:, -1].float().norm(p=self.ord, dim=-1))

    def reset(self) -> None:
        self.norms = []

    def result(self) -> Sequence[Any]:
        import torch

        return list(torch.stack(self.norms, dim=1).cpu().numpy())  # one (L,) row per batch row

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def block_norm_rows(ids: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``block_norms`` rows of instances ``ids``."""
    norms = np.stack(values)  # (instances, L)
    n_layers = norms.shape[1]
    return {
        "block_norms": pa.table(
            {
                "instance": pa.array(np.repeat(ids, n_layers).astype(np.int32)),
                "layer": pa.array(np.tile(np.arange(n_layers), len(ids)).astype(np.int16)),
                "norm": pa.array(norms.reshape(-1).astype(np.float32)),
            },
            schema=BLOCK_NORMS_SCHEMA,
        )
    }


BLOCK_NORMS = Measurement(
    name="block_norms",
    flag="--block-norms",
    help="Also store the p-norm of every block's output at the last prompt token.",
    tables={"choice": ("block_norms",)},
    schemas={"block_norms": BLOCK_NORMS_SCHEMA},
    settings=(
        Setting(
            "norm_ord",
            click.Option(
                ["--norm-ord", "norm_ord"],
                type=int,
                default=None,
                help="With --block-norms: p of the norm (default 2).",
            ),
            2,
        ),
    ),
    attach=BlockNorms,
    rows=block_norm_rows,
)
"""The measurement: the entry point ``block_norms = tests.test_measurement_plugin:BLOCK_NORMS``
in the group ``layerdiv.measurements`` registers it in a fresh process."""


def mean_norms(info: PartitionInfo) -> pl.DataFrame:
    """Per block of one partition: the mean over instances of its output's p-norm."""
    return tag(
        info.scan("block_norms")
        .group_by("layer")
        .agg(pl.col("norm").cast(pl.Float64).mean())
        .sort("layer")
        .collect(),
        info,
    )


def block_norm_tables(ctx: Context, prior: Any) -> dict[str, pl.DataFrame]:
    """The analysis's table ``block_norm_means``: :func:`mean_norms` of every partition it gets
    (those that hold ``block_norms``: its ``needs``)."""
    return {"block_norm_means": pl.concat(list(map_partitions(mean_norms, ctx.parts)))}


def norms_spec(means: pl.DataFrame) -> plots.Figure:
    """The figure: mean block output norm against the block, one curve per (model, task)."""
    panel = plots.Panel("Mean output norm of each block", xlabel="block", ylabel="p-norm")
    labels = sorted(means.select(pl.format("{} {}", "model", "task")).to_series().unique())
    for label, color in plots.model_colors(labels).items():
        sub = means.filter(pl.format("{} {}", "model", "task") == label)
        panel.series.append(
            plots.Series(label, sub["layer"].to_list(), sub["norm"].to_list(), color)
        )
    return plots.Figure("Block output norms at the last prompt token", [panel])


def norms_section(ctx: ReportContext) -> str:
    """The report section: one sentence and the figure."""
    means = ctx.tables["block_norm_means"]
    return (
        f"Mean p-norm of each block's output over {means['task'].n_unique()} task(s).\n\n"
        + plots.figure_link(ctx, "block_norms.png", "Block norms", lambda: norms_spec(means))
    )


BLOCK_NORMS_ANALYSIS = Analysis(
    name="block_norms",
    title="Block output norms",
    tables=block_norm_tables,
    report=norms_section,
    needs=("block_norms",),
)
"""The measurement's analysis: the entry point ``block_norms =
tests.test_measurement_plugin:BLOCK_NORMS_ANALYSIS`` in the group ``layerdiv.analyses`` registers
it in a fresh process."""


@pytest.fixture
def registered() -> Iterator[Measurement]:
    """The measurement, registered in this process for one test."""
    register(BLOCK_NORMS)
    yield BLOCK_NORMS
    unregister(BLOCK_NORMS.name)


def entry_point(folder: Path, analysis: bool = False) -> dict[str, str]:
    """The environment of a fresh process in which an installed distribution's entry point
    registers the measurement (a ``.dist-info`` folder on the path, as pip installs one), and with
    ``analysis`` its analysis too."""
    info = folder / "layerdiv_block_norms-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: layerdiv-block-norms\n"
                                   "Version: 0.1\n")  # fmt: skip
    (info / "entry_points.txt").write_text(
        "[layerdiv.measurements]\nblock_norms = tests.test_measurement_plugin:BLOCK_NORMS\n"
        + (
            "[layerdiv.analyses]\n"
            "block_norms = tests.test_measurement_plugin:BLOCK_NORMS_ANALYSIS\n"
            if analysis
            else ""
        )
    )
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(folder), str(root), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def invoke(*args: str) -> Any:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def norms(store: Path) -> pl.DataFrame:
    return (
        Store(store).scan("block_norms").collect().drop("model", "task").sort("instance", "layer")
    )


def test_a_measurement_outside_the_package(
    registered: Measurement, tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    help_text = invoke("extract", "--help").output
    assert "--block-norms" in help_text and "--norm-ord" in help_text

    n = 120
    task = make_task(tmp_path / "task", n=n)
    model = str(model_dirs("llama"))
    args = ["--model", model, "--task", str(task), "--chunk-size", "4", "--batch-size", "1"]
    whole = tmp_path / "whole"
    done = invoke("extract", *args, "--store", str(whole), "--block-norms", "--norm-ord", "3")
    assert done.exit_code == 0, done.output
    expected = norms(whole)
    assert expected.height == n * 2 and (expected["norm"] > 0).all()  # two blocks
    assert Store(whole).select()[0].manifest.settings == {"block_norms": {"norm_ord": 3}}

    # Written by a fresh process that finds the measurement through its entry point, killed
    # with SIGKILL mid-way, then resumed without the flag (the partition keeps it, and its
    # settings).
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "layerdiv.cli", "extract", *args, "--store", str(killed)]
    env = entry_point(tmp_path / "site")
    proc = subprocess.Popen([*cmd, "--block-norms", "--norm-ord", "3"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + 600  # a loaded machine takes minutes to start it
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(killed.glob("instances/**/part-*.parquet"))) >= 3:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stored_before = len(Store(killed).partitions[0].partition.done_parts())
    # an instances part is its chunk's completion marker, written last: the three seen are
    # three whole chunks (unless the deadline passed first)
    assert 3 <= stored_before < n // 4, "the run must be killed mid-way"
    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert_frame_equal(norms(killed), expected)

    listed = invoke("ls", "--store", str(killed))
    assert listed.exit_code == 0 and "block_norms" in listed.output, listed.output
    sql = "SELECT count(*) AS n, count(DISTINCT instance) AS i FROM block_norms"
    queried = invoke("query", "--store", str(killed), sql)
    assert queried.exit_code == 0 and f"{2 * n}" in queried.output, queried.output

    # Shards merged equal the whole.
    for i in range(2):
        shard = invoke("extract", *args, "--store", str(tmp_path / f"s{i}"), "--shard", f"{i}/2",
                       "--block-norms", "--norm-ord", "3")  # fmt: skip
        assert shard.exit_code == 0, shard.output
    merged = invoke("merge", str(tmp_path / "s0"), str(tmp_path / "s1"),
                    "--into", str(tmp_path / "merged"))  # fmt: skip
    assert merged.exit_code == 0, merged.output
    assert_frame_equal(norms(tmp_path / "merged"), expected)

    # Other settings: refused before anything is written; a shard of other settings is not merged.
    manifest = next(killed.glob("manifests/**/manifest.json"))
    before = {p: p.stat().st_mtime_ns for p in killed.rglob("*") if p.is_file()}
    other = invoke("extract", *args, "--store", str(killed), "--limit", str(n + 8),
                   "--block-norms", "--norm-ord", "1")  # fmt: skip
    assert other.exit_code == 1, other.output
    assert "--norm-ord 3" in other.output and "--norm-ord 1" in other.output, other.output
    assert {p: p.stat().st_mtime_ns for p in killed.rglob("*") if p.is_file()} == before
    assert json.loads(manifest.read_text())["settings"] == {"block_norms": {"norm_ord": 3}}
    odd = invoke("extract", *args, "--store", str(tmp_path / "odd"), "--shard", "1/2",
                 "--block-norms", "--norm-ord", "1")  # fmt: skip
    assert odd.exit_code == 0, odd.output
    refused = invoke("merge", str(tmp_path / "s0"), str(tmp_path / "odd"),
                     "--into", str(tmp_path / "mixed"))  # fmt: skip
    assert refused.exit_code == 1 and "norm_ord" in refused.output, refused.output


def test_it_brings_its_analysis_figure_and_report_section(
    registered: Measurement, tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    store = tmp_path / "store"
    model = ["--model", str(model_dirs("llama")), "--store", str(store), "--batch-size", "4"]
    normed = make_task(tmp_path / "tasks", n=8, stem="normed")
    plain = make_task(tmp_path / "tasks", n=8, stem="plain")
    assert invoke("extract", *model, "--task", str(normed), "--block-norms").exit_code == 0
    assert invoke("extract", *model, "--task", str(plain)).exit_code == 0

    # A fresh process finds the measurement and its analysis through their entry points.
    out = tmp_path / "report"
    cmd = [sys.executable, "-m", "layerdiv.cli", "report", "--store", str(store), "--out",
           str(out), "--format", "md,html"]  # fmt: skip
    done = subprocess.run(
        cmd, env=entry_point(tmp_path / "site", analysis=True), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    text = (out / "report.md").read_text()
    section = text[text.index("## Block output norms") :]
    # the partition extracted without it is named in the registry's one line, with the flag that
    # adds it, at the head of the section computed on the other (not as a warning of the report)
    slug = Store(store).select(tasks=["plain"])[0].key.label
    note = (
        f"Block output norms: not extracted for {slug} (`layerdiv extract --block-norms` adds it)"
    )
    assert section.startswith(
        f"## Block output norms\n\n{note}.\n\nMean p-norm of each block's output over 1"
    )
    assert note not in text[: text.index("## ")]
    assert "](figures/block_norms.png)" in section
    assert (out / "figures" / "block_norms.png").stat().st_size > 5_000
    page = (out / "report.html").read_text()
    assert "Block output norms" in page and 'data-figure="block_norms.png"' in page
    assert "Block output norms at the last prompt token" in page  # the Plotly figure's title

    # The same analysis in this process: its table is the stored norms' means.
    means = mean_norms(Store(store).select(tasks=["normed"])[0])
    expected = norms(store).group_by("layer").agg(pl.col("norm").cast(pl.Float64).mean())
    assert_frame_equal(means.select("layer", "norm"), expected.sort("layer"), rel_tol=1e-9)


def test_its_values_are_of_the_model_pass_alone_beside_the_skips(
    registered: Measurement, tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    """Hooks not bound to the decomposition see the passes with each block skipped (``--skips``
    runs them after the model's own pass): their values are taken before those run."""
    task = make_task(tmp_path / "task", n=6)
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--batch-size", "3"]
    for name, flags in (("plain", []), ("skips", ["--skips"])):
        done = invoke("extract", *args, "--store", str(tmp_path / name), "--block-norms", *flags)
        assert done.exit_code == 0, done.output
    assert Store(tmp_path / "skips").scan("skips").collect().height > 0
    assert_frame_equal(norms(tmp_path / "skips"), norms(tmp_path / "plain"))


def test_a_setting_without_its_measurement_and_a_wrong_kind_are_refused(
    registered: Measurement, tmp_path: Path, model_dirs: Any
) -> None:
    from tests.test_text_extract import text_task

    task = text_task(tmp_path / "t", ["the cat sat on the warm mat"] * 2)
    args = ["extract", "--model", str(model_dirs("llama")), "--task", str(task),
            "--store", str(tmp_path / "s")]  # fmt: skip
    lone = invoke(*args, "--norm-ord", "3")
    assert lone.exit_code == 1 and "--norm-ord sets up --block-norms" in lone.output
    text = invoke(*args, "--block-norms")
    assert text.exit_code == 1 and "applies to choice tasks only" in text.output, text.output
    assert not (tmp_path / "s").exists() or not list((tmp_path / "s").rglob("*.parquet"))


def test_a_taken_name_or_table_is_refused(registered: Measurement) -> None:
    from layerdiv.measurements import MeasurementError

    with pytest.raises(MeasurementError, match="registered already"):
        register(BLOCK_NORMS)
    with pytest.raises(MeasurementError, match="'gram' is taken"):
        register(Measurement("gram2", "--gram2", tables={"choice": ("gram",)}, help="x"))


BLOCK_GRADS_SCHEMA = pa.schema(
    [
        pa.field("instance", pa.int32(), nullable=False),
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("grad_norm", pa.float32(), nullable=False),
    ],
    metadata={"layerdiv.table": "block_grads"},
)
"""One row per (instance, block): the norm of the gradient of the model's top logit at the last
prompt token w.r.t. the block's output (every position)."""


class BlockGrads:
    """A ``layerdiv.measurements.GradientCapture``: in its own pass (gradients on), the first
    block's input is made a leaf that requires a gradient (the extraction's weights require
    none) and every block's output is kept; :meth:`backward` takes the gradient of each row's top
    logit at the last position w.r.t. them (rows are independent: one backward for the batch)."""

    def __init__(self, ctx: Attachment) -> None:
        from layerdiv.extract.adapters import get_module

        blocks = get_module(ctx.model, ctx.adapter.blocks)
        self.outputs: list[Any] = []
        self.norms: Any = None
        self.handles = [blocks[0].register_forward_pre_hook(self._leaf, with_kwargs=True)]
        self.handles += [b.register_forward_hook(self._keep) for b in blocks]

    def _leaf(self, module: Any, args: tuple, kwargs: dict) -> Any:
        import torch

        if not torch.is_grad_enabled():  # every pass but its own
            return None
        if args:
            return (args[0].detach().requires_grad_(), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"].detach().requires_grad_()}

    def _keep(self, module: Any, args: Any, out: Any) -> None:
        import torch

        if torch.is_grad_enabled():
            self.outputs.append(out[0] if isinstance(out, tuple) else out)

    def reset(self) -> None:
        self.outputs, self.norms = [], None

    def backward(self, output: Any) -> None:
        import torch

        target = output.logits[:, -1].max(dim=-1).values.sum()
        grads = torch.autograd.grad(target, self.outputs)
        self.norms = torch.stack([g.flatten(1).norm(dim=-1) for g in grads], dim=1)
        self.outputs = []

    def result(self) -> Sequence[Any]:
        return list(self.norms.cpu().numpy())  # one (L,) row per batch row

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def block_grad_rows(ids: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
    """The ``block_grads`` rows of instances ``ids`` (laid out as ``block_norms``)."""
    rows = block_norm_rows(ids, values)["block_norms"]
    return {"block_grads": rows.rename_columns(BLOCK_GRADS_SCHEMA.names).cast(BLOCK_GRADS_SCHEMA)}


BLOCK_GRADS = Measurement(
    name="block_grads",
    flag="--block-grads",
    help="Also store the norm of the gradient of the top logit w.r.t. every block's output.",
    tables={"choice": ("block_grads",)},
    schemas={"block_grads": BLOCK_GRADS_SCHEMA},
    needs_grad=True,
    attach=BlockGrads,
    rows=block_grad_rows,
    flops=lambda shape, kind, tokens, settings: 3 * shape.forward(tokens),  # forward + backward
)
"""A measurement that needs gradients (``needs_grad``)."""


@pytest.fixture
def gradients() -> Iterator[Measurement]:
    """The gradient measurement, registered in this process for one test."""
    register(BLOCK_GRADS)
    yield BLOCK_GRADS
    unregister(BLOCK_GRADS.name)


def test_a_measurement_that_needs_gradients(
    gradients: Measurement, tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    """Its pass runs out of inference mode: gradients flow, each instance's equal to those of
    its prompt run alone through the model (no padding, no other hooks), with or without
    ``--skips`` beside it; every other table keeps the values of a run without it."""
    import torch
    import transformers as tf

    task = make_task(tmp_path / "task", n=6)
    model_dir = model_dirs("llama")
    args = ["--model", str(model_dir), "--task", str(task), "--batch-size", "3"]
    for name, flags in (("plain", []), ("grads", ["--block-grads"]),
                        ("skips", ["--block-grads", "--skips"])):  # fmt: skip
        done = invoke("extract", *args, "--store", str(tmp_path / name), *flags)
        assert done.exit_code == 0, done.output
    grads = Store(tmp_path / "grads")
    got = grads.scan("block_grads").collect().drop("model", "task").sort("instance", "layer")
    assert got.height == 6 * 2 and (got["grad_norm"] > 0).all()
    beside = Store(tmp_path / "skips").scan("block_grads").collect().sort("instance", "layer")
    np.testing.assert_allclose(beside["grad_norm"].to_numpy(), got["grad_norm"].to_numpy(),
                               rtol=1e-5)  # fmt: skip
    for table in ("components", "instances"):
        plain = Store(tmp_path / "plain").scan(table).collect().drop("model", "task")
        assert_frame_equal(grads.scan(table).collect().drop("model", "task"), plain)

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(model_dir)
    prompts = grads.scan("instances").collect().sort("instance")["prompt"].to_list()
    outputs: list[Any] = []
    handles = [b.register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple)
               else o)) for b in model.model.layers]  # fmt: skip
    for i, prompt in enumerate(prompts):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
        outputs.clear()
        top = model(inputs_embeds=embeds).logits[0, -1].max()
        want = [float(g.norm()) for g in torch.autograd.grad(top, outputs)]
        mine = got.filter(pl.col("instance") == i)["grad_norm"].to_list()
        np.testing.assert_allclose(mine, want, rtol=1e-4)
    for handle in handles:
        handle.remove()


def test_a_taken_flag_option_or_setting_name_is_refused(registered: Measurement) -> None:
    """A flag, option or setting name that ``extract`` or another measurement has is refused
    by ``register`` (before, ``--lens`` and ``--limit`` were accepted: ``--help`` listed them
    twice and the built-in ``--lens`` broke)."""
    from dataclasses import replace

    from layerdiv.measurements import MeasurementError
    from layerdiv.measurements import registered as all_registered

    def setting(*names: str) -> Setting:
        return Setting(names[-1], click.Option(list(names), type=int, default=None), 0)

    before = [m.name for m in all_registered()]
    cases = {
        "'--lens' is taken by measurement lens": replace(BLOCK_NORMS, name="x", flag="--lens"),
        "'--limit' is taken by extract": replace(
            BLOCK_NORMS, name="x", flag="--x", tables={"choice": ("x",)},
            schemas={"x": BLOCK_NORMS_SCHEMA}, settings=(setting("--limit", "x_limit"),),
        ),
        "'skip_seed' is taken by measurement future_effects": replace(
            BLOCK_NORMS, name="x", flag="--x", tables={"choice": ("x",)},
            schemas={"x": BLOCK_NORMS_SCHEMA}, settings=(setting("--x-seed", "skip_seed"),),
        ),
        "'--norm-ord' is taken by measurement block_norms": replace(
            BLOCK_NORMS, name="x", flag="--x", tables={"choice": ("x",)},
            schemas={"x": BLOCK_NORMS_SCHEMA},
        ),
        "'-h' is taken by extract": replace(
            BLOCK_NORMS, name="x", flag="--x", tables={"choice": ("x",)},
            schemas={"x": BLOCK_NORMS_SCHEMA}, settings=(setting("-h", "x_h"),),
        ),
    }  # fmt: skip
    for why, plugin in cases.items():
        with pytest.raises(MeasurementError, match=why):
            register(plugin)
        assert [m.name for m in all_registered()] == before
    help_text = invoke("extract", "--help").output
    for option in ("--lens", "--limit", "--norm-ord", "--block-norms"):  # each declared once
        assert [x.split()[:1] for x in help_text.splitlines()].count([option]) == 1, option


def plugin_run(tmp_path: Path, model_dirs: Any, make_task: Any, **changes: Any) -> tuple[Any, Path]:
    """``extract --block-norms`` over 8 instances in chunks of 4 with the measurement changed
    by ``changes`` (registered for this run alone); the run's result and its store."""
    from dataclasses import replace

    store = tmp_path / "store"
    task = make_task(tmp_path / "task", n=8)
    args = ["extract", "--model", str(model_dirs("llama")), "--task", str(task), "--chunk-size",
            "4", "--batch-size", "2", "--store", str(store), "--block-norms"]  # fmt: skip
    register(replace(BLOCK_NORMS, **changes))
    try:
        return CliRunner().invoke(main, args), store
    finally:
        unregister(BLOCK_NORMS.name)


def spoiled(at: int, spoil: Any) -> Any:
    """:func:`block_norm_rows` with ``spoil`` applied to the rows of the chunk starting at
    ``at`` (the chunk before it is stored as it should be)."""

    def rows(ids: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
        tables = block_norm_rows(ids, values)
        return {k: spoil(t) if ids[0] == at else t for k, t in tables.items()}

    return rows


def one_line_naming_the_plugin(result: Any) -> str:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    (line,) = result.output.strip().splitlines()[-1:]
    errors = [x for x in result.output.splitlines() if x.startswith("Error")]
    assert errors == [line] and "measurement block_norms (--block-norms)" in line, line
    return line


def chunks_stored(store: Path) -> dict[str, list[str]]:
    """The parts of each table under ``store``, by file name."""
    return {t: sorted(p.name for p in store.glob(f"{t}/**/part-*.parquet"))
            for t in ("instances", "components", "block_norms")}  # fmt: skip


def test_a_plugins_wrong_rows_are_refused_before_anything_of_the_chunk_is_written(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    """3 rows fewer, or a NaN: refused in one line naming the plug-in, the chunk not written
    (before, both were stored with exit 0 and the partition was then refused by every reader,
    or averaged the NaN); the chunk before it is stored whole and read."""

    def fewer(t: pa.Table) -> pa.Table:
        return t.slice(0, t.num_rows - 3)

    def nan(t: pa.Table) -> pa.Table:
        norm = t["norm"].to_numpy().copy()
        norm[1] = np.nan
        return t.set_column(2, t.schema.field("norm"), pa.array(norm, pa.float32()))

    for spoil, why in ((fewer, "5 rows are not whole rows for each of 4 instances"),
                       (nan, "block_norms.norm holds NaN or infinite values")):  # fmt: skip
        result, store = plugin_run(tmp_path / spoil.__name__, model_dirs, make_task,
                                   rows=spoiled(4, spoil))  # fmt: skip
        line = one_line_naming_the_plugin(result)
        assert why in line and "chunk 4" in line and "nothing of this chunk was written" in line
        first = ["part-0000000-000004.parquet"]
        assert chunks_stored(store) == {"instances": first, "components": first,
                                        "block_norms": first}  # fmt: skip
        assert not [p for p in store.rglob("*") if p.name.startswith(".")
                    and p.suffix == ".tmp"]  # fmt: skip
        listed = CliRunner().invoke(main, ["ls", "--store", str(store)])
        assert listed.exit_code == 0 and "Error" not in listed.output, listed.output


class Raising(BlockNorms):
    """:class:`BlockNorms` whose hook raises in the passes of the second chunk (instances 4..7)."""

    ids: Sequence[int] | None = None

    def batch(self, ids: Sequence[int] | None, lengths: Sequence[int]) -> None:
        self.ids = ids

    def _hook(self, module: Any, args: Any, out: Any) -> None:
        if self.ids is not None and min(self.ids) >= 4:
            raise RuntimeError("the plug-in's hook broke")
        super()._hook(module, args, out)


def test_an_exception_in_a_plugin_is_one_line_naming_it(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    """Raised in the plug-in's hooks (in the forward pass), in its rows, or when its hooks are
    attached: one line naming the plug-in and the exception, nothing of that chunk written
    (before, a traceback)."""

    def broken(ids: Sequence[int], values: Sequence[Any]) -> dict[str, pa.Table]:
        raise ValueError("the plug-in's rows broke")

    def unattachable(ctx: Attachment) -> Any:
        raise KeyError("norm_ord")

    cases = (
        ({"attach": Raising}, "failed in its hooks: RuntimeError: the plug-in's hook broke", 1),
        ({"rows": spoiled(4, lambda t: broken([], []))},
         "failed in its rows: ValueError: the plug-in's rows broke", 1),
        ({"attach": unattachable}, "failed in attaching its hooks: KeyError: 'norm_ord'", 0),
    )  # fmt: skip
    for k, (changes, why, chunks) in enumerate(cases):
        result, store = plugin_run(tmp_path / str(k), model_dirs, make_task, **changes)
        assert why in one_line_naming_the_plugin(result)
        first = ["part-0000000-000004.parquet"][:chunks]
        assert chunks_stored(store) == {"instances": first, "components": first,
                                        "block_norms": first}  # fmt: skip


# --- the analysis door, as strict as the measurement one (issue 49) ----------------------------


def _raises(ctx: Context, prior: Any) -> dict[str, pl.DataFrame]:
    raise RuntimeError("the plug-in analysis broke")


def _returns(value: Any) -> Any:
    return lambda ctx, prior: value


def _evil(ctx: Context, prior: Any) -> dict[str, pl.DataFrame]:
    return {"../../evil": pl.DataFrame({"x": [1]})}


def _spills(ctx: Context, prior: Any) -> dict[str, pl.DataFrame]:
    ctx.spill.append("../../evil_spill", pl.DataFrame({"x": [1]}))
    return {}


def _section_raises(ctx: ReportContext) -> str:
    raise KeyError("no_such_table")


def _figure_fails(ctx: ReportContext) -> str:
    """A section whose figure cannot be drawn (drawn after every section is written)."""
    bad = plots.Figure("Bad", [plots.Panel("p", [plots.Series("s", [1, 2, 3], [1, 2])])])
    return "Text.\n\n" + plots.figure_link(ctx, "bad.png", "Bad", lambda: bad)


def _ok(ctx: Context, prior: Any) -> dict[str, pl.DataFrame]:
    return {"plugin_ok": pl.DataFrame({"n": [len(ctx.parts)]})}


BAD_ANALYSES = {
    "raising": (Analysis("raising", "R", _raises), "RuntimeError: the plug-in analysis broke"),
    "a_list": (Analysis("a_list", "L", _returns([pl.DataFrame()])), "returned a list, not a dict"),
    "nothing": (Analysis("nothing", "N", _returns(None)), "returned a NoneType, not a dict"),
    "lists": (Analysis("lists", "D", _returns({"plugin_lists": [1, 2]})),
              "returned table 'plugin_lists' as a list, not a Polars DataFrame"),
    "builtin_table": (Analysis("builtin_table", "B", _returns({"scores": pl.DataFrame()})),
                      "returned table 'scores', which exists"),
    "evil": (Analysis("evil", "E", _evil),
             "returned '../../evil': table name '../../evil' is not an identifier"),
    "spills": (Analysis("spills", "S", _spills),
               "LayerdivError: a spilled result's table name '../../evil_spill' is not an"),
    "bad_section": (Analysis("bad_section", "Bad section", _ok, report=_section_raises),
                    "its report section left out: KeyError: 'no_such_table'"),
    "bad_figure": (Analysis("bad_figure", "Bad figure", _returns({"plugin_fig": pl.DataFrame()}),
                            report=_figure_fails),
                   "its report section left out: ValueError: x and y must have same first"),
    "needs_nothing": (Analysis("needs_nothing", "U", _ok, needs=("no_such_table",)),
                      "needs table 'no_such_table', which no measurement writes"),
    "after_nothing": (Analysis("after_nothing", "A", _ok, after=("no_such_analysis",)),
                      "runs after 'no_such_analysis', which is not registered"),
}  # fmt: skip
"""Plug-in analyses that fail each way (issue 49), and what the one line naming each says."""


@pytest.fixture
def analysis_registry(monkeypatch: pytest.MonkeyPatch) -> Any:
    from layerdiv.analyze import registry as reg

    reg.registered()
    monkeypatch.setattr(reg.ANALYSES, "by_name", dict(reg.ANALYSES.by_name))
    monkeypatch.setattr(reg, "_ORIGINS", dict(reg._ORIGINS))
    return reg


def test_a_failing_plugin_analysis_is_one_note_and_the_others_are_written(
    analysis_registry: Any, tmp_path: Path
) -> None:
    """Each way a plug-in analysis can fail is one note naming it (its module), in ``analyze``'s
    output and ``report.md``; every built-in table and section is written, and a table name
    that is a path writes nothing outside ``--out`` (before, a traceback and no results)."""
    store = write_synthetic(tmp_path / "store")
    for analysis, _ in BAD_ANALYSES.values():
        analysis_registry.register(analysis)
    out = tmp_path / "deep" / "results"
    done = invoke("analyze", "--store", str(store), "--out", str(out))
    assert done.exit_code == 0, done.output
    for name, (_, why) in BAD_ANALYSES.items():
        if name not in ("bad_section", "bad_figure"):  # their tables are right
            line = f"analysis {name!r} (module tests.test_measurement_plugin) left out: "
            assert line in done.output and why in done.output, (name, done.output)
    assert (out / "scores.parquet").exists() and (out / "plugin_ok.parquet").exists()
    assert not list(tmp_path.rglob("evil*")) and not (out / "lists.parquet").exists()
    report = tmp_path / "report"
    done = invoke("report", "--store", str(store), "--out", str(report))
    assert done.exit_code == 0, done.output
    text = (report / "report.md").read_text()
    assert "## The paper's analysis" in text and "## Bad section" not in text
    line = "analysis 'bad_section' (module tests.test_measurement_plugin): its report section "
    assert f"{line}left out: KeyError: 'no_such_table'" in text
    assert "## Bad figure" not in text and (report / "figures" / "fig3_correlations.png").is_file()
    line = "analysis 'bad_figure' (module tests.test_measurement_plugin): its report section "
    assert f"{line}left out: ValueError: x and y must have same first dimension" in text
    assert "needs table 'no_such_table', which no measurement writes" in text


def test_a_plugin_analysis_may_not_take_a_builtin_name(analysis_registry: Any) -> None:
    """An analysis of another module named as a built-in is refused when it is registered
    (before, it replaced the built-in: "FAKE IGRAD" in the report); so is a name that is no
    identifier and an object that is no Analysis."""
    reg = analysis_registry
    taken = r"'igrad' of tests.test_measurement_plugin: the name is taken by analysis 'igrad' \("
    with pytest.raises(reg.RegistryError, match=taken):
        reg.register(Analysis("igrad", "FAKE IGRAD", _ok))
    assert "FAKE" not in next(a.title for a in reg.registered() if a.name == "igrad")
    with pytest.raises(reg.RegistryError, match="its name is no identifier"):
        reg.register(Analysis("../x", "X", _ok))
    with pytest.raises(reg.RegistryError, match="given a Measurement, not an Analysis"):
        reg.register(BLOCK_NORMS)


def test_a_table_name_that_is_no_identifier_is_refused_at_the_measurement_door() -> None:
    from layerdiv.measurements import MeasurementError

    schema = BLOCK_NORMS_SCHEMA.with_metadata({"layerdiv.table": "../../evil"})
    evil = Measurement("evil", "--evil", help="x", tables={"choice": ("../../evil",)},
                       schemas={"../../evil": schema})  # fmt: skip
    with pytest.raises(MeasurementError, match=r"table name '../../evil' is not an identifier"):
        register(evil)


def test_plugin_analysis_entry_points_that_fail_are_named(tmp_path: Path) -> None:
    """In a fresh process: an entry point naming a missing module, one naming a measurement
    (no Analysis), one whose name is a built-in analysis's: each one note naming the entry
    point; the report and its other sections are written (before, tracebacks, or silence)."""
    store = write_synthetic(tmp_path / "store")
    site = tmp_path / "site"
    info = site / "layerdiv_bad-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: layerdiv-bad\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[layerdiv.analyses]\n"
        "missing = no_such_package.analysis:ANALYSIS\n"
        "not_one = tests.test_measurement_plugin:BLOCK_NORMS\n"
        "igrad = tests.test_measurement_plugin:BLOCK_NORMS_ANALYSIS\n"
    )
    root = Path(__file__).resolve().parents[1]
    path = os.pathsep.join([str(site), str(root), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "layerdiv.cli", "report", "--store", str(store),
                           "--out", str(out)], env=env, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    text = (out / "report.md").read_text()
    assert "## The paper's analysis" in text
    group = "(entry point layerdiv.analyses)"
    for line in (
        f"analysis plug-in missing = no_such_package.analysis:ANALYSIS {group} left out: it "
        "failed to load (ModuleNotFoundError: No module named 'no_such_package')",
        f"analysis plug-in not_one = tests.test_measurement_plugin:BLOCK_NORMS {group} left out:"
        " register was given a Measurement, not an Analysis",
        f"analysis plug-in igrad = tests.test_measurement_plugin:BLOCK_NORMS_ANALYSIS {group} "
        "left out: 'igrad' is the name of analysis 'igrad' (module layerdiv.measurements.igrad",
    ):
        assert line in text, text


def write_synthetic(root: Path) -> Path:
    from tests.conftest import write_synthetic_store

    return write_synthetic_store(root, 1, 12, (2, 3))
