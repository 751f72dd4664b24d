"""GPU timing of the running-text measurements at a real model's size: seconds per document of
``layerdiv extract`` on the handwritten multi-hop questions with answers (``tasks/data/multihop``,
the form of the built-in ``mquake`` task) with each measurement alone, next to the same extraction
without it, on a model with random weights from a real hub config (``bench_gpu.CONFIGS``), in
bf16, with the tokenizer of ``python benchmarks/bench_gpu.py --prepare .bench``.

Per measurement: the seconds per document, what it adds to the extraction without it, the FLOPs
it declares (``Measurement.flops``, what ``extract``'s estimate sums), the rate those FLOPs ran
at, and how long a 20-document study takes (the depth-efficiency paper's follow-up runs 20
questions per setting).

    python benchmarks/bench_gpu_text.py --assets .bench [--model llama-3.1-8b]

``--quick`` (no GPU needed): the tiny random Llama of ``bench_gpu --quick`` on the CPU in float32,
a few steps and documents: the check that the script still runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_gpu import CONFIGS, QUICK_CONFIG, matmul_peak, prepare, settle, synchronize
from common import ROOT, add_quick, record

TASK = ROOT / "tasks" / "data" / "multihop" / "multihop.yaml"
STUDY = 20
"""Documents of the study whose duration the table gives."""
RUNS: dict[str, tuple[dict[str, Any], int]] = {
    "--sinks": ({"sinks": True}, 12),
    "--erase": ({"erase": True, "erase_reference": 4}, 12),
    "--igrad (block, M = 256)": (
        {"igrad": True, "igrad_sites": ("block",), "igrad_steps": 256},
        2,
    ),
    "--igrad (attn, M = 256)": ({"igrad": True, "igrad_sites": ("attn",), "igrad_steps": 256}, 1),
}
"""Label -> (the ``extract`` options, by parameter name; documents timed): each measurement
alone, each timed right after the extraction without it over the same documents."""
QUICK_STEPS = 4


def smaller(options: dict[str, Any], steps: int, docs: int) -> dict[str, Any]:
    """``options`` with at most ``steps`` integration steps and a reference of at most ``docs``
    documents (a warm-up's, ``--quick``'s)."""
    caps = {"igrad_steps": steps, "erase_reference": docs}
    return {k: min(v, caps[k]) if k in caps else v for k, v in options.items()}


def run(
    loaded: Any, adapter: Any, options: dict[str, Any], docs: int, store: Path
) -> tuple[float, list[int]]:
    """Seconds of one extraction of the first ``docs`` documents with ``options`` into a fresh
    store, and the documents' token counts."""
    from layerdiv.extract.config import ExtractConfig, measurement_options
    from layerdiv.extract.plan import plan_task
    from layerdiv.extract.runner import extract_task

    settings = measurement_options(options)
    name = loaded.source.model_id
    cfg = ExtractConfig(model=name, tasks=[], store=store, progress=False, limit=docs,
                        measurement_settings=settings)  # fmt: skip
    plan = plan_task(str(TASK), loaded.tokenizer, cfg)
    lengths = [len(loaded.tokenizer(i.prompt)["input_ids"]) for i in plan.items]
    settle(loaded.device)
    start = time.perf_counter()
    extract_task(loaded, adapter, plan, cfg, False)
    synchronize(loaded.device)
    return time.perf_counter() - start, lengths


def declared_flops(config: Any, options: dict[str, Any], lengths: list[int]) -> float:
    """The FLOPs the measurements of ``options`` declare over documents of ``lengths`` tokens."""
    from layerdiv.extract.config import measurement_options
    from layerdiv.extract.cost import Shape
    from layerdiv.measurements import registered

    shape = Shape.from_config(config)
    total = 0.0
    by_name = {m.name: m for m in registered()}
    for name, settings in measurement_options(options).items():
        m = by_name[name]
        full = {**m.defaults(), **{k: v for k, v in settings.items() if v is not None}}
        total += sum(m.flops_of(shape, "text", n, full) for n in lengths)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assets", type=Path, default=Path(".bench"))
    parser.add_argument("--model", default="llama-3.1-8b", choices=list(CONFIGS))
    add_quick(parser)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from layerdiv.extract.adapters import adapter_for
    from layerdiv.extract.models import LoadedModel, ModelSource

    quick = args.quick
    device = torch.device("cpu" if quick else "cuda")
    if not quick and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (or --quick)")
    dtype = torch.float32 if quick else torch.bfloat16
    peak = None if quick else matmul_peak(device)
    tmp = Path(tempfile.mkdtemp(prefix="layerdiv-bench-gpu-text-"))
    try:
        assets = args.assets
        if quick:
            prepare(tmp / "assets", 30, "demo")
            assets = tmp / "assets"
        name = "quick" if quick else args.model
        fields = dict(QUICK_CONFIG if quick else CONFIGS[name])
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizer")
        tokenizer.padding_side = "left"
        source = ModelSource(name, name, None, "random-init", config, False)
        loaded = LoadedModel(source, model, tokenizer, device, dtype)
        adapter = adapter_for(config)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"== {name}: {n_params / 1e9:.3g}B parameters, {dtype}, {device}")
        runs = dict(RUNS)
        if quick:
            runs = {k: (smaller(o, QUICK_STEPS, 2), 2) for k, (o, _) in runs.items()}
        loads = [os.getloadavg()[0]]
        for i, (options, _) in enumerate(runs.values()):  # warm-up: kernels, allocator
            run(loaded, adapter, smaller(options, 2, 1), 1, tmp / f"warm-{i}")
        rows = []
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for i, (label, (options, docs)) in enumerate(runs.items()):
            if not options:
                continue
            # The extraction without it over the same documents, just before: what it adds.
            plain, _ = run(loaded, adapter, {}, docs, tmp / f"plain-{i}")
            seconds, lengths = run(loaded, adapter, options, docs, tmp / f"run-{i}")
            per_doc, extra = seconds / docs, (seconds - plain) / docs
            flops = declared_flops(config, options, lengths) / docs
            rate = flops / extra / 1e12 if extra > 0 else None
            print(
                f"{label}: {docs} documents of {statistics.mean(lengths):.0f} tokens, "
                f"{per_doc:.3f} s each ({plain / docs:.3f} s without it), declared "
                f"{flops / 1e12:.3g} TFLOP each -> {rate or 0:.3g} TFLOP/s; {STUDY} documents: "
                f"{STUDY * per_doc / 60:.1f} min"
            )
            rows.append([label, docs, statistics.mean(lengths), plain / docs, per_doc, extra,
                         flops / 1e12, rate, rate / peak if rate and peak else None,
                         STUDY * per_doc / 60])  # fmt: skip
        loads.append(os.getloadavg()[0])
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        print(f"peak GPU memory allocated: {peak_mem:.1f} GiB")
        columns = [
            "measurement", "documents timed", "tokens/document", "s/document without it",
            "s/document", "added s/document", "declared TFLOP/document", "declared TFLOP/s",
            f"share of measured bf16 matmul peak ({peak or 0:.0f} TFLOP/s)",
            f"{STUDY}-document study (min)",
        ]  # fmt: skip
        formats = ["", "d", ".0f", ".3f", ".3f", ".3f", ".3g", ".0f", ".1%", ".1f"]
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        record("bench_gpu_text", columns, rows, loads, formats=formats, device=device_name,
               model=f"{name} ({n_params / 1e9:.1f}B, random weights)",
               peak_memory_gib=round(peak_mem, 1))  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
