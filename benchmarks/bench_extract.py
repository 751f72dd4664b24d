"""CPU extraction benchmark: ``layerdiv extract`` against a plain forward pass and against the same
decomposition through TransformerLens, on SmolLM2-135M-Instruct in fp32, over the same real
prompts (the demo tasks tweets2, tweets3 and bbc5; ``--n`` prompts in all, fixed ``--seed``).

Contenders (each includes tokenization; none includes loading the model):

- ``plain``: what a user writes for the option logits: per task, fixed-size batches in arrival
  order, ``tokenizer(batch, padding=True)`` (left padding) and
  ``model(input_ids, attention_mask, logits_to_keep=1, use_cache=False)``.
- ``plain-floor``: the fair floor: the same plain forward over exactly the batches
  ``layerdiv-auto`` forms (its tokenization, length-sorted token-budget batches, left padding and
  position ids), so that layerdiv-auto / plain-floor measures layerdiv's own overhead.
- ``layerdiv-fixed``: the real extraction path (``plan_task`` outside the clock, then
  ``extract_task``: hooks, decomposition, sum check, Parquet writing into a fresh store) with the
  same ``batch_size``; its length sorting is the only difference in batching.
- ``layerdiv-auto``: the same with its default ``batch_size=None`` (token-budget batches).
- ``transformerlens``: ``TransformerBridge.boot_transformers`` on its own copy of the model;
  ``run_with_cache`` on the plain batches (names_filter: embedding, attention and MLP outputs and
  the final norm scale; ``pos_slice=-1``; ``logits_to_keep=1`` and ``output_attentions=False``, so
  it computes no more than it needs), ``decompose_resid(apply_ln=True)`` (final RMSNorm scale
  frozen), times the norm gain, projected on the option columns of W_U. Skipped when
  transformer-lens (the ``bench`` extra) is not installed.

Wall time: a warm-up run of each contender (also used to check that TransformerLens and the plain
forward agree with what layerdiv stored), then ``--rounds`` rounds, each running every contender
once in a rotating order; the table shows median seconds and the median of per-round ratios to
``plain``. Memory: one fresh subprocess per contender (``--memory-of NAME``) loads the model, runs
a one-token forward pass (the weights are memory-mapped: this pages them in), resets the kernel's
peak-RSS mark (``VmHWM``), runs the contender once and reports its peak RSS and the increment over
the RSS before the run. Linux only (reads and writes /proc/self).

Run from the repository root (about 15 minutes with the defaults on 2 cores)::

    python benchmarks/bench_extract.py [--n 300] [--rounds 3] [--batch-size 16] [--seed 0]

``--quick``: 6 prompts, one round, batches of 2 (every contender and memory process runs once).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import add_quick, record

from layerdiv.demo import DEMO_MODEL, DEMO_TASKS, write_demo_tasks
from layerdiv.extract.adapters import adapter_for, check_softcap
from layerdiv.extract.batching import CPU_TOKEN_BUDGET, batches, tokenize
from layerdiv.extract.config import ExtractConfig
from layerdiv.extract.forward import left_padded
from layerdiv.extract.models import LoadedModel, load_model, load_tokenizer, resolve_source
from layerdiv.extract.plan import plan_task
from layerdiv.extract.runner import extract_task
from layerdiv.extract.tasks import instances, load_task, option_token_ids
from layerdiv.store.reader import Store

NAMES = ("plain", "plain-floor", "layerdiv-fixed", "layerdiv-auto", "transformerlens")
AGREE_TOL = 1e-3
"""Largest accepted absolute logit difference between contenders (fp32; sdpa vs eager)."""
TARGET_RATIO, TARGET_MEMORY = 1.03, 1.10
"""Targets for layerdiv: time and peak memory as a multiple of the plain forward's."""
CLEAR_LEAD = 0.95
"""Clearly ahead of TransformerLens: at most this fraction of its time ratio and peak ratio."""
MIB = 2**20


@dataclass(frozen=True)
class Task:
    """One demo task of the workload, ready for every contender."""

    path: str
    name: str
    prompts: list[str]
    lengths: list[int]
    """Prompt lengths in tokens (as the model sees them)."""
    option_ids: list[int]


@dataclass
class Contender:
    """A timed path from prompts to option logits (or their decomposition)."""

    name: str
    model: Any
    """The HuggingFace model its forward passes go through."""
    prepare: Callable[[Path], Callable[[], Any]]
    """Untimed setup given a fresh scratch folder; returns the timed run."""


