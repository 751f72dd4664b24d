"""GPU extraction benchmark: instances/s and the fraction of the GPU's bf16 matmul peak that
``layerdiv extract`` reaches on large models (random weights from real hub configs), next to a
plain forward pass over the same prompts.

It runs the real extraction path (``plan_task`` + ``extract_task``: length-sorted token-budget
batches, hooks, decomposition, sum check, Parquet writing) on real prompts (the demo tasks) with
a real tokenizer (any local tokenizer folder; ids only need to fit the model's vocabulary).

Prepare the assets on a machine that has them, then run on the GPU node::

    python benchmarks/bench_gpu.py --prepare .bench          # tokenizer + BoolQ-shaped task
    python benchmarks/bench_gpu.py --assets .bench --models llama-3.1-8b qwen2.5-32b

``--prepare`` writes by default one task of 1,800 prompts built like BoolQ's (the paper's prompt
lengths, about 150 tokens: its template around BBC News articles cut to 95 words); with
``--prompts demo``, the demo tasks (46 tokens on average) instead.

``--quick`` (no GPU needed) prepares 30 demo prompts in a temporary folder and runs the same
path on the CPU in float32 with a tiny random Llama (:data:`QUICK_CONFIG`, 2 blocks): the check
that the script still runs.

Useful FLOPs count only real (unpadded) tokens: 2 x (block linear weights) per token, causal
attention 2 x 2 x T(T+1)/2 x (heads x head_dim) per layer, and the option-logit head at one
position. The peak is measured here (an 8192^3 bf16 matmul), not taken from a datasheet.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from common import add_quick, record

# Shapes copied from the models' config.json on the hub (weights are random: timing only).
CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    ),
    "qwen2.5-32b": dict(
        model_type="qwen2", hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
    ),
}  # fmt: skip
QUICK_CONFIG: dict[str, Any] = dict(
    model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
    max_position_embeddings=2048, tie_word_embeddings=True,
)  # fmt: skip
"""``--quick``'s model: SmolLM2's vocabulary size (its tokenizer), everything else tiny."""


PASSAGE_WORDS = 95
"""Words of article per passage: with BoolQ's template, prompts of about 150 tokens (the paper's
BoolQ prompts; SmolLM2's tokenizer, news text)."""
TOPICS = {
    "business": "business",
    "entertainment": "entertainment",
    "politics": "politics",
    "sports": "sport",
    "tech": "technology",
}
"""BBC News topic folder -> the word the yes/no question uses."""


