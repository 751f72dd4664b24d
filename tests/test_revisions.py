"""Revisions of a model as keys of the store: two real checkpoints (SmolLM2 and a copy of it with
small noise on every weight, a stand-in for a later training step), the same weights under a
second name refused, the model's facts and loss, and a store of schema version 4."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from click.testing import CliRunner

from layerdiv.analyze import law
from layerdiv.analyze.api import analyze
from layerdiv.analyze.law import law_points
from layerdiv.analyze.synthetic import (
    random_partition,
    text_chunk,
    text_manifest,
    write_partition,
    write_text_partition,
)
from layerdiv.cli import main
from layerdiv.demo import TEXT_TASK, write_demo_tasks
from layerdiv.store import Store
from layerdiv.store.key import KEY
from tests.conftest import tables_as_version

STEP_TOKENS = 2_097_152  # Pythia's tokens per step


def run(*args: str) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def smollm2_copy(folder: Path) -> Path:
    """SmolLM2's weights, config and tokenizer in a folder of our own (the model's id)."""
    from layerdiv.extract.models import resolve_source

    shutil.copytree(resolve_source("smollm2-135m-instruct", None, None, False).path, folder)
    return folder


def perturb(folder: Path, scale: float = 1e-3, seed: int = 0) -> None:
    """Add Gaussian noise of ``scale`` times each tensor's standard deviation to every weight:
    the stand-in for the same model a few training steps later."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for file in folder.glob("*.safetensors"):
        tensors = load_file(file)
        for name, t in tensors.items():
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            spread = t.float().std() if t.numel() > 1 else t.float().abs()
            tensors[name] = (t.float() + scale * spread * noise).to(t.dtype)
        save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.slow
def test_two_checkpoints_of_smollm2_in_one_store(tmp_path: Path) -> None:
    model = smollm2_copy(tmp_path / "smollm2")
    tasks = {p.stem: p for p in write_demo_tasks(tmp_path / "tasks", n=30, seed=0)}
    store = tmp_path / "store"
    common = ["extract", "--model", str(model), "--task", str(tasks[TEXT_TASK]), "--task",
              str(tasks["bbc5"]), "--limit", "8", "--store", str(store),
              "--tokens-per-step", str(STEP_TOKENS)]  # fmt: skip
    first = run(*common, "--revision", "step1000")
    assert "weights fingerprint" in first and "of the model load" in first

    again = CliRunner().invoke(main, [*common, "--revision", "copy-of-step1000", "--step", "1"])
    assert again.exit_code == 1
    (line,) = [x for x in again.output.splitlines() if x.startswith("Error")]
    assert "revision copy-of-step1000 equal those stored as revision step1000" in line

    perturb(model)
    run(*common, "--revision", "step2000")

    st = Store(store)
    assert sorted({(p.key.revision, p.task) for p in st.partitions}) == [
        ("step1000", TEXT_TASK), ("step1000", "bbc5"), ("step2000", TEXT_TASK), ("step2000", "bbc5")
    ]  # fmt: skip
    listing = run("ls", "--store", str(store))
    assert "step1000" in listing and "step2000" in listing and "copy-of" not in listing

    facts = st.models().sort("step")
    assert facts["step"].to_list() == [1000, 2000]
    assert facts["tokens_seen"].to_list() == [1000 * STEP_TOKENS, 2000 * STEP_TOKENS]
    assert set(facts["width"]) == {576} and set(facts["depth"]) == {30}
    assert set(facts["vocab_size"]) == {49152}
    n_total, n_body = facts["n_params"][0], facts["n_params_non_embedding"][0]
    assert n_total - n_body == 49152 * 576  # tied embeddings: one vocabulary matrix
    assert facts["weights_hash"].n_unique() == 2

    out = run("query", "--store", str(store), "SELECT revision, count(*) AS n, "
              "count(loss) AS with_loss FROM tokens GROUP BY ALL ORDER BY revision")  # fmt: skip
    assert "step1000" in out and "step2000" in out
    views = st.duckdb()
    for view in st.tables():
        assert "revision" in views.sql(f"SELECT * FROM {view} LIMIT 0").columns
    joined = views.sql(
        "SELECT m.step, avg(t.loss) FROM tokens t JOIN models m USING (model, revision) "
        "GROUP BY ALL ORDER BY m.step"
    ).fetchall()
    assert [s for s, _ in joined] == [1000, 2000]

    points = law_points(store)
    assert points.height == 2 and points["loss"].is_finite().all()
    assert points["tokens_seen"].to_list() == [1000 * STEP_TOKENS, 2000 * STEP_TOKENS]
    assert 0 < abs(points["loss"][1] - points["loss"][0]) < 0.5  # close, not equal weights
    assert (points["n_tokens"] > 0).all()

    report = tmp_path / "report"
    run("report", "--store", str(store), "--out", str(report))
    text = (report / "report.md").read_text()
    section = text.split("Checkpoints: summaries against the training step")[1]
    assert "step1000" in section and "step2000" in section


