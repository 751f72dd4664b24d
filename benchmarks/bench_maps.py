"""Scale benchmark of the layer maps (``analyze --maps``, methods §11; a script, not a
test).

The depth-efficiency paper's shape on synthetic states: a source model of width 1536 with 29
states (Qwen2.5-1.5B) onto a target of width 5120 with 49 states (Qwen2.5-14B), 32,768 training
and 8,192 held-out tokens, every one of the 29 x 49 = 1,421 pairs of states and the 28 x 48 pairs
of updates. The solver (``layerdiv.analyze.layer_maps.fit_maps``) is timed at two token counts,
and its time compared with its matrix-multiply FLOP count (``map_flops``) at this machine's numpy
float64 GEMM rate, measured here on a product of the workload's shape. Peak memory is the
process's max RSS.

Synthetic states are rows of a fixed random pool (float16, ``--pool`` rows per model) permuted
per layer, so that nothing of the token count's size is held: what memory grows with is the
solver's alone.

    python benchmarks/bench_maps.py [--train 32768] [--heldout 8192] [--width-divisor 1]
        [--source-layers K] [--quick]

``--train``/``--heldout`` give the larger token count; the smaller one is half of it.
``--source-layers K``: map only the first K source states and the first K source updates onto
every target layer, at the full widths and token counts: a fraction of the work whose cost is
linear in the source layers (per source layer one Gram matrix and factorisation, per pair the
same products), extrapolated to every pair by the FLOP count (``map_flops``) at the measured rate.
``--quick``: tiny sizes, seconds. The figures are written to ``docs/benchmarks/bench_maps.json``
(rendered into docs/benchmarks.md by ``scripts/bench_tables.py``).
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from dataclasses import dataclass

import numpy as np
from common import add_quick, record

from layerdiv.analyze.analyses.maps import HELD_OUT, RIDGES
from layerdiv.analyze.layer_maps import fit_maps, map_flops

PAPER = {"d_a": 1536, "l_a": 29, "d_b": 5120, "l_b": 49, "train": 32768, "heldout": 8192}
QUICK = {"d_a": 48, "l_a": 5, "d_b": 96, "l_b": 7, "train": 2048, "heldout": 512}


@dataclass
class PoolLayers:
    """Synthetic ``Layers``: layer l's row r is row (r * 7919 + 131 l) % pool of a random
    float16 pool; with ``updates``, the difference of consecutive layers."""

    pool: np.ndarray
    layers: int
    updates: bool = False

    @property
    def n_layers(self) -> int:
        return self.layers - int(self.updates)

    @property
    def width(self) -> int:
        return int(self.pool.shape[1])

    def _state(self, layer: int, start: int, stop: int) -> np.ndarray:
        index = (np.arange(start, stop) * 7919 + 131 * layer) % len(self.pool)
        return self.pool[index].astype(np.float64)

    def rows(self, layer: int, start: int, stop: int) -> np.ndarray:
        h = self._state(layer, start, stop)
        return self._state(layer + 1, start, stop) - h if self.updates else h


def gemm_rate(d_a: int, d_b: int, rows: int = 4096, repeats: int = 3) -> tuple[float, float]:
    """Float64 FLOP/s of numpy's matrix multiply on the solver's block product (d_A x rows)
    times (rows x d_B), best of ``repeats``: per wall second, and per CPU second of this
    process (every BLAS thread; the fairer figure on a machine that other work shares)."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((rows, d_a)), rng.standard_normal((rows, d_b))
    wall, cpu = float("inf"), float("inf")
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        a.T @ b
        wall = min(wall, time.perf_counter() - start)
        cpu = min(cpu, time.process_time() - start_cpu)
    flops = 2 * rows * d_a * d_b
    return flops / wall, flops / max(cpu, 1e-9)


FOLDS = HELD_OUT[1]
"""The cross-validation folds of the ridge (the training documents' doc % 5 = 0..3)."""