def workload(folder: Path, n: int, seed: int, tokenizer: Any) -> list[Task]:
    """``n`` prompts split evenly over the demo's choice tasks (written into ``folder``), taken
    by name: the demo also writes its running-text task."""
    counts = [n // len(DEMO_TASKS) + (i < n % len(DEMO_TASKS)) for i in range(len(DEMO_TASKS))]
    # write_demo_tasks balances classes (2, 3 or 5): write a multiple of 30, then take the first.
    written = -(-max(counts) // 30) * 30
    paths = {path.stem: path for path in write_demo_tasks(folder, written, seed)}
    tasks = []
    for demo, count in zip(DEMO_TASKS, counts, strict=True):
        spec = load_task(str(paths[demo.name]))
        items = instances(spec, count)
        prompts = [it.prompt for it in items]
        lengths = [len(s) for s in tokenizer(prompts)["input_ids"]]
        ids = option_token_ids(spec, tokenizer, prompts[0])
        tasks.append(Task(str(paths[demo.name]), spec.name, prompts, lengths, ids))
    return tasks


def plain(model: Any, tokenizer: Any, tasks: list[Task], batch_size: int) -> Contender:
    def run() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for task in tasks:
                rows = []
                for k in range(0, len(task.prompts), batch_size):
                    enc = tokenizer(
                        task.prompts[k : k + batch_size], padding=True, return_tensors="pt"
                    )
                    logits = model(
                        input_ids=enc["input_ids"],
                        attention_mask=enc["attention_mask"],
                        logits_to_keep=1,
                        use_cache=False,
                    ).logits
                    rows.append(logits[:, -1, task.option_ids])
                out.append(torch.cat(rows))
        return out

    return Contender("plain", model, lambda _: run)


def plain_floor(loaded: LoadedModel, tasks: list[Task]) -> Contender:
    """The fair floor: a plain forward (``logits_to_keep=1``) over exactly the batches
    ``layerdiv-auto`` forms (its tokenization, length-sorted batches, left padding and position
    ids), so that layerdiv-auto / plain-floor is layerdiv's own overhead."""
    model, tok = loaded.model, loaded.tokenizer
    pad = tok.pad_token_id or 0

    def run() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for task in tasks:
                seqs, _ = tokenize(tok, task.prompts, loaded.context_length)
                rows = torch.empty(len(seqs), len(task.option_ids))
                ids = list(range(len(seqs)))
                for batch in batches([len(s) for s in seqs], ids, None, CPU_TOKEN_BUDGET):
                    inputs = left_padded([seqs[i] for i in batch], pad)
                    logits = model(**inputs, logits_to_keep=1, use_cache=False).logits
                    rows[batch] = logits[:, -1, task.option_ids]
                out.append(rows)
        return out

    return Contender("plain-floor", model, lambda _: run)


def layerdiv(
    name: str, loaded: LoadedModel, tasks: list[Task], batch_size: int | None
) -> Contender:
    adapter = adapter_for(loaded.model.config)
    approximate = check_softcap(loaded.model.config, False)

    def prepare(store: Path) -> Callable[[], Any]:
        cfg = ExtractConfig(
            model=DEMO_MODEL, tasks=[], store=store, batch_size=batch_size, progress=False
        )
        plans = [
            plan_task(t.path, loaded.tokenizer, dataclasses.replace(cfg, limit=len(t.prompts)))
            for t in tasks
        ]
        return lambda: [extract_task(loaded, adapter, p, cfg, approximate) for p in plans]

    return Contender(name, loaded.model, prepare)


def transformerlens(bridge: Any, tokenizer: Any, tasks: list[Task], batch_size: int) -> Contender:
    n_layers = bridge.cfg.n_layers
    names = ["hook_embed", "ln_final.hook_scale"] + [
        f"blocks.{layer}.hook_{kind}_out" for layer in range(n_layers) for kind in ("attn", "mlp")
    ]

    def run() -> list[torch.Tensor]:
        out = []
        with torch.inference_mode():
            for task in tasks:
                w_options = bridge.W_U[:, task.option_ids]  # (d, K)
                rows = []
                for k in range(0, len(task.prompts), batch_size):
                    enc = tokenizer(
                        task.prompts[k : k + batch_size], padding=True, return_tensors="pt"
                    )
                    _, cache = bridge.run_with_cache(
                        enc["input_ids"],
                        attention_mask=enc["attention_mask"],
                        names_filter=names,
                        pos_slice=-1,
                        return_type=None,
                        logits_to_keep=1,
                        output_attentions=False,
                    )
                    stack = cache.decompose_resid(apply_ln=True)  # (L, B, 1, d), scale frozen
                    rows.append(torch.einsum("lbpd,d,dk->blk", stack, bridge.ln_final.w, w_options))
                out.append(torch.cat(rows))
        return out

    return Contender("transformerlens", bridge.original_model, lambda _: run)


def has_transformerlens() -> bool:
    return importlib.util.find_spec("transformer_lens") is not None


def boot_bridge(loaded: LoadedModel) -> Any:
    """A TransformerBridge around ``loaded.model`` (which it rewires: give it its own copy)."""
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(
        loaded.source.path, hf_model=loaded.model, tokenizer=loaded.tokenizer, device="cpu"
    )


def load() -> LoadedModel:
    source = resolve_source(DEMO_MODEL, None, None, False)
    return load_model(source, load_tokenizer(source), torch.device("cpu"), torch.float32)


def contenders(
    names: list[str], tasks: list[Task], batch_size: int, loaded: LoadedModel
) -> list[Contender]:
    """The named contenders; TransformerLens gets a second copy of the model."""
    tok = loaded.tokenizer
    make: dict[str, Callable[[], Contender]] = {
        "plain": lambda: plain(loaded.model, tok, tasks, batch_size),
        "plain-floor": lambda: plain_floor(loaded, tasks),
        "layerdiv-fixed": lambda: layerdiv("layerdiv-fixed", loaded, tasks, batch_size),
        "layerdiv-auto": lambda: layerdiv("layerdiv-auto", loaded, tasks, None),
        "transformerlens": lambda: transformerlens(boot_bridge(load()), tok, tasks, batch_size),
    }
    return [make[name]() for name in names]


def timed(contender: Contender) -> float:
    """Seconds of one run, on a fresh scratch folder made and removed outside the clock."""
    with tempfile.TemporaryDirectory(prefix="layerdiv-bench-") as tmp:
        run = contender.prepare(Path(tmp))
        gc.collect()
        start = time.perf_counter()
        run()
        return time.perf_counter() - start


def rss_mib(field: str) -> float:
    """``VmRSS`` (current) or ``VmHWM`` (peak since the last reset) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024 / MIB
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure_memory(name: str, n: int, seed: int, batch_size: int) -> None:
    """Subprocess side of ``--memory-of``: print one JSON line with this contender's memory."""
    loaded = load()
    with tempfile.TemporaryDirectory(prefix="layerdiv-bench-") as tmp:
        tasks = workload(Path(tmp) / "tasks", n, seed, loaded.tokenizer)
        if name == "transformerlens":  # one model copy here: the bridge wraps the loaded one
            contender = transformerlens(boot_bridge(loaded), loaded.tokenizer, tasks, batch_size)
        else:
            (contender,) = contenders([name], tasks, batch_size, loaded)
        run = contender.prepare(Path(tmp) / "store")
        with torch.inference_mode():  # page in the weights (safetensors are memory-mapped)
            contender.model(input_ids=torch.tensor([[tasks[0].option_ids[0]]]), use_cache=False)
        gc.collect()
        before = rss_mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        run()
        peak = rss_mib("VmHWM")
    print(json.dumps({"before": before, "peak": peak}))


def memory_of(name: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--memory-of", name, "--n", str(args.n)]
    cmd += ["--seed", str(args.seed), "--batch-size", str(args.batch_size)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"--memory-of {name} failed:\n{done.stderr[-3000:]}")
    result: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def record_widths(model: Any) -> tuple[list[tuple[int, int]], Any]:
    """(rows, padded width) of every forward pass of ``model``, and the hook's handle."""
    shapes: list[tuple[int, int]] = []

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        shapes.append((int(ids.shape[0]), int(ids.shape[1])))

    return shapes, model.register_forward_pre_hook(hook, with_kwargs=True)


def stored(store: Path, task: str) -> tuple[np.ndarray, np.ndarray, float]:
    """Component logits (N, L, K), model option logits (N, K) and the largest sum error that
    layerdiv stored for ``task``."""
    db = Store(store)
    comp = db.scan("components", tasks=[task]).sort("instance", "component", "option").collect()
    inst = db.scan("instances", tasks=[task]).sort("instance").collect()
    n, k = inst.height, len(inst["model_logits"][0])
    logits = comp["logit"].to_numpy().reshape(n, -1, k)
    return logits, np.array(inst["model_logits"].to_list()), inst["sum_error"].to_numpy().max()


def warm_up_and_check(runs: list[Contender], tasks: list[Task]) -> None:
    """Run each contender once, untimed; print its forward passes; stop unless the plain forward
    and TransformerLens agree with what layerdiv-fixed stored."""
    real = sum(sum(t.lengths) for t in tasks)
    print(f"\nwarm-up: forward passes and padded tokens ({real} prompt tokens in all)")
    with tempfile.TemporaryDirectory(prefix="layerdiv-bench-") as tmp:
        results: dict[str, Any] = {}
        for c in runs:
            shapes, handle = record_widths(c.model)
            try:
                results[c.name] = c.prepare(Path(tmp) / c.name)()
            finally:
                handle.remove()
            padded = sum(rows * width for rows, width in shapes)
            attention = c.model.config._attn_implementation
            print(
                f"  {c.name:<16} {len(shapes):>4} passes {padded:>7} tokens "
                f"({1 - real / padded:4.0%} padding), {attention} attention"
            )
        ref = [stored(Path(tmp) / "layerdiv-fixed", t.name) for t in tasks]
        print(f"  layerdiv's own check: max relative sum error {max(r[2] for r in ref):.1e}")
        checks = [
            ("plain", "option logits", 1),
            ("plain-floor", "option logits", 1),
            ("transformerlens", "component logits", 0),
        ]
        for other, what, which in checks:
            if other not in results:
                continue
            diff = max(
                float(np.abs(results[other][i].numpy() - ref[i][which]).max())
                for i in range(len(tasks))
            )
            top = max(float(np.abs(r[which]).max()) for r in ref)
            print(f"  max |{other} - layerdiv| over all {what}: {diff:.1e} (max |logit| {top:.1f})")
            if not diff <= AGREE_TOL:
                raise SystemExit(f"{other} computes something else than layerdiv: stopping")


def time_rounds(runs: list[Contender], rounds: int) -> dict[str, list[float]]:
    """Seconds per round of each contender; round r starts with contender r (mod count)."""
    times: dict[str, list[float]] = {c.name: [] for c in runs}
    print(f"\n{rounds} rounds, rotating order:")
    for r in range(rounds):
        k = r % len(runs)
        for c in runs[k:] + runs[:k]:
            times[c.name].append(timed(c))
        done = ", ".join(f"{n} {t[-1]:.2f} s" for n, t in times.items())
        print(f"  round {r + 1}: {done}; load average {os.getloadavg()[0]:.2f}")
    return times


def report(
    times: dict[str, list[float]], memory: dict[str, dict[str, float]], n: int, batch_size: int
) -> tuple[float, list[list[Any]]]:
    """Print the table and the targets; return layerdiv-auto / plain-floor (the median of
    per-round ratios) and the docs' table (:data:`COLUMNS`)."""
    base_t, base_m = times["plain"], memory["plain"]
    ratio = {
        c: statistics.median(a / b for a, b in zip(t, base_t, strict=True))
        for c, t in times.items()
    }
    peak = {c: m["peak"] / base_m["peak"] for c, m in memory.items()}
    grow = {
        c: (m["peak"] - m["before"]) / (base_m["peak"] - base_m["before"])
        for c, m in memory.items()
    }
    print(
        f"\n{'contender':<16} {'median s':>8} {'inst/s':>7} {'ratio':>6} | {'peak MiB':>8} "
        f"{'before':>7} {'increment':>9} {'peak ratio':>10} {'incr ratio':>10}"
    )
    for c, t in times.items():
        m = memory[c]
        sec = statistics.median(t)
        print(
            f"{c:<16} {sec:8.2f} {n / sec:7.1f} {ratio[c]:6.3f} | {m['peak']:8.0f} "
            f"{m['before']:7.0f} {m['peak'] - m['before']:9.0f} {peak[c]:10.3f} {grow[c]:10.3f}"
        )
    print(
        "\nratio: median over rounds of (contender s / plain s) in the same round; peak: RSS while "
        "running once in a fresh process; before: RSS after loading (and booting), before the run."
    )
    print("targets:")
    for c in ("layerdiv-fixed", "layerdiv-auto"):
        print(
            f"  {c}: time ratio {ratio[c]:.3f} <= {TARGET_RATIO} {_met(ratio[c] <= TARGET_RATIO)}; "
            f"peak ratio {peak[c]:.3f} <= {TARGET_MEMORY} {_met(peak[c] <= TARGET_MEMORY)}"
        )
        if "transformerlens" in times:
            tl = "transformerlens"
            ahead = ratio[c] <= CLEAR_LEAD * ratio[tl] and peak[c] <= CLEAR_LEAD * peak[tl]
            print(
                f"    <= {CLEAR_LEAD} x transformerlens on both (time ratio {ratio[tl]:.3f}, "
                f"peak ratio {peak[tl]:.3f}) {_met(ahead)}"
            )
    floor = statistics.median(
        a / b for a, b in zip(times["layerdiv-auto"], times["plain-floor"], strict=True)
    )
    print(
        f"  layerdiv-auto / plain-floor (the same batches: layerdiv's own overhead) {floor:.3f} "
        f"<= {TARGET_RATIO} {_met(floor <= TARGET_RATIO)}"
    )
    print(f"  (batch size {batch_size} for plain, layerdiv-fixed and transformerlens)")
    return floor, [
        [LABELS[c].format(batch_size=batch_size), round(statistics.median(t), 2),
         round(n / statistics.median(t), 1), round(ratio[c], 3), round(memory[c]["peak"]),
         round(peak[c], 3)]
        for c, t in times.items()
    ]  # fmt: skip


COLUMNS = ["contender", "median s", "instances/s", "time / plain", "peak RSS MiB", "peak / plain"]
LABELS = {
    "plain": "plain forward, `logits_to_keep=1`, batches of {batch_size} in arrival order",
    "plain-floor": "plain forward over exactly the batches `layerdiv extract` forms (the fair "
    "floor)",
    "layerdiv-fixed": "`layerdiv extract`, batches of {batch_size}",
    "layerdiv-auto": "`layerdiv extract`, `--batch-size auto`",
    "transformerlens": "TransformerLens (`TransformerBridge`, the same decomposition), batches "
    "of {batch_size}",
}
"""The results file's columns and each contender's row label."""


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=300, help="prompts in all, over the demo tasks")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (after a warm-up)")
    parser.add_argument(
        "--batch-size", type=int, default=16, help="for plain, layerdiv-fixed, transformerlens"
    )
    parser.add_argument("--seed", type=int, default=0, help="demo task sampling seed")
    parser.add_argument("--memory-of", choices=NAMES, help=argparse.SUPPRESS)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        args.n, args.rounds, args.batch_size = 6, 1, 2
    if args.memory_of:
        measure_memory(args.memory_of, args.n, args.seed, args.batch_size)
        return
    names = list(NAMES)
    if not has_transformerlens():
        names.remove("transformerlens")
        print("transformer-lens is not installed (pip install 'layerdiv[bench]'): skipping it")
    print(f"command: {shlex.join(['python', *sys.argv])}")
    dists = ["torch", "transformers"] + ["transformer-lens"] * ("transformerlens" in names)
    versions = ", ".join(f"{d} {metadata.version(d)}" for d in dists)
    loads = [os.getloadavg()[0]]
    print(
        f"machine: {_cpu()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; "
        f"load average {loads[0]:.2f}; {versions}"
    )
    loaded = load()
    with tempfile.TemporaryDirectory(prefix="layerdiv-bench-") as tmp:
        tasks = workload(Path(tmp), args.n, args.seed, loaded.tokenizer)
        lengths = [x for t in tasks for x in t.lengths]
        print(
            f"model: {DEMO_MODEL} fp32 cpu; prompts: {len(lengths)} ("
            + ", ".join(f"{t.name} {len(t.prompts)}" for t in tasks)
            + f"), tokens mean {statistics.mean(lengths):.1f}, max {max(lengths)}"
        )
        runs = contenders(names, tasks, args.batch_size, loaded)
        warm_up_and_check(runs, tasks)
        times = time_rounds(runs, args.rounds)
    print("\nmemory: one fresh process per contender")
    memory = {name: memory_of(name, args) for name in names}
    own, table = report(times, memory, len(lengths), args.batch_size)
    loads.append(os.getloadavg()[0])
    print(f"\nload average at the end: {loads[-1]:.2f}")
    record("bench_extract", COLUMNS, table, loads,
           formats=["", ".2f", ".1f", ".3f", ".0f", ".3f"],
           own_overhead=round(own, 3), target=TARGET_RATIO)  # fmt: skip


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
