"""What an extraction will cost, known before the weights load: the work of each measurement it
writes, in plain forward passes, counted in FLOPs from the model's shape (what each measurement
declares, ``Measurement.flops``), and the seconds that takes at the FLOP rates the benchmarks
measured (docs/benchmarks.md). ``extract`` prints the estimate before a run of more than
:data:`LONG_RUN` seconds, and again once the model is loaded at the rate a short probe measures
on this machine (:func:`probe_rate`), then also before any run of an attribution measurement;
the docs' cost table is generated from :func:`cost_rows`.

FLOPs are counted as in ``benchmarks/bench_text_extract.py``: per token and block, 2 per weight of
q, k, v, o and the MLP and the causal attention scores and values; a readout (final norm aside)
is 2 d V per position. A plain forward reads out one position per sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from layerdiv.measurements import for_kind

CPU_FLOPS = 226.8e9 / 1.35
"""FLOP rate of a plain forward on 2 CPU cores: SmolLM2-135M in fp32, 226.8 GFLOP in 1.35 s wall
(docs/benchmarks.md, running-text extraction cost)."""
GPU_FLOPS = 425e12
"""Useful FLOP rate of an extraction on one GPU in bf16: Llama-3.1-8B at the paper's prompt
lengths (``docs/benchmarks/bench_gpu.json``, which a test keeps it equal to; an H200 there, an
H100 before, within 1% of each other: the work is compute-bound)."""
LONG_RUN = 600.0
"""Seconds above which ``extract`` prints its estimate before it starts."""


@dataclass(frozen=True)
class Shape:
    """What the cost of a pass depends on: width d, blocks L, vocabulary V, the weights of one
    block and the attention's width."""

    d: int
    layers: int
    vocab: int
    block_weights: int
    attention: int
    """4 x heads x head width: the FLOPs per (position, earlier position) pair of one block."""

    @classmethod
    def from_config(cls, config: Any) -> Shape:
        """The shape of a HuggingFace config (Llama-style names)."""
        d, heads = int(config.hidden_size), int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or d // heads)
        kv = int(getattr(config, "num_key_value_heads", None) or heads)
        ffn = int(getattr(config, "intermediate_size", None) or 4 * d)
        weights = 2 * d * heads * head_dim + 2 * d * kv * head_dim + 3 * d * ffn
        return cls(d, int(config.num_hidden_layers), int(config.vocab_size), weights,
                   4 * heads * head_dim)  # fmt: skip

    def block(self, tokens: int) -> float:
        """FLOPs of one block over a sequence of ``tokens`` tokens."""
        return 2 * self.block_weights * tokens + self.attention * tokens * (tokens + 1) / 2

    def readout(self, positions: int = 1) -> float:
        """FLOPs of the unembedding at ``positions`` positions."""
        return 2 * self.d * self.vocab * positions

    def forward(self, tokens: int) -> float:
        """FLOPs of a plain forward pass over one sequence (one position read out)."""
        return self.layers * self.block(tokens) + self.readout()


SMOLLM2 = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
}
"""The config of the demo's model, SmolLM2-135M-Instruct (tests/test_smollm2.py checks it against
the packaged model's), for the docs' cost table."""
DOC_TOKENS = {"choice": 46, "text": 256}
"""Sequence lengths of the docs' cost table: the demo's prompts (45.5 tokens on average) and the
running-text benchmark's documents."""


RunSettings = Mapping[str, Mapping[str, Any]]
"""The measurements of a run, by name: their settings (``TaskPlan.run_settings``)."""


def passes(shape: Shape, kind: str, tokens: int, run_settings: RunSettings) -> float:
    """The work on one sequence of ``tokens`` tokens of a task of ``kind`` (``choice`` or
    ``text``) with the registered measurements ``run_settings`` (by name: their settings; those of
    other kinds left out), in plain
    forward passes over it (FLOPs): the plain pass and what each measurement adds
    (``Measurement.flops_of``)."""
    forward = shape.forward(tokens)
    extra = sum(m.flops_of(shape, kind, tokens, run_settings[m.name]) for m in for_kind(kind)
                if m.name in run_settings)  # fmt: skip
    return (forward + extra) / forward


def seconds(
    shape: Shape, work: float, tokens: int, device: str = "cpu", rate: float | None = None
) -> float:
    """Seconds for ``work`` forward passes over sequences of ``tokens`` tokens each, at the FLOP
    ``rate`` measured on this machine (:func:`probe_rate`), else at the rate the benchmarks
    measured on ``device`` (``cpu``, or a GPU)."""
    return work * shape.forward(tokens) / (rate or (CPU_FLOPS if device == "cpu" else GPU_FLOPS))


Job = tuple[str, RunSettings, Sequence[int]]
"""One task of a run: its kind, its measurements (by name: their settings) and the token
counts of its sequences."""


def run_seconds(shape: Shape, jobs: Sequence[Job], device: str, rate: float | None = None) -> float:
    """Seconds for every job: each sequence costs its plain pass plus what each measurement
    adds (:func:`passes`), at ``rate`` (:func:`seconds`)."""
    total = 0.0
    for kind, run_settings, lengths in jobs:
        for n in lengths:
            total += seconds(shape, passes(shape, kind, n, run_settings), n, device, rate)
    return total


