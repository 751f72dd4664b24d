"""Cost and findings of the depth-use options (``extract --skips`` / ``--gram``) on SmolLM2-135M
and the demo's packaged data, on this machine (a script, not a test).

Writes the demo tasks (``--n`` instances each), then extracts them into fresh stores, each in
turn with the model loaded once, timed by wall clock and CPU time of the process (tokenization
and writing included):

- plain ``layerdiv extract`` (``--rounds`` times, the median: every ratio is over it);
- ``--gram``: its time and the Gram table's bytes per instance on disk and in memory;
- ``--skips``: its time as a multiple of the plain extraction, against the target
  (blocks + 2) / 2 of a prefix-reusing implementation (the full pass, then on average half a
  pass per block);
- ``--skips`` added to the plain store afterwards (backfill: the components are kept).

Then prints what the depth tables show per task (methods §7): the update-size exponent
beta, first / second half means of the geometry, and the skip effects by half.

    python benchmarks/bench_depth.py [--n 60] [--tasks tweets2,bbc5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import polars as pl
import torch
from common import add_quick, demo_choice_tasks, record

from layerdiv.analyze.analyses import depth
from layerdiv.demo import DEMO_MODEL
from layerdiv.extract.adapters import adapter_for
from layerdiv.extract.config import ExtractConfig, measurement_options
from layerdiv.extract.models import LoadedModel, load_model, load_tokenizer, resolve_source
from layerdiv.extract.plan import plan_task
from layerdiv.extract.runner import extract_task
from layerdiv.measurements.skips.analysis import skip_effects, skip_summary
from layerdiv.store import Store


def timed_extract(
    loaded: LoadedModel, store: Path, tasks: list[str], skips: bool = False, gram: bool = False
) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of extracting ``tasks`` into ``store`` with the
    model already loaded (the real path: ``plan_task`` and ``extract_task``). On a shared machine
    the CPU time is the fairer measure of the work done."""
    settings = measurement_options({"skips": skips, "gram": gram})
    cfg = ExtractConfig(DEMO_MODEL, tasks, store, measurement_settings=settings, progress=False)
    adapter = adapter_for(loaded.model.config)
    plans = [plan_task(t, loaded.tokenizer, cfg) for t in tasks]
    wall, cpu = time.perf_counter(), time.process_time()
    for plan in plans:
        extract_task(loaded, adapter, plan, cfg, approximate=False)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=60, help="instances per demo task")
    parser.add_argument("--tasks", default="tweets2,tweets3,bbc5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rounds", type=int, default=3, help="plain extractions timed (the median is shown)"
    )
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.n, args.tasks, args.rounds = 4, "tweets2", 1
    loads = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        wanted = args.tasks.split(",")
        tasks = [str(p) for p in demo_choice_tasks(root / "tasks", args.n, args.seed)
                 if p.stem in wanted]  # fmt: skip
        source = resolve_source(DEMO_MODEL, None, None, False)
        loaded = load_model(source, load_tokenizer(source), torch.device("cpu"), torch.float32)
        timed_extract(loaded, root / "warm", tasks[:1])
        # the short plain run is the denominator of every ratio: the median of several
        runs = [timed_extract(loaded, root / f"plain{r}", tasks) for r in range(args.rounds)]
        plain = (
            statistics.median(wall for wall, _ in runs),
            statistics.median(cpu for _, cpu in runs),
        )
        gram = timed_extract(loaded, root / "gram", tasks, gram=True)
        skips = timed_extract(loaded, root / "skips", tasks, skips=True)
        backfill = timed_extract(loaded, root / "plain0", tasks, skips=True)
        store = Store(root / "skips")
        info = store.partitions[0]
        blocks = 1 + max(c.layer for c in info.manifest.components)
        n_inst = sum(p.n_done for p in store.partitions)
        gram_store = Store(root / "gram")
        gram_bytes = sum(f.stat().st_size for p in gram_store.partitions for f in p.files("gram"))
        n_comp = sum(c.kind != "bias" for c in info.manifest.components)
        print(
            f"\n{DEMO_MODEL}: {blocks} blocks, {n_comp} components; {n_inst} instances "
            f"({', '.join(Path(t).stem for t in tasks)}); {os.cpu_count()} CPU cores, fp32"
        )
        rounds = ", ".join(f"{wall:.1f}/{cpu:.1f}" for wall, cpu in runs)
        print(f"plain extraction, each round (wall/CPU s): {rounds}")
        print(f"{'run':<46}{'wall s':>8}{'CPU s':>8}{'CPU x plain':>12}")
        target = (blocks + 2) / 2
        rows = []
        for label, (wall, cpu) in (
            (f"`layerdiv extract` (median of {args.rounds})", plain),
            ("`layerdiv extract --gram`", gram),
            (f"`layerdiv extract --skips` (target {target:.1f})", skips),
            ("`--skips` added to the plain store (backfill)", backfill),
        ):
            print(f"{label:<46}{wall:8.1f}{cpu:8.1f}{cpu / plain[1]:12.2f}")
            rows.append([label, round(wall, 1), round(cpu, 1), round(cpu / plain[1], 2)])
        loads.append(os.getloadavg()[0])
        record("bench_depth", ["run", "wall s", "CPU s", "CPU time / plain extraction"],
               rows, loads, formats=["", ".1f", ".1f", ".2f"])  # fmt: skip
        raw = n_comp * (n_comp + 1) // 2 * 4
        print(
            f"Gram table: {gram_bytes / n_inst:,.0f} bytes per instance on disk (zstd Parquet), "
            f"{raw:,} in memory (C(C+1)/2 float32, C = {n_comp})"
        )
        tables = {**depth.geometry(store), "skip_effects": skip_effects(store)}
    show(tables)


def show(tables: dict[str, pl.DataFrame]) -> None:
    """What the depth tables say per task."""
    decay = tables["depth_decay"]
    print(
        "\nDepth geometry at the last prompt token (halves split the components at relative "
        "depth 1/2):"
    )
    print(f"{'task':<9}{'beta':>13}{'rel. contrib.':>18}{'cos(z, r)':>16}{'angle (deg)':>16}"
          f"{'cos_prev':>16}")  # fmt: skip
    for r in decay.iter_rows(named=True):
        cells = [
            f"{r[f'{c}_first_half']:.3f}/{r[f'{c}_second_half']:.3f}"
            for c in ("rel_contribution", "cos_residual", "angle_deg", "cos_prev")
        ]
        beta = f"{r['beta']:.2f}±{r['beta_se']:.2f}"
        print(f"{r['task']:<9}{beta:>13}" + "".join(f"{c:>16}" for c in cells))
    summary = skip_summary(tables["skip_effects"])
    print("\nSkipping one block (means over the blocks of each half):")
    print(f"{'task':<9}{'accuracy':>10}{'acc. w/o, 1st/2nd':>20}{'KL (nats), 1st/2nd':>22}"
          f"{'|IE|/(|DE|+|IE|)':>18}")  # fmt: skip
    for r in summary.iter_rows(named=True):
        acc = f"{100 * r['acc_1']:.1f}/{100 * r['acc_2']:.1f}%"
        kl = f"{r['kl_1']:.3f}/{r['kl_2']:.3f}"
        print(
            f"{r['task']:<9}{100 * r['accuracy']:>9.1f}%{acc:>20}{kl:>22}{100 * r['share']:>17.1f}%"
        )


if __name__ == "__main__":
    main()
