"""`layerdiv extract` end to end on tiny models: the store it writes, resumption, sharding,
batch invariance and every refusal."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.extract.tasks import instances, load_task
from layerdiv.schemas import COMPONENTS, INSTANCES, PROMPT_CHARS, PROMPT_HEAD
from layerdiv.store import Store
from layerdiv.store.manifest import read_manifest
from layerdiv.store.tables import bounded_prompt
from tests.tolerance import FLOAT32, assert_within


def extract(*args: str) -> Any:
    return CliRunner().invoke(main, ["extract", *args], catch_exceptions=False)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def rows(store: Path, table: str) -> pl.DataFrame:
    return Store(store).scan(table).collect().sort(["instance"])


@pytest.mark.numerical
def test_extract_writes_a_checked_store(
    tmp_path: Path, model_dirs: Any, make_task: Any, stored: Any, tokenizer: Any
) -> None:
    task = make_task(tmp_path / "task", n=20)
    store = tmp_path / "store"
    result = extract(
        "--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store)
    )
    assert result.exit_code == 0, result.output
    assert stored(result.output) == (20, 20, 20)
    s = Store(store)
    (info,) = s.partitions
    m = info.manifest
    assert [c.name for c in m.components] == ["embed", "attn.0", "mlp.0", "attn.1", "mlp.1"]
    assert m.options == ["negative", "positive"] and m.option_tokens[0].startswith("Ġ")
    assert m.dtype == "float32" and m.n_requested == 20 and m.n_params > 0
    comps, inst = rows(store, "components"), rows(store, "instances")
    assert comps.height == 20 * 5 * 2 and inst.height == 20
    assert inst["instance"].to_list() == list(range(20))
    # Components add up to the model's own logits, per instance and option, within FLOAT32 of
    # the sum of their magnitudes (and so does the stored sum error).
    totals = (
        comps.group_by("instance", "option")
        .agg(pl.col("logit").sum(), pl.col("logit").abs().sum().alias("terms"))
        .sort("instance", "option")
    )
    assert inst["sum_error"].to_numpy().max() <= FLOAT32 * totals["terms"].to_numpy().max()
    # The rendered prompts are stored (schema 3).
    assert inst["prompt"].to_list() == [it.prompt for it in instances(load_task(str(task)), 20)]
    # ... and their tokens as the vocabulary spells them (schema 10), one per position.
    assert inst["pieces"].list.len().to_list() == inst["n_tokens"].to_list()
    assert (
        inst["pieces"][0][0]
        == tokenizer.convert_ids_to_tokens(tokenizer(inst["prompt"][0])["input_ids"])[0]
    )
    model_logits = np.array(inst["model_logits"].to_list()).reshape(-1)
    assert_within(totals["logit"].to_numpy(), model_logits, totals["terms"].to_numpy())
    # Files carry exactly the declared schemas.
    import pyarrow.parquet as pq

    assert pq.read_schema(info.files("components")[0]).equals(COMPONENTS, check_metadata=False)
    assert pq.read_schema(info.files("instances")[0]).equals(INSTANCES, check_metadata=False)


@pytest.mark.numerical
def test_batch_size_does_not_change_the_numbers(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    task = make_task(tmp_path / "task", n=24)
    model = str(model_dirs("gpt2"))  # absolute positions: left padding must not shift them
    for bs in ("1", "8"):
        out = extract("--model", model, "--task", str(task), "--store", str(tmp_path / bs),
                      "--batch-size", bs)  # fmt: skip
        assert out.exit_code == 0, out.output
    one = rows(tmp_path / "1", "components").sort("instance", "component", "option")
    eight = rows(tmp_path / "8", "components").sort("instance", "component", "option")
    assert one.height == eight.height == 24 * 6 * 2
    # each within FLOAT32 of its column's scale (padding runs other kernels)
    for column in ("logit", "prefix_rms"):
        want = eight[column].to_numpy()
        assert_within(one[column].to_numpy(), want, np.abs(want).max(), what=column)


def test_resume_after_sigkill_stores_each_instance_once(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    n = 400
    task = make_task(tmp_path / "task", n=n)
    store = tmp_path / "store"
    model = str(model_dirs("llama"))
    cmd = [sys.executable, "-m", "layerdiv.cli", "extract", "--model", model, "--task", str(task),
           "--store", str(store), "--chunk-size", "4", "--batch-size", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(store.glob("instances/**/part-*.parquet"))) >= 3:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(Store(store).partitions[0].partition.done_parts())
    assert 3 <= done_before < n // 4, "the run must be killed mid-way"
    subprocess.run(cmd[:-2], check=True, capture_output=True)  # resume, with auto batches
    inst = rows(store, "instances")
    assert inst["instance"].to_list() == list(range(n))
    comps = rows(store, "components")
    assert comps.height == n * 5 * 2
    assert (
        comps.select(pl.struct("instance", "component", "option").n_unique()).item() == comps.height
    )


def test_shards_split_the_work(
    tmp_path: Path, model_dirs: Any, make_task: Any, stored: Any
) -> None:
    task = make_task(tmp_path / "task", n=30)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
            "--chunk-size", "4"]  # fmt: skip
    first = extract(*args, "--shard", "0/2")
    assert first.exit_code == 0 and stored(first.output) == (16, 30, 16)
    second = extract(*args, "--shard", "1/2")
    assert second.exit_code == 0 and stored(second.output) == (30, 30, 14)
    assert rows(store, "instances")["instance"].to_list() == list(range(30))
    again = extract(*args)
    assert "nothing to do" in again.output and stored(again.output) == (30, 30, 0)


def test_a_larger_limit_extends_the_partition(
    tmp_path: Path, model_dirs: Any, make_task: Any, stored: Any
) -> None:
    task = make_task(tmp_path / "task", n=30)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store)]
    assert extract(*args, "--limit", "10").exit_code == 0
    out = extract(*args, "--limit", "25")
    assert stored(out.output) == (25, 25, 15)
    assert rows(store, "instances")["instance"].to_list() == list(range(25))
    assert Store(store).partitions[0].manifest.n_requested == 25


def test_long_prompts_are_left_truncated_and_flagged(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    long = "{{ text }} " * 12 + "\nAnswer: {{ answer }}"  # > 64 tokens, the tiny context
    task = make_task(tmp_path / "task", n=6, template=long)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store))
    assert out.exit_code == 0 and "left-truncated" in out.output
    inst = rows(store, "instances")
    assert inst["truncated"].any() and inst["n_tokens"].max() == 64


def test_refusals_name_the_problem_and_leave_the_store_unchanged(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    store = tmp_path / "store"
    task = make_task(tmp_path / "task", n=8)
    llama = str(model_dirs("llama"))
    assert extract("--model", llama, "--task", str(task), "--store", str(store)).exit_code == 0
    before = snapshot(store)
    changed = make_task(tmp_path / "task2", n=8, template="{{ text }} Answer: {{ answer }}")
    cases = [
        (["--model", llama, "--task", str(changed)], "holds a different extraction"),
        (["--model", llama, "--task", str(task), "--dtype", "fp16"], "different extraction"),
        (["--model", str(model_dirs("bert")), "--task", str(task)], "supported model types"),
        (["--model", str(model_dirs("gemma2_softcap")), "--task", str(task)], "--allow-softcap"),
        (["--model", str(tmp_path / "no-model"), "--task", str(task)], "cannot load the config"),
        (["--model", llama, "--task", "sst3"], "unknown task"),
        (["--model", llama, "--task", str(make_task(tmp_path / "t3", options=["bad", "badly"],
                                                     label="0"))], "same token"),
    ]  # fmt: skip
    for args, message in cases:
        out = extract(*args, "--store", str(store))
        assert out.exit_code == 1, (args, out.output)
        assert message in out.output and "Traceback" not in out.output, out.output
        assert snapshot(store) == before, args
    # With --overwrite the conflicting run replaces the partition.
    out = extract("--model", llama, "--task", str(changed), "--store", str(store), "--overwrite")
    assert out.exit_code == 0
    replaced = read_manifest(Store(store).partitions[0].partition.manifest)
    assert replaced.template_sha256 == load_task(str(changed)).sha256()
    assert rows(store, "instances")["instance"].to_list() == list(range(8))


def test_softcap_models_can_be_decomposed_before_the_cap(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    task = make_task(tmp_path / "task", n=6)
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("gemma2_softcap")), "--task", str(task),
                  "--store", str(store), "--allow-softcap")  # fmt: skip
    assert out.exit_code == 0, out.output
    (info,) = Store(store).partitions
    assert info.manifest.approximate is True
    assert rows(store, "instances")["sum_error"].to_numpy().max() < 1e-5


def test_a_newer_manifest_is_refused(tmp_path: Path) -> None:
    from layerdiv.schemas import SchemaError

    (tmp_path / "manifest.json").write_text(json.dumps({"schema_version": 99}))
    with pytest.raises(SchemaError, match="newer than this layerdiv reads"):
        read_manifest(tmp_path / "manifest.json")


def test_a_nan_names_the_instance_and_component(
    tmp_path: Path, build_model: Any, tokenizer: Any, make_task: Any
) -> None:
    import torch

    from layerdiv.errors import DecompositionError

    model = build_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    folder = tmp_path / "nan-model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    store = tmp_path / "store"
    task = make_task(tmp_path / "task", n=4)
    out = extract("--model", str(folder), "--task", str(task), "--store", str(store))
    assert out.exit_code == 1
    assert "instance 0: component mlp.1 has a NaN or Inf logit" in out.output
    assert not list(store.glob("*/**/part-*.parquet"))
    errors = [line for line in out.output.splitlines() if line.startswith("Error")]
    assert len(errors) == 1 and "Traceback" not in out.output
    assert DecompositionError.__name__ not in out.output


def test_hub_style_dataset_loads_through_datasets(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    """The `dataset:` path (hub loading via `datasets`) works on a local dataset folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = tmp_path / "hubdata" / "data"
    data.mkdir(parents=True)
    table = pa.table({"text": ["good fun", "awful plot", "lovely film"], "label": [1, 0, 1]})
    pq.write_table(table, data / "validation-00000-of-00001.parquet")
    task = make_task(tmp_path / "task", n=3, label="{{ label }}")
    spec = json.loads(task.read_text())
    del spec["data"]
    spec["dataset"] = {"path": str(tmp_path / "hubdata"), "split": "validation"}
    task.write_text(json.dumps(spec))
    store = tmp_path / "store"
    out = extract("--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store))
    assert out.exit_code == 0, out.output
    assert rows(store, "instances")["gold"].to_list() == [1, 0, 1]
    assert Store(store).partitions[0].manifest.runs[0]["instances"] == 3


def test_long_prompts_are_stored_bounded_with_a_marker() -> None:
    text = "".join(chr(ord("a") + i % 26) for i in range(PROMPT_CHARS + 500))
    kept = bounded_prompt(text)
    head, tail = text[:PROMPT_HEAD], text[-(PROMPT_CHARS - PROMPT_HEAD) :]
    assert kept == f"{head}\n[... 500 characters not stored ...]\n{tail}"
    assert bounded_prompt(text[:PROMPT_CHARS]) == text[:PROMPT_CHARS]