def folds(train: int) -> list[int]:
    """The boundaries of :data:`FOLDS` equal folds of ``train`` rows."""
    return [train * f // FOLDS for f in range(FOLDS + 1)]


def run(
    shape: dict[str, int], train: int, heldout: int, pool: int, sources: int
) -> tuple[float, float, float]:
    """Every pair of the first ``sources`` source states (and as many updates) with every target
    layer, at ``train`` + ``heldout`` tokens: (wall seconds, CPU seconds, FLOPs)."""
    rng = np.random.default_rng(1)
    src = rng.standard_normal((pool, shape["d_a"])).astype(np.float16)
    tgt = rng.standard_normal((pool, shape["d_b"])).astype(np.float16)
    flops = 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    for updates in (False, True):
        layers = min(sources + 1, shape["l_a"]) if updates else sources
        a, b = PoolLayers(src, layers, updates), PoolLayers(tgt, shape["l_b"], updates)
        fit_maps(a, b, train, heldout, RIDGES, folds(train))
        flops += map_flops(a.width, b.width, a.n_layers, b.n_layers, train, heldout, FOLDS)
    return time.perf_counter() - wall, time.process_time() - cpu, flops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", type=int, default=None)
    parser.add_argument("--heldout", type=int, default=None)
    parser.add_argument("--pool", type=int, default=2048)
    parser.add_argument(
        "--width-divisor",
        type=int,
        default=1,
        help="divide both widths by this (a smaller machine; the layer counts stay)",
    )
    parser.add_argument(
        "--source-layers",
        type=int,
        default=None,
        help="map only the first K source states (a fraction, extrapolated by FLOPs)",
    )
    add_quick(parser)
    args = parser.parse_args()
    shape = dict(QUICK if args.quick else PAPER)
    shape["d_a"] //= args.width_divisor
    shape["d_b"] //= args.width_divisor
    train, heldout = args.train or shape["train"], args.heldout or shape["heldout"]
    pairs = shape["l_a"] * shape["l_b"] + (shape["l_a"] - 1) * (shape["l_b"] - 1)
    print(f"source d {shape['d_a']} x {shape['l_a']} states, target d {shape['d_b']} x "
          f"{shape['l_b']} states: {pairs} pairs (states and updates); {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f} (other work shares this machine)")  # fmt: skip
    rate, cpu_rate = gemm_rate(shape["d_a"], shape["d_b"], repeats=10)
    print(f"numpy float64 GEMM rate: {rate / 1e9:.1f} GFLOP/s per wall second, "
          f"{cpu_rate / 1e9:.1f} per CPU second")  # fmt: skip
    sources = min(args.source_layers or shape["l_a"], shape["l_a"])
    if sources < shape["l_a"]:
        print(f"ran: source states 0..{sources - 1} of {shape['l_a']} and source updates "
              f"0..{sources - 1} of {shape['l_a'] - 1}, each onto every target layer; the "
              "rest extrapolated by FLOPs")  # fmt: skip
    results, rows, loads = [], [], [os.getloadavg()[0]]
    for scale in (0.5, 1.0):
        n_t, n_h = int(train * scale), int(heldout * scale)
        wall, cpu, flops = run(shape, n_t, n_h, args.pool, sources)
        at_rate = flops / rate
        results.append((n_t + n_h, cpu))
        at_cpu = flops / cpu_rate
        loads.append(os.getloadavg()[0])
        print(
            f"{n_t} + {n_h} tokens: {wall:.1f} s wall ({cpu:.1f} s CPU), {flops:.3g} FLOPs -> "
            f"{at_rate:.1f} s wall ({at_cpu:.1f} s CPU) at the GEMM rate; ratio "
            f"{wall / at_rate:.2f} wall, {cpu / at_cpu:.2f} CPU (target <= 2)"
        )
        if sources < shape["l_a"]:
            every = sum(
                map_flops(shape["d_a"], shape["d_b"], shape["l_a"] - u, shape["l_b"] - u, n_t, n_h,
                          FOLDS)
                for u in (0, 1)
            )  # fmt: skip
            print(f"  every pair: {every:.3g} FLOPs -> {every / rate:.0f} s wall at the GEMM "
                  f"rate; ours extrapolated at the measured rate: {wall * every / flops:.0f} s "
                  f"wall ({cpu * every / flops:.0f} s CPU)")  # fmt: skip
        rows.append([f"{n_t:,} + {n_h:,}", wall, cpu, flops / 1e12, at_rate, wall / at_rate,
                     cpu / at_cpu, 2.0])  # fmt: skip
    (n0, t0), (n1, t1) = results
    print(f"CPU time per token: {t0 / n0 * 1e3:.3f} ms at {n0}, {t1 / n1 * 1e3:.3f} ms at {n1} "
          f"tokens (ratio {t1 / n1 / (t0 / n0):.2f}; 1 is linear)")  # fmt: skip
    paper_tokens = PAPER["train"] + PAPER["heldout"]
    if not args.quick and args.width_divisor == 1 and n1 != paper_tokens:
        slope = (t1 - t0) / (n1 - n0)
        print(
            f"extrapolated to {paper_tokens} tokens: {t0 + slope * (paper_tokens - n0):.0f} s CPU"
        )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak memory (max RSS): {peak:.2f} GiB (target <= 8)")
    record(
        "bench_maps",
        [
            "train + held-out tokens",
            "wall s",
            "CPU s",
            "TFLOP",
            "wall s at the GEMM rate",
            "wall ratio",
            "CPU ratio",
            "target",
        ],
        rows,
        loads,
        formats=["", ".1f", ".1f", ".2f", ".1f", ".2f", ".2f", ".0f"],
        shape=shape,
        source_layers=sources,
        gemm_gflops={"wall": rate / 1e9, "cpu": cpu_rate / 1e9},
        linearity=t1 / n1 / (t0 / n0),
        peak_gib=peak,
    )
    print(
        "the paper's maps (AdamW, one per source layer, on GPUs): about 80 GPU-days, as a "
        "third-party summary puts it"
    )


if __name__ == "__main__":
    main()