def write_boolq_shaped(folder: Path, n: int, seed: int = 0) -> Path:
    """A yes/no task built like BoolQ's (its template and options from the built-in ``boolq``
    task) on real text: a BBC News article cut to :data:`PASSAGE_WORDS` words, and the question
    whether it is about a topic (its own for half the instances, another one for the rest)."""
    from layerdiv.demo import bbc_articles
    from layerdiv.extract.tasks import load_task

    boolq = load_task("boolq")
    rng = random.Random(seed)
    rows = []
    for article in rng.sample(bbc_articles(paragraphs=8), n):
        own = article["label"]
        asked = own if rng.random() < 0.5 else rng.choice([t for t in TOPICS if t != own])
        rows.append(
            {
                "passage": " ".join(article["text"].split()[:PASSAGE_WORDS]),
                "question": f"is this news article about {TOPICS[asked]}",
                "label": int(asked == own),  # boolq's options are False, True
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "boolq-bbc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {
        "name": "boolq-bbc",
        "description": "BoolQ-shaped yes/no questions on BBC News articles (benchmark prompts).",
        "data": "boolq-bbc.jsonl",
        "template": boolq.template,
        "options": list(boolq.options),
        "label": boolq.label,
        "n": n,
    }
    path = folder / "boolq-bbc.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def prepare(folder: Path, n: int, prompts: str) -> None:
    """Write the tokenizer and the tasks into ``folder`` (run where they are installed):
    ``boolq`` writes one BoolQ-shaped task of ``n`` instances (the paper's prompt lengths),
    ``demo`` the demo tasks, ``n`` instances in all."""
    from common import demo_choice_tasks

    from layerdiv.demo import DEMO_MODEL, DEMO_TASKS
    from layerdiv.extract.batching import tokenize
    from layerdiv.extract.models import load_tokenizer, resolve_source
    from layerdiv.extract.tasks import instances, load_task

    tokenizer = load_tokenizer(resolve_source(DEMO_MODEL, None, None, False))
    tokenizer.save_pretrained(folder / "tokenizer")
    if prompts == "boolq":
        tasks = [write_boolq_shaped(folder / "tasks", n)]
    else:
        tasks = demo_choice_tasks(folder / "tasks", n // len(DEMO_TASKS), seed=0)
    for path in tasks:
        spec = load_task(str(path))
        prompts_ = [i.prompt for i in instances(spec, spec.n)]
        lengths = [len(x) for x in tokenize(tokenizer, prompts_, 1 << 20)[0]]
        print(
            f"{spec.name}: {len(lengths)} prompts, tokens mean {statistics.mean(lengths):.0f}, "
            f"max {max(lengths)}"
        )
    print(f"assets in {folder}")


def matmul_peak(device: torch.device, size: int = 8192, reps: int = 10) -> float:
    """Measured bf16 matmul throughput in TFLOP/s."""
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * size**3 * reps / (time.perf_counter() - t) / 1e12


def useful_flops(model: Any, lengths: list[int]) -> float:
    """Forward FLOPs over unpadded prompts (see the module docstring)."""
    cfg = model.config
    block_linear = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and ".layers." in f".{name}"
    )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn_width = cfg.num_attention_heads * head_dim
    total = 0.0
    for t in lengths:
        total += 2 * t * block_linear
        total += cfg.num_hidden_layers * 2 * 2 * (t * (t + 1) / 2) * attn_width
        total += 2 * cfg.hidden_size * cfg.vocab_size  # lm_head at the last position
    return total


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's; nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def settle(device: torch.device) -> None:
    """Before a timed phase: wait for queued work and return the allocator's cached blocks, so
    that each phase starts from the same memory state (a 32B model leaves 13 GiB of an H100 for
    activations: blocks cached by the plain forward's batches made the next extraction round
    spend its time in allocator retries, 2.7x slower)."""
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def plain_forward(model: Any, seqs: list[list[int]], batch_size: int, pad: int) -> float:
    """Seconds for a plain ``logits_to_keep=1`` forward over ``seqs`` in arrival order."""
    device = next(model.parameters()).device
    settle(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for k in range(0, len(seqs), batch_size):
            batch = seqs[k : k + batch_size]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(s)) + s for s in batch], device=device)
            mask = torch.tensor(
                [[0] * (width - len(s)) + [1] * len(s) for s in batch], device=device
            )
            model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
    synchronize(device)
    return time.perf_counter() - start


