"""The docs page ``docs/multihop.md``: SmolLM2-135M-Instruct on the handwritten multi-hop set of
``tasks/data/multihop`` (12 questions of 2 and 3 hops), answer-anchored future effects, total and
local (methods §10); the depth-efficiency paper's depth score per hop count beside the mean of
per-document scores with its bootstrap interval, the slope against hops, and the heatmaps. Every
number and figure of the page is computed here from the store this script extracts.

``python scripts/multihop_page.py`` (a few minutes on a CPU; ``--store`` keeps the store
elsewhere than ``build/multihop``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = ROOT / "tasks" / "data" / "multihop" / "multihop.yaml"
PAGE = ROOT / "docs" / "multihop.md"
MODEL = "smollm2-135m-instruct"
FLAGS = ["--skips", "--skip-split", "answer", "--skip-mode", "total", "--skip-mode", "local"]
"""The extraction: one split point at the answer's first token (the paper's MQuAKE setting), the
total and the local effects."""

INTRO = """# Multi-hop questions: the paper's depth score and ours

The depth-efficiency paper asks whether a model uses more depth for questions that need more hops
(MQuAKE, 2-4 hops) and finds that the depth score does not rise. This page runs the same
measurement on a small local set: the 12 handwritten 2- and 3-hop questions of
`tasks/data/multihop` (the form of the built-in `mquake` task: "Question: ...\\nAnswer:" +
" <answer>", grouped by hops), on SmolLM2-135M-Instruct. Every number below is computed by
`python scripts/multihop_page.py`, which extracts and analyses:

```
layerdiv extract --model {model} --task tasks/data/multihop/multihop.yaml --store build/multihop \\
    {flags}
layerdiv analyze --store build/multihop
```

Split points are anchored in the answer ([methods §10](methods.md#section-10)); *Paper* is the
paper's aggregation (maxima over the group's documents and split points first, then the score),
*Mean* the mean of the per-document scores with a bootstrap 95% percentile interval over
documents. With so few questions per group the intervals are wide: the point of the page is the
method and the uncertainty the paper's single number hides, not a finding about the model.
"""

LOCAL = """## Total and local effects

The left heatmap is the total effect of removing block l's update before the split point
(every later block computes from the changed stream); the right one the local, direct-only effect
(`--skip-mode local`: every later block reads the clean stream minus block l's update, so block j
sees only what block l wrote itself). Their difference is what the blocks between l and j pass on:
where total is far above local, block l's change reaches block j through the blocks between.
{summary}
"""


def _reading(r: dict) -> str:
    """What one slope's interval says (computed: whether it holds 0)."""
    low, high = r["slope_low"], r["slope_high"]
    if low is None or high is None:
        return f"The {r['effect']} effect's slope has no interval."
    if low <= 0 <= high:
        return (f"The {r['effect']} effect's interval holds 0: no evidence on this set that "
                "the depth used rises or falls with hops.")  # fmt: skip
    way = "rises" if low > 0 else "falls"
    return f"The {r['effect']} effect's interval excludes 0: its score {way} with hops here."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, default=ROOT / "build" / "multihop")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT.parent))
    import polars as pl

    from layerdiv.analyze import plots
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.markdown import fmt, markdown_table
    from layerdiv.cli import main as cli
    from layerdiv.measurements.future.analysis import skips_spec
    from layerdiv.measurements.future.text_groups import groups_figure

    shutil.rmtree(args.store, ignore_errors=True)
    cli(["extract", "--model", MODEL, "--task", str(TASK), "--store", str(args.store), *FLAGS],
        standalone_mode=False)  # fmt: skip
    result = analyze(args.store)
    scores, slopes = result.text_group_scores, result.text_group_slope
    effects, output = result.text_skips, result.text_skip_output
    names = {m: "SmolLM2-135M" for m in scores["model"].unique()}
    plots.to_matplotlib(groups_figure(scores, names), ROOT / "docs" / "multihop-groups.png")
    plots.to_matplotlib(skips_spec(effects, output, names), ROOT / "docs" / "multihop-skips.png")

    block = scores.filter(pl.col("sublayer") == "block").sort("effect", "group")
    rows = [
        [r["effect"], str(r["group"]), str(r["n_scored"]), fmt(r["paper_score"], digits=2),
         f"{fmt(r['mean_score'], digits=2)} [{fmt(r['mean_low'], digits=2)}, "
         f"{fmt(r['mean_high'], digits=2)}]"]
        for r in block.iter_rows(named=True)
    ]  # fmt: skip
    slope_rows = [
        [r["effect"], str(r["n_scored"]),
         f"{fmt(r['slope'], digits=3)} [{fmt(r['slope_low'], digits=3)}, "
         f"{fmt(r['slope_high'], digits=3)}]"]
        for r in slopes.filter(pl.col("sublayer") == "block").sort("effect").iter_rows(named=True)
    ]  # fmt: skip
    wide = effects.filter(pl.col("sublayer") == "block").pivot(
        "mode", index=["skipped", "block"], values="rel_change_max"
    )
    later = wide.filter(pl.col("block") > pl.col("skipped") + 1)  # a block between l and j
    ratio = float((later["total"] / later["local"]).median())  # type: ignore[arg-type]
    summary = (
        f"Over the {later.height} (l, j) pairs with a block between them, the median ratio of "
        f"the total to the local maximum rel_change is {fmt(ratio, digits=3)}."
    )
    page = "\n\n".join(
        [
            INTRO.format(model=MODEL, flags=" ".join(FLAGS)),
            "## Depth score per hop count (whole blocks)",
            markdown_table(["Effect", "Hops", "Documents", "Paper", "Mean [95% CI]"], rows),
            "![Depth score per hop count](multihop-groups.png)",
            "The slope of the per-document score against the hop count, with its bootstrap "
            "95% interval:",
            markdown_table(["Effect", "Documents", "Slope per hop [95% CI]"], slope_rows),
            " ".join(
                _reading(r)
                for r in slopes.filter(pl.col("sublayer") == "block")
                .sort("effect")
                .iter_rows(named=True)
            ),
            LOCAL.format(summary=summary),
            "![Total and local future effects](multihop-skips.png)",
        ]
    )
    PAGE.write_text(page.rstrip() + "\n")
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