def to_version_4(root: Path) -> None:
    """Rewrite a store as schema version 4 wrote it: no ``revision=`` folder level, the hub
    commit in the manifest's ``revision``, no model facts, its tables' columns."""
    for folder in sorted(root.glob("*/model=*/revision=*")):
        for task in folder.iterdir():
            task.rename(folder.parent / task.name)
        folder.rmdir()
    for path in root.glob("manifests/model=*/task=*/manifest.json"):
        data = json.loads(path.read_text())
        data.update(schema_version=4, revision=data["commit"])
        for name in ("commit", "step", "tokens_seen", "weights_hash", "n_layers", "vocab_size",
                     "n_params_non_embedding", "weights"):  # fmt: skip
            del data[name]
        path.write_text(json.dumps(data))
    tables_as_version(root, 4)  # tokens without loss, documents without answer_start, ...


def test_a_version_4_store_reads_as_revision_main(tmp_path: Path) -> None:
    out, tmp_path = tmp_path / "out", tmp_path / "store"
    rng = np.random.default_rng(0)
    logits, gold, rms, kinds = random_partition(rng, 6, 2, 2)
    write_partition(tmp_path, "org/m", "choice", logits, gold, kinds, rms, chunk=3)
    chunks = [(s, 2, text_chunk(rng, range(s, s + 2), 8, 2)) for s in (0, 2)]
    write_text_partition(tmp_path, text_manifest("org/m", "txt", 4, 2, 8, 2), chunks)
    to_version_4(tmp_path)
    assert not list(tmp_path.glob("*/*/revision=*"))

    st = Store(tmp_path)
    assert not st.unreadable
    assert {(p.key.revision, p.manifest.schema_version) for p in st.partitions} == {("main", 4)}
    assert st.manifests()["revision"].to_list() == ["main", "main"]
    tokens = st.scan("tokens").collect()
    assert tokens.height > 0 and tokens["loss"].null_count() == tokens.height
    assert tokens.columns[-len(KEY) :] == list(KEY)
    assert st.duckdb().sql("SELECT DISTINCT revision FROM tokens").fetchall() == [("main",)]
    assert st.models()["depth"].to_list() == [2]  # the block calls, where not recorded
    with pytest.raises(Exception, match="before the model's loss was stored"):
        law_points(st)
    run("analyze", "--store", str(tmp_path), "--out", str(out))

    # Extracting into it again under the same key is refused, not stored twice.
    from layerdiv.store.manifest import Identity
    from layerdiv.store.writer import PartitionWriter, StoreConflict

    writer = PartitionWriter(tmp_path, "org/m", "choice")
    ident = Identity("org/m", "main", "x", "float32", "t", None, ())
    with pytest.raises(StoreConflict, match="layout of schema version 4"):
        writer.check(ident, overwrite=False)


