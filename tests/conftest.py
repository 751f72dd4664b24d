"""Shared fixtures: tiny randomly initialised models of every supported family, a tiny tokenizer,
and small local tasks. Every model here is asserted tiny (well under a million parameters)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _worker_threads() -> None:
    """Under pytest-xdist (``make pytest``: one worker per CPU), each worker's torch and BLAS
    get their share of the CPUs (``OMP_NUM_THREADS``, unless set), set before torch is imported:
    workers that each run a thread per CPU would oversubscribe them."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers and "OMP_NUM_THREADS" not in os.environ:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        os.environ["OMP_NUM_THREADS"] = str(max(1, (cpus or 1) // int(workers)))


_worker_threads()


def _kernels() -> str:
    """torch's CPU kernels and threads, checked against ``ATEN_CPU_CAPABILITY`` and
    ``OMP_NUM_THREADS`` where they are set (``make numerical``: the portable kernels, one
    thread), so that a pass meant to run on them cannot silently run on others."""
    import torch

    capability, threads = torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
    want = os.environ.get("ATEN_CPU_CAPABILITY")
    if want and capability.lower() != want.lower():
        raise pytest.UsageError(f"ATEN_CPU_CAPABILITY={want} but torch runs {capability}")
    want_threads = os.environ.get("OMP_NUM_THREADS")
    if want_threads and threads != int(want_threads):
        raise pytest.UsageError(f"OMP_NUM_THREADS={want_threads} but torch runs {threads}")
    return f"torch CPU kernels: {capability}, {threads} thread(s)"


def pytest_sessionstart(session: pytest.Session) -> None:
    _kernels()


def pytest_report_header(config: pytest.Config) -> str:
    return _kernels()


TINY_PARAMS = 1_000_000
WORDS = [
    "the",
    "a",
    "movie",
    "film",
    "was",
    "great",
    "terrible",
    "good",
    "bad",
    "awful",
    "lovely",
    "boring",
    "fun",
    "plot",
    "actor",
    "story",
    "question",
    "answer",
    "was",
    "that",
    "sentence",
    "positive",
    "negative",
    "yes",
    "no",
    "sports",
    "business",
    "world",
    "science",
    "news",
    "article",
    "label",
    "describes",
    "what",
    "best",
]


def _tiny_config(family: str, vocab: int) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    gqa = dict(common, num_key_value_heads=2)
    _opt: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    configs = {
        "llama": lambda: tf.LlamaConfig(**gqa),
        "mistral": lambda: tf.MistralConfig(**gqa),
        "qwen2": lambda: tf.Qwen2Config(**gqa),
        "qwen3": lambda: tf.Qwen3Config(**gqa, head_dim=8),
        "phi3": lambda: tf.Phi3Config(**gqa, pad_token_id=0),
        "gemma": lambda: tf.GemmaConfig(**gqa, head_dim=8),
        "gemma2": lambda: tf.Gemma2Config(**gqa, head_dim=8, final_logit_softcapping=None),
        "gemma3": lambda: tf.Gemma3TextConfig(**gqa, head_dim=8),
        "phi": lambda: tf.PhiConfig(**common),
        "gpt2": lambda: tf.GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64
        ),
        "gpt_neox": lambda: tf.GPTNeoXConfig(**common, use_parallel_residual=True),
        "gpt_neox_sequential": lambda: tf.GPTNeoXConfig(**common, use_parallel_residual=False),
        "gptj": lambda: tf.GPTJConfig(
            vocab_size=vocab,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            rotary_dim=4,
            bos_token_id=1,
            eos_token_id=2,
        ),
        "opt": lambda: tf.OPTConfig(**_opt, word_embed_proj_dim=32),
        "opt_post_norm": lambda: tf.OPTConfig(
            **_opt, word_embed_proj_dim=32, do_layer_norm_before=False
        ),
        "gemma2_softcap": lambda: tf.Gemma2Config(**gqa, head_dim=8, final_logit_softcapping=5.0),
        "bert": lambda: tf.BertConfig(
            vocab_size=vocab,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
        ),
    }
    return configs[family]()


FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi",
    "gpt2",
    "gpt_neox",
    "gpt_neox_sequential",
    "gptj",
    "opt",
)


def tiny_model(family: str, vocab: int, seed: int = 0) -> Any:
    """A randomly initialised causal LM of ``family`` (fp32, eval mode)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _tiny_config(family, vocab)
    config.tie_word_embeddings = family in ("llama", "gemma", "gpt2")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family == "phi":  # give the parallel-block family an lm_head bias, as phi-2 has
        with torch.no_grad():
            model.lm_head.bias.normal_()
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    assert n < TINY_PARAMS, f"{family} test model has {n} parameters"
    return model


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on a few words (GPT-2 style leading-space tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20 + WORDS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer: Any) -> Any:
    """``model_dirs(family)``: a saved tiny model folder with the tokenizer (made once)."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            path = tmp_path_factory.mktemp(f"model-{family}")
            tiny_model(family, len(tokenizer)).save_pretrained(path)
            tokenizer.save_pretrained(path)
            made[family] = path
        return made[family]

    return get


def _write_task(folder: Path, n: int = 24, stem: str = "reviews", **overrides: Any) -> Path:
    """A local sentiment task (``stem``.yaml + ``stem``.jsonl) of ``n`` instances in ``folder``,
    named ``stem`` unless ``overrides`` say otherwise; returns the YAML path."""
    import random

    rng = random.Random(n)
    rows = []
    for i in range(n):
        words = rng.choices(WORDS, k=rng.randint(2, 20))
        rows.append({"text": " ".join(words), "sentiment": ["negative", "positive"][i % 2]})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {
        "name": stem,
        "data": f"{stem}.jsonl",
        "template": "{{ text }}\nQuestion: Was that sentence positive or negative? "
        "Answer: {{ answer }}",
        "options": ["negative", "positive"],
        "label": "{{ sentiment }}",
        "n": n,
        **overrides,
    }
    path = folder / f"{stem}.yaml"
    path.write_text(json.dumps(spec))  # JSON is valid YAML
    return path


@pytest.fixture(scope="session")
def build_model(tokenizer: Any) -> Any:
    """``build_model(family, seed=0)``: a tiny random model sized for the test tokenizer."""
    return lambda family, seed=0: tiny_model(family, len(tokenizer), seed)


@pytest.fixture(scope="session")
def make_task() -> Any:
    """``make_task(folder, n=24, stem="reviews", **yaml_overrides)``: a local task's YAML path."""
    return _write_task


def stored_counts(output: str, task: str = "reviews") -> tuple[int, int, int]:
    """(instances stored, requested, new this run) from ``layerdiv extract``'s summary line."""
    pattern = rf"\b{task}: (\d+)/(\d+) instances stored \((?:(\d+) new|none new|nothing to do)"
    m = re.search(pattern, output)
    assert m, output
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@pytest.fixture(scope="session")
def stored() -> Any:
    """``stored(output, task="reviews")``: :func:`stored_counts` of an extract run's output."""
    return stored_counts


def write_synthetic_store(
    root: Path, seed: int, n: int, blocks: tuple[int, int], chunk: int | None = None
) -> Path:
    """A synthetic store of two models (``org/small`` with ``blocks[0]`` blocks and 1e8
    parameters, ``org/large`` with ``blocks[1]`` and 2e9) x two tasks (``boolq``, 2 options;
    ``mnli``, 3) of ``n`` random instances each."""
    import numpy as np

    from layerdiv.analyze.synthetic import random_partition, write_partition

    rng = np.random.default_rng(seed)
    for model, n_blocks, params in (("org/small", blocks[0], 1e8), ("org/large", blocks[1], 2e9)):
        for task, k in (("boolq", 2), ("mnli", 3)):
            logits, gold, rms, kinds = random_partition(rng, n, n_blocks, k)
            write_partition(
                root, model, task, logits, gold, kinds, rms, n_params=int(params), chunk=chunk
            )
    return root


