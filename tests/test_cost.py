"""The cost estimate of an extraction (``layerdiv.extract.cost``): forward passes from the
model's shape, the line ``extract`` prints before a long run, the docs' table."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pytest

from layerdiv.extract import cost
from layerdiv.measurements import Measurement, register, unregister
from layerdiv.measurements.future import FUTURE

ROOT = Path(__file__).resolve().parent.parent
SHAPE = cost.Shape.from_config(SimpleNamespace(**cost.SMOLLM2))


LENS = {"lens": {"lens": "final"}}
LAST_BLOCK = {"lens": {"lens": "last-block"}}
SKIPS = {"skips": {}, "future_effects": FUTURE.defaults()}


def test_passes_follow_the_model_shape() -> None:
    L, T = SHAPE.layers, 256
    forward = L * SHAPE.block(T) + 2 * SHAPE.d * SHAPE.vocab
    runs: list[cost.RunSettings] = [{}, {"heads": {}}, {"gram": {}}, {"heads": {}, "gram": {}}]
    for run_settings in runs:
        assert cost.passes(SHAPE, "choice", 46, run_settings) == 1.0
    # --lens on running text: L + 1 full-vocabulary readouts of every token
    lens = (forward + (L + 1) * 2 * SHAPE.d * SHAPE.vocab * T) / forward
    assert cost.passes(SHAPE, "text", T, LENS) == pytest.approx(lens, rel=1e-12)
    assert cost.passes(SHAPE, "text", T, LAST_BLOCK) == pytest.approx(
        lens + L * SHAPE.block(T) / forward, rel=1e-12
    )
    # --skips on a choice task: about (L + 1) / 2 passes (blocks b+1..L-1 for every b)
    assert cost.passes(SHAPE, "choice", 46, SKIPS) == pytest.approx((L + 1) / 2, rel=0.01)
    # on running text: grows with the split points a document has (none up to 12 tokens)
    short, long = (cost.passes(SHAPE, "text", n, SKIPS) for n in (12, 128))
    assert short < 1.5 and long > 4 * (L + 1) / 2  # short: the clean readouts only
    # the measurements of a run add up
    both = cost.passes(SHAPE, "text", T, {**LENS, **SKIPS})
    alone = cost.passes(SHAPE, "text", T, LENS) + cost.passes(SHAPE, "text", T, SKIPS) - 1
    assert both == pytest.approx(alone, rel=1e-12)


def test_a_measurement_without_a_declared_cost_costs_a_pass() -> None:
    """A registered measurement costs what it declares; one that declares nothing is costed as
    one more plain pass (never as free)."""
    schema = pa.schema([pa.field("instance", pa.int32(), nullable=False)])
    undeclared = Measurement("undeclared", "--undeclared", {"choice": ("undeclared",)}, help="x",
                             schemas={"undeclared": schema})  # fmt: skip
    register(undeclared)
    try:
        assert cost.passes(SHAPE, "choice", 46, {"undeclared": {}}) == pytest.approx(2.0)
        twice = replace(
            undeclared, flops=lambda shape, kind, tokens, settings: 2 * shape.forward(tokens)
        )
        assert twice.flops_of(SHAPE, "choice", 46, {}) == 2 * SHAPE.forward(46)
    finally:
        unregister(undeclared.name)


def test_the_estimate_is_printed_before_a_long_run_only(capsys: pytest.CaptureFixture) -> None:
    config = SimpleNamespace(**cost.SMOLLM2)
    cost.announce(config, "cpu", [("choice", {"heads": {}}, [46] * 300)])
    assert capsys.readouterr().out == ""
    big = [("text", SKIPS, [256] * 200), ("choice", SKIPS, [46] * 3000)]
    seconds = cost.run_seconds(SHAPE, big, "cpu")
    assert seconds > cost.LONG_RUN
    cost.announce(config, "cpu", big)
    line = capsys.readouterr().out.strip()
    assert line == cost.estimate_line(seconds, "cpu")
    assert line.startswith(f"Estimated extraction time: about {seconds / 60:.0f} min")
    assert cost.run_seconds(SHAPE, big, "cuda") < seconds / 100


def test_a_job_takes_its_lengths_from_the_data() -> None:
    def tokenizer(prompts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [[0] * len(p.split()) for p in prompts]}

    job = cost.job("choice", SKIPS, None, ["a b", "a b c d"], tokenizer)
    assert job == ("choice", SKIPS, [3, 3])
    assert cost.job("text", LAST_BLOCK, [[1] * 5], [], None) == ("text", LAST_BLOCK, [5])


def test_the_docs_cost_table_is_generated_from_the_estimate() -> None:
    spec = importlib.util.spec_from_file_location("cost_table", ROOT / "docs/hooks/cost_table.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.on_page_markdown(f"x\n{hook.MARKER}\ny")
    rows = [r.strip("| ").split(" | ") for r in page.splitlines() if r.startswith("| choice")]
    skips = next(r for r in rows if r[2] == "`--skips`")
    assert float(skips[3]) == round(cost.passes(SHAPE, "choice", 46, SKIPS), 2)
    text = [r.strip("| ").split(" | ")[2] for r in page.splitlines() if r.startswith("| text")]
    assert "`--lens last-block`" in text and "`--skips`" in text
    assert hook.MARKER in (ROOT / "docs/extract.md").read_text()


def test_the_measured_estimate_is_printed_for_attribution_always(
    capsys: pytest.CaptureFixture,
) -> None:
    """Once the model is loaded the estimate is taken at the FLOP rate a probe measured here:
    printed before a long run, and before any run of an attribution measurement, however
    short."""
    config = SimpleNamespace(**cost.SMOLLM2)
    rate = cost.probe_rate(config, 16, 0.5)  # 4 plain passes of 16 tokens in half a second
    assert rate == pytest.approx(cost.PROBE_SEQUENCES * SHAPE.forward(16) / 0.5)
    short = [("text", LENS, [16] * 4)]
    cost.announce_measured(config, "cpu", short, rate)
    assert capsys.readouterr().out == ""
    igrad = [("text", {"igrad": {"igrad_sites": ["block"], "igrad_steps": 4}}, [16] * 4)]
    seconds = cost.run_seconds(SHAPE, igrad, "cpu", rate)
    assert seconds < 120  # said in seconds
    cost.announce_measured(config, "cpu", igrad, rate)
    line = capsys.readouterr().out.strip()
    assert line == cost.measured_line(seconds, rate)
    assert f"about {seconds:.0f} s at this machine's measured rate of {rate / 1e9:.3g} GFLOP/s" in (
        line
    )
    # the measured rate replaces the benchmarks' own
    assert cost.run_seconds(SHAPE, igrad, "cpu", rate / 2) == pytest.approx(2 * seconds)
    assert cost.probe_tokens([*short, ("choice", {}, [5, 40, 41])]) == 16