def test_one_partition_key_reads_the_same_in_both_layouts(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    logits, gold, rms, kinds = random_partition(rng, 4, 2, 2)
    for name in ("new", "old"):
        write_partition(tmp_path / name, "org/m", "t", logits, gold, kinds, rms, chunk=2)
    to_version_4(tmp_path / "old")
    new, old = (Store(tmp_path / n).scan("components").collect() for n in ("new", "old"))
    assert new.equals(old) and set(new["revision"]) == {"main"}
    assert pl.Series(Store(tmp_path / "old").partitions[0].key.dirs()).str.contains("=").all()


def test_the_weights_fingerprint_is_reused_until_the_files_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, build_model: Any, tokenizer: Any
) -> None:
    import os

    import torch

    from layerdiv.extract.facts import cached_weights_hash, weights_hash
    from layerdiv.extract.models import load_model, resolve_source

    monkeypatch.setenv("LAYERDIV_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    build_model("llama").save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    def load(dtype: torch.dtype = torch.float32) -> Any:
        source = resolve_source(str(folder), None, None, False)
        return load_model(source, tokenizer, torch.device("cpu"), dtype)

    first, entry = cached_weights_hash(load())
    assert entry is None and first == weights_hash(load().model)
    again, entry = cached_weights_hash(load())
    assert again == first and entry is not None and entry.parent.name == "fingerprints"
    halves, entry = cached_weights_hash(load(torch.bfloat16))  # another dtype: other tensors
    assert entry is None and halves != first

    build_model("llama", seed=1).save_pretrained(folder)  # new weights in the same files
    changed, entry = cached_weights_hash(load())
    assert entry is None and changed != first and changed == weights_hash(load().model)

    (weights,) = folder.glob("*.safetensors")  # a file touched, bytes the same: hashed again
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert cached_weights_hash(load()) == (changed, None)
    entry = cached_weights_hash(load())[1]
    assert entry is not None
    entry.write_text("{not json")  # a damaged cache entry is hashed again, never trusted
    assert cached_weights_hash(load()) == (changed, None)


def two_revision_text_store(root: Path) -> None:
    """Two models, each at revisions step1000 and step2000, of made-up running text (with the
    lens and skip tables)."""
    from dataclasses import replace

    for i, revision in enumerate(("step1000", "step2000")):
        for model in ("org/a", "org/b"):
            manifest = text_manifest(model, "fineweb", 8, 6, 16, 4, lens=True, skips=True)
            manifest = replace(manifest, revision=revision, step=1000 * (i + 1),
                               tokens_seen=1000 * (i + 1) * STEP_TOKENS)  # fmt: skip
            rng = np.random.default_rng([i, len(model)])
            chunks = [(s, 4, text_chunk(rng, range(s, s + 4), 16, 6, lens=True, skips=True))
                      for s in (0, 4)]  # fmt: skip
            write_text_partition(root, manifest, chunks)


def test_the_report_draws_revisions_against_the_step_and_never_pools_them(
    tmp_path: Path,
) -> None:
    store, out = tmp_path / "store", tmp_path / "report"
    two_revision_text_store(store)
    run("report", "--store", str(store), "--out", str(out))
    summary = analyze(store).revision_summary.filter(pl.col("quantity") == "loss")
    assert summary["step"].to_list() == [1000, 2000, 1000, 2000]
    assert summary["value"].is_not_null().all()
    assert (out / "figures" / "revisions.png").stat().st_size > 0
    text = (out / "report.md").read_text()
    section = text.split("## Running text: geometry")[1].split("\n## ")[0]
    rows = [line.split(" | ")[0] for line in section.splitlines() if line.startswith("| org/")]
    assert rows == ["| org/a@step1000", "| org/a@step2000", "| org/b@step1000", "| org/b@step2000"]


SWEEP_LAW = {"c_width": 40.0, "alpha_width": 0.5, "c_tokens": 300.0, "alpha_tokens": 0.3}
"""The width and tokens terms added to the made-up loss (its depth term is 8 / blocks)."""


def sweep_text_store(
    root: Path, models: int = 6, revisions: int = 3, law_of: dict[str, float] = SWEEP_LAW
) -> None:
    """``models`` made-up models of growing depth and of widths in another order, each at
    ``revisions`` revisions (step 1000, 2000, ...) of made-up running text: one law point per
    (model, revision), whose loss has the width and tokens terms of ``law_of`` (none where
    empty) besides its depth term."""
    from dataclasses import replace

    for m in range(models):
        blocks, width = 2 + m, 64 * 2 ** (2 * m % 5)
        for r in range(revisions):
            step = 1000 * (r + 1)
            manifest = text_manifest(f"org/m{m}", "fineweb", 4, blocks, 16, 4, hidden_size=width)
            manifest = replace(manifest, revision=f"step{step}", step=step, n_layers=blocks,
                               tokens_seen=step * STEP_TOKENS)  # fmt: skip
            rng = np.random.default_rng([m, r])
            chunk = text_chunk(rng, range(4), 16, blocks)
            tokens = chunk["tokens"]
            terms = (law_of["c_width"] * width ** -law_of["alpha_width"]
                     + law_of["c_tokens"] * (step * STEP_TOKENS) ** -law_of["alpha_tokens"]
                     if law_of else 0.0)  # fmt: skip
            loss = tokens["loss"].to_numpy(zero_copy_only=False) + terms
            chunk["tokens"] = tokens.set_column(
                tokens.schema.get_field_index("loss"), tokens.schema.field("loss"),
                pa.array(loss, tokens.schema.field("loss").type, from_pandas=True),
            )  # fmt: skip
            write_text_partition(root, manifest, [(0, 4, chunk)])


def test_the_report_fits_the_depth_law_from_a_store_or_says_why_not(tmp_path: Path) -> None:
    store = tmp_path / "store"
    sweep_text_store(store)
    results = analyze(store)
    assert results.depth_law["parameter"].to_list() == list(law.PARAMETERS)
    assert results.depth_law_fit["n_points"].to_list() == [18]
    # The made-up loss is 8 / blocks plus the width and tokens terms of SWEEP_LAW above draws
    # shared by every model: the law exactly.
    fitted = dict(results.depth_law.select("parameter", "estimate").iter_rows())
    assert fitted["alpha_depth"] == pytest.approx(1, abs=1e-3)
    assert fitted["c_depth"] == pytest.approx(8, rel=1e-3)
    for name, value in SWEEP_LAW.items():
        assert fitted[name] == pytest.approx(value, rel=1e-3), name
    points = results.depth_law_points
    assert sorted(set(points["depth"])) == [2.0, 3.0, 4.0, 5.0, 6.0, 7.0] and points.height == 18
    run("report", "--store", str(store), "--out", str(tmp_path / "report"))
    text = (tmp_path / "report" / "report.md").read_text()
    assert "## The depth loss law across models" in text
    assert "figures/depth_law_fineweb.png" in text
    assert (tmp_path / "report" / "figures" / "depth_law_fineweb.png").stat().st_size > 0

    # Fewer points than parameters: the section says why and what adds points (no warning);
    # fit-law says why in one line.
    few = tmp_path / "few"
    sweep_text_store(few, models=2, revisions=2)
    out = CliRunner().invoke(main, ["report", "--store", str(few), "--out", str(tmp_path / "r2")])
    assert out.exit_code == 0, out.output
    assert not [line for line in out.output.splitlines() if "depth_law" in line]
    text = (tmp_path / "r2" / "report.md").read_text()
    section = text.split("## The depth loss law across models")[1].split("\n## ")[0]
    assert "Not fitted: the law has 7 parameters" in section
    assert "this store holds 4 on fineweb" in section and "`layerdiv extract" in section
    out = CliRunner().invoke(
        main, ["fit-law", "--store", str(few), "--task", "fineweb", "--out", str(tmp_path / "f")]
    )
    assert out.exit_code != 0
    assert "4 point(s) to fit (of 4) but the law has 7 parameters" in out.output


def test_a_sweep_whose_loss_follows_depth_alone_is_refused(tmp_path: Path) -> None:
    """Eighteen points whose loss has no width or tokens term: c_width and c_tokens go to 0,
    where alpha_width and alpha_tokens are anything; one line naming them (before, seven
    "estimates", exit 0)."""
    store = tmp_path / "store"
    sweep_text_store(store, law_of={})
    out = CliRunner().invoke(
        main, ["fit-law", "--store", str(store), "--task", "fineweb", "--out", str(tmp_path / "f")]
    )
    assert out.exit_code == 1 and "Traceback" not in out.output
    (line,) = out.output.strip().splitlines()
    assert "the law cannot be identified from these points" in line
    assert "c_width" in line and "c_tokens" in line and "undetermined" in line
    results = analyze(store)
    assert "depth_law" not in results.tables()
    assert any("depth_law" in n and "cannot be identified" in n for n in results.notes)