DEMO = Path(os.environ.get("LAYERDIV_DEMO", Path(__file__).parent.parent / "layerdiv-demo"))
"""The folder ``make demo`` writes; ``make test`` points ``LAYERDIV_DEMO`` at the quick demo
(``layerdiv demo --quick``) it makes before pytest runs."""


def demo_profile(out: Path) -> Any:
    """The ``layerdiv.demo.DemoProfile`` whose tasks (its default ``--n``, seed 0) the demo
    folder ``out`` holds, as this version writes them; None where it holds none."""
    from layerdiv.demo import PROFILES, demo_task_files

    for profile in PROFILES.values():
        _, texts = demo_task_files(out / "tasks", profile.n, 0, profile)
        if all(p.is_file() and p.read_text() == text for p, text in texts.items()):
            return profile
    return None


def _holds(out: Path, steps: Any) -> bool:
    """Whether the store of demo folder ``out`` holds complete partitions of every (model, task)
    of ``steps`` (``DemoStep``)."""
    from layerdiv.demo import SIBLING
    from layerdiv.store import Store

    if not (out / "store").is_dir():
        return False
    done = {
        (SIBLING if p.manifest.model.endswith(SIBLING) else p.manifest.model, p.task)
        for p in Store(out / "store").partitions
        if p.n_done >= p.manifest.n_requested > 0 and not p.incomplete()
    }
    return all((m, t) in done for s in steps for m in s.models for t in s.tasks)


@pytest.fixture(scope="session")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``demo(*tasks, models=None, profile=None)``: a demo folder (``tasks/``, ``store/``, the
    sibling) whose store holds the demo's extraction of ``tasks`` (``layerdiv.demo.demo_steps``)
    for ``models`` (None: every model its steps name) under ``profile`` (a ``DemoProfile``;
    None: any): the one ``make test``'s demo made (:data:`DEMO`) where it holds them, complete,
    for this version's tasks; else one extracted here of those steps alone (the quick profile
    where none is asked for), once per session (and xdist worker)."""
    from dataclasses import replace

    from layerdiv.demo import QUICK, demo_steps, extract_demo

    built: dict[tuple[Any, ...], Path] = {}

    def steps_of(profile: Any, tasks: tuple[str, ...], models: Any) -> list[Any]:
        return [
            replace(s, tasks=tuple(t for t in s.tasks if t in tasks),
                    models=tuple(m for m in s.models if models is None or m in models))
            for s in demo_steps(profile)
            if set(s.tasks) & set(tasks)
        ]  # fmt: skip

    def get(*tasks: str, models: tuple[str, ...] | None = None, profile: Any = None) -> Path:
        held = demo_profile(DEMO)
        if (
            held is not None
            and profile in (None, held)
            and _holds(DEMO, steps_of(held, tasks, models))
        ):
            return DEMO
        profile = profile or QUICK
        if (tasks, models, profile.name) not in built:
            out = tmp_path_factory.mktemp("demo")
            extract_demo(out, profile.n, 0, steps_of(profile, tasks, models), profile)
            built[tasks, models, profile.name] = out
        return built[tasks, models, profile.name]

    return get


def tables_as_version(root: Path, version: int) -> None:
    """Every table file under store ``root`` rewritten as schema ``version`` wrote it: the
    columns that version's schema has, in its types (the tests of old stores)."""
    import pyarrow.parquet as pq

    from layerdiv.measurements import tables_of

    for table, schema in tables_of(version).items():
        for part in root.glob(f"{table}/**/*.parquet"):
            data = pq.read_table(part)
            pq.write_table(data.select(schema.names).cast(schema), part, write_page_checksum=True)