def bench_model(
    name: str, assets: Path, peak: float | None, rounds: int, plain_batch: int,
    device: torch.device,
) -> list[Any]:  # fmt: skip
    """Extraction and plain forward of the model ``name`` (:data:`CONFIGS`, or ``quick``: the
    tiny :data:`QUICK_CONFIG`) on ``device`` (bf16 on a GPU, fp32 on the CPU); ``peak``: the
    measured matmul peak the useful throughput is a share of (None on the CPU). Returns the
    model's row of the results table (:data:`COLUMNS`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from layerdiv.extract.adapters import adapter_for
    from layerdiv.extract.batching import tokenize
    from layerdiv.extract.config import ExtractConfig
    from layerdiv.extract.models import LoadedModel, ModelSource
    from layerdiv.extract.plan import plan_task
    from layerdiv.extract.runner import extract_task
    from layerdiv.extract.tasks import load_task
    from layerdiv.schemas.kinds import KINDS

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fields = dict(QUICK_CONFIG if name == "quick" else CONFIGS[name])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    t = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"\n== {name}: {n_params / 1e9:.3g}B parameters, built in {time.perf_counter() - t:.0f} s"
    )
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizer")
    tokenizer.padding_side = "left"
    source = ModelSource(name, name, None, "random-init", config, False)
    loaded = LoadedModel(source, model, tokenizer, device, dtype)
    adapter = adapter_for(config)
    found = sorted((assets / "tasks").glob("*.yaml"))
    tasks = [p for p in found if KINDS[load_task(str(p)).kind].scored]  # not the demo's text task
    store = Path(tempfile.mkdtemp(prefix="layerdiv-bench-"))
    try:
        cfg = ExtractConfig(model=name, tasks=[], store=store, progress=False)
        plans = [plan_task(str(p), tokenizer, cfg) for p in tasks]
        # Warm-up (kernels, allocator) on a few instances, then timed rounds on fresh stores.
        warm = ExtractConfig(model=name, tasks=[], store=store / "warm", progress=False, limit=32)
        extract_task(loaded, adapter, plan_task(str(tasks[0]), tokenizer, warm), warm, False)
        ctx = loaded.context_length
        seqs = [s for p in plans for s in tokenize(tokenizer, [i.prompt for i in p.items], ctx)[0]]
        lengths = [len(s) for s in seqs]
        flops = useful_flops(model, lengths)
        times, plain_times, max_err = [], [], 0.0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for r in range(rounds):
            cfg_r = ExtractConfig(model=name, tasks=[], store=store / f"r{r}", progress=False)
            settle(device)
            start = time.perf_counter()
            for path in tasks:
                summary = extract_task(
                    loaded, adapter, plan_task(str(path), tokenizer, cfg_r), cfg_r, False
                )
                max_err = max(max_err, summary.max_sum_error)
            synchronize(device)
            times.append(time.perf_counter() - start)
            plain_times.append(plain_forward(model, seqs, plain_batch, tokenizer.pad_token_id))
        sec, plain = statistics.median(times), statistics.median(plain_times)
        peak_mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        print(
            f"instances: {len(seqs)} from {len(tasks)} tasks; tokens/prompt mean "
            f"{statistics.mean(lengths):.0f}, max {max(lengths)}"
        )
        print(
            f"extraction: {sec:.2f} s median of {rounds} -> {len(seqs) / sec:.0f} instances/s, "
            f"{sum(lengths) / sec:.0f} tokens/s; max decomposition error {max_err:.1e} ({dtype})"
        )
        share = f" = {flops / sec / 1e12 / peak:.1%}" if peak else ""
        print(
            f"useful compute: {flops / sec / 1e12:.3g} TFLOP/s{share} of the measured bf16 matmul "
            f"peak ({f'{peak:.0f} TFLOP/s' if peak else 'not measured on the CPU'})"
        )
        print(
            f"plain forward (arrival order, batch {plain_batch}, logits_to_keep=1): {plain:.2f} s "
            f"-> extraction / plain = {sec / plain:.2f}"
        )
        print(f"peak GPU memory allocated: {peak_mem:.1f} GiB")
        return [
            f"{name} ({n_params / 1e9:.1f}B)", statistics.mean(lengths), len(seqs) / sec,
            sum(lengths) / sec, flops / sec / 1e12, flops / sec / 1e12 / peak if peak else None,
            sec / plain, peak_mem, max_err,
        ]  # fmt: skip
    finally:
        shutil.rmtree(store, ignore_errors=True)
        del model, loaded
        if device.type == "cuda":
            torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", type=Path, help="write assets into this folder and stop")
    parser.add_argument("--n", type=int, default=1800, help="prompts in all (--prepare)")
    parser.add_argument(
        "--prompts",
        choices=["boolq", "demo"],
        default="boolq",
        help="--prepare: BoolQ-shaped prompts (about 150 tokens, the paper's) or the demo tasks",
    )
    parser.add_argument("--assets", type=Path, default=Path(".bench"))
    parser.add_argument("--models", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plain-batch", type=int, default=64)
    add_quick(parser)
    args = parser.parse_args()
    if args.quick:
        with tempfile.TemporaryDirectory(prefix="layerdiv-bench-gpu-") as tmp:
            prepare(Path(tmp), 30, "demo")
            bench_model("quick", Path(tmp), None, 1, 8, torch.device("cpu"))
        return
    if args.prepare:
        prepare(args.prepare, args.n, args.prompts)
        return
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    device = torch.device("cuda")
    peak = matmul_peak(device)
    print(
        f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; "
        f"bf16 matmul peak measured: {peak:.0f} TFLOP/s"
    )
    loads = [os.getloadavg()[0]]
    rows = [bench_model(m, args.assets, peak, args.rounds, args.plain_batch, device)
            for m in args.models]  # fmt: skip
    loads.append(os.getloadavg()[0])
    columns = [
        "model", "tokens/prompt", "instances/s", "tokens/s", "useful TFLOP/s",
        f"share of measured bf16 matmul peak ({peak:.0f} TFLOP/s)", "time / plain forward",
        "peak GPU memory (GiB)", "max decomposition error (relative)",
    ]  # fmt: skip
    formats = ["", ".0f", ",.0f", ",.0f", ".0f", ".1%", ".2f", ".1f", ".1e"]
    record("bench_gpu", columns, rows, loads, formats=formats,
           device=torch.cuda.get_device_name(device), rounds=args.rounds)  # fmt: skip


if __name__ == "__main__":
    main()