PROBE_SEQUENCES = 4
"""Sequences of the probe's batch (:func:`probe_rate`)."""


def probe_tokens(jobs: Sequence[Job]) -> int:
    """The sequence length of the probe: the median of every job's sequences."""
    lengths = sorted(n for _, _, ns in jobs for n in ns)
    return lengths[len(lengths) // 2] if lengths else 1


def probe_rate(config: Any, tokens: int, timed: float) -> float:
    """FLOP rate of this machine: :data:`PROBE_SEQUENCES` plain forward passes over ``tokens``
    tokens took ``timed`` seconds (``layerdiv.extract.forward.time_forward``)."""
    return PROBE_SEQUENCES * Shape.from_config(config).forward(tokens) / max(timed, 1e-9)


def announce_measured(config: Any, device: str, jobs: Sequence[Job], rate: float) -> None:
    """Print the estimate at this machine's measured FLOP ``rate`` (:func:`probe_rate`) before a
    long run, or before any run of an attribution measurement
    (``Measurement.attribution``), however short."""
    total = run_seconds(Shape.from_config(config), jobs, device, rate)
    attribution = any(m.attribution and m.name in run_settings
                      for kind, run_settings, _ in jobs for m in for_kind(kind))  # fmt: skip
    if total > LONG_RUN or attribution:
        print(measured_line(total, rate), flush=True)


def measured_line(total: float, rate: float) -> str:
    """What ``extract`` prints once the model is loaded (:func:`announce_measured`)."""
    return (
        f"Estimated extraction time: about {_duration(total)} at this machine's measured rate "
        f"of {rate / 1e9:.3g} GFLOP/s (a probe of plain forward passes; FLOPs from the "
        "model's shape and each measurement's passes); the progress bar shows the time left "
        "after the first batch."
    )


def _duration(total: float) -> str:
    return f"{total:.0f} s" if total < 120 else f"{total / 60:.0f} min"


SAMPLE = 256
"""Prompts tokenized to estimate a choice task's prompt lengths."""


def job(
    kind: str,
    run_settings: RunSettings,
    documents: Sequence[Sequence[int]] | None,
    prompts: Sequence[str],
    tokenizer: Any,
) -> Job:
    """A task's job for :func:`run_seconds`: its measurements (by name: their settings) and its
    sequences' token counts (a text task's documents, or a choice task's prompts, :data:`SAMPLE`
    of them tokenized and the mean taken for the others)."""
    if documents is not None:
        return kind, run_settings, [len(d) for d in documents]
    sample = [len(ids) for ids in tokenizer(list(prompts[:SAMPLE]))["input_ids"]]
    mean = round(sum(sample) / max(len(sample), 1))
    return kind, run_settings, [mean] * len(prompts)


def announce(config: Any, device: str, jobs: Sequence[Job]) -> None:
    """Print the estimate of a long run (:func:`estimate_line`) before it starts."""
    line = estimate_line(run_seconds(Shape.from_config(config), jobs, device), device)
    if line is not None:
        print(line, flush=True)


def estimate_line(total: float, device: str) -> str | None:
    """What ``extract`` prints before a run estimated at ``total`` seconds, or None for a short
    one."""
    if total <= LONG_RUN:
        return None
    where = "2 CPU cores" if device == "cpu" else "an H100 or H200 GPU"
    return (
        f"Estimated extraction time: about {total / 60:.0f} min (FLOPs from the model's shape "
        f"at the rate measured on {where}, docs/benchmarks.md); the progress bar shows the "
        "time left after the first chunk."
    )


def costed(kind: str) -> list[tuple[str, RunSettings]]:
    """What the docs' cost table shows for task ``kind``: no option, then each registered
    measurement of the kind at its defaults (its flag) and with each of the further settings it
    declares (``Measurement.costed``: its options)."""
    rows: list[tuple[str, RunSettings]] = [("no option", {})]
    for m in for_kind(kind):
        rows.append((f"`{m.flag}`", {m.name: m.defaults()}))
        for given in m.costed.get(kind, ()):
            settings = {**m.defaults(), **given}
            rows.append((f"`{m.command(settings)}`", {m.name: settings}))
    return rows


def cost_rows(shape: Shape, tokens: dict[str, int]) -> list[list[str]]:
    """The docs' cost table: per task kind and measurement (:func:`costed`), the forward passes
    over a sequence of ``tokens[kind]`` tokens, the CPU seconds per 1,000 tokens and the GPU
    milliseconds per 1,000 tokens (at the rate of :data:`GPU_FLOPS`, measured on an 8B
    model: a small model keeps the GPU less busy, so take it as a lower bound)."""
    rows = []
    for kind, n in tokens.items():
        for label, run_settings in costed(kind):
            work = passes(shape, kind, n, run_settings)
            per_1k = seconds(shape, work, n) * 1000 / n
            gpu_ms = seconds(shape, work, n, "gpu") * 1000 / n * 1000
            rows.append([kind, str(n), label, f"{work:.2f}", f"{per_1k:.1f}", f"{gpu_ms:.2g}"])
    return rows
