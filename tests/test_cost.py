"""The cost estimate of an extraction (``layerdiv.extract.cost``): forward passes from the
model's shape, the line ``extract`` prints before a long run, the docs' table."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from layerdiv.extract import cost

ROOT = Path(__file__).resolve().parent.parent
SHAPE = cost.Shape.from_config(SimpleNamespace(**cost.SMOLLM2))


def test_passes_follow_the_model_shape() -> None:
    L, T = SHAPE.layers, 256
    forward = L * SHAPE.block(T) + 2 * SHAPE.d * SHAPE.vocab
    for option in ("", "heads", "gram"):
        assert cost.passes(SHAPE, "choice", option, 46) == 1.0
    # --lens on running text: L + 1 full-vocabulary readouts of every token
    lens = (forward + (L + 1) * 2 * SHAPE.d * SHAPE.vocab * T) / forward
    assert cost.passes(SHAPE, "text", "lens", T) == pytest.approx(lens, rel=1e-12)
    assert cost.passes(SHAPE, "text", "lens last-block", T) == pytest.approx(
        lens + L * SHAPE.block(T) / forward, rel=1e-12
    )
    # --skips on a choice task: about (L + 1) / 2 passes (blocks b+1..L-1 for every b)
    assert cost.passes(SHAPE, "choice", "skips", 46) == pytest.approx((L + 1) / 2, rel=0.01)
    # on running text: grows with the split points a document has (none up to 12 tokens)
    short, long = (cost.passes(SHAPE, "text", "skips", n) for n in (12, 128))
    assert short < 1.5 and long > 4 * (L + 1) / 2  # short: the clean readouts only
    with pytest.raises(ValueError, match="unknown extraction option 'lense'"):
        cost.passes(SHAPE, "text", "lense", 10)


def test_the_estimate_is_printed_before_a_long_run_only(capsys: pytest.CaptureFixture) -> None:
    config = SimpleNamespace(**cost.SMOLLM2)
    cost.announce(config, "cpu", [("choice", ["heads"], [46] * 300)])
    assert capsys.readouterr().out == ""
    big = [("text", ["skips"], [256] * 200), ("choice", ["skips"], [46] * 3000)]
    seconds = cost.run_seconds(SHAPE, big, "cpu")
    assert seconds > cost.LONG_RUN
    cost.announce(config, "cpu", big)
    line = capsys.readouterr().out.strip()
    assert line == cost.estimate_line(seconds, "cpu")
    assert line.startswith(f"Estimated extraction time: about {seconds / 60:.0f} min")
    assert cost.run_seconds(SHAPE, big, "cuda") < seconds / 100


def test_a_job_reads_its_options_from_the_tables_and_its_lengths_from_the_data() -> None:
    def tokenizer(prompts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [[0] * len(p.split()) for p in prompts]}

    kind, options, lengths = cost.job(
        "choice", ["heads", "skips"], None, None, ["a b", "a b c d"], tokenizer
    )
    assert (kind, options, lengths) == ("choice", ["heads", "skips"], [3, 3])
    job = cost.job("text", ["token_lens", "future_effects"], "last-block", [[1] * 5], [], None)
    assert job == ("text", ["lens last-block", "skips"], [5])


def test_the_docs_cost_table_is_generated_from_the_estimate() -> None:
    spec = importlib.util.spec_from_file_location("cost_table", ROOT / "docs/hooks/cost_table.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.on_page_markdown(f"x\n{hook.MARKER}\ny")
    rows = [r.strip("| ").split(" | ") for r in page.splitlines() if r.startswith("| choice")]
    skips = next(r for r in rows if r[2] == "`--skips`")
    assert float(skips[3]) == round(cost.passes(SHAPE, "choice", "skips", 46), 2)
    assert hook.MARKER in (ROOT / "docs/extract.md").read_text()
