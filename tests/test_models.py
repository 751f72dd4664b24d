"""Finding and loading models: refusals before the weights load, the GGUF cache under concurrent
first use, and models spread over devices (CPU + disk offload) giving the same components."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.extract.adapters import adapter_for
from layerdiv.extract.capture import BatchDecomposition, ComponentCapture
from layerdiv.extract.models import load_model, load_tokenizer, resolve_source
from layerdiv.extract.readout import Readout
from layerdiv.store import Store


def extract_fails(*args: str) -> str:
    """Run ``layerdiv extract`` expecting a one-line refusal; returns that line."""
    result = CliRunner().invoke(main, ["extract", *args])
    assert result.exit_code == 1 and result.exception is not None, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    return lines[0]


def no_device() -> str:
    """A CUDA device this machine lacks."""
    return f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"


def test_bad_model_or_device_is_one_line_and_writes_nothing(
    tmp_path: Path, model_dirs: Any, make_task: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    task, store = str(make_task(tmp_path / "task", n=4)), tmp_path / "store"
    llama = model_dirs("llama")
    truncated, cut_header = tmp_path / "truncated", tmp_path / "cut-header"
    for folder, keep in (
        (truncated, 0.5),
        (cut_header, 4 / (llama / "model.safetensors").stat().st_size),
    ):
        shutil.copytree(llama, folder)
        weights = folder / "model.safetensors"
        os.truncate(weights, int(weights.stat().st_size * keep))
    here = "devices here: auto, cpu"
    cases = [
        (["--model", str(llama), "--device", no_device()], "is not available on this machine"),
        (["--model", str(llama), "--device", "bogus"], f"unknown device 'bogus'; {here}"),
        (["--model", "./nope"],
         "cannot load the config of './nope': the folder ./nope does not exist"),
        (["--model", str(tmp_path / "x" / "model")],
         f"the folder {tmp_path}/x/model does not exist"),
        (["--model", str(truncated)], f"weight file {truncated}/model.safetensors is incomplete"),
        (["--model", str(cut_header)], f"weight file {cut_header}/model.safetensors is damaged"),
        (["--model", "smollm2-135m-instruct", "--gguf-file", "other.gguf"],
         "--gguf-file cannot be combined with the alias 'smollm2-135m-instruct'"),
    ]  # fmt: skip
    for args, message in cases:
        line = extract_fails(*args, "--task", task, "--store", str(store))
        assert message in line, line
        assert not store.exists(), args
    (tmp_path / "a-file").write_text("")  # a model cache that cannot be created
    monkeypatch.setenv("LAYERDIV_CACHE", str(tmp_path / "a-file"))
    line = extract_fails("--model", "smollm2-135m-instruct", "--task", task, "--store", str(store))
    assert f"cannot write the converted model to {tmp_path}/a-file/models" in line, line
    assert not store.exists()
    if not torch.cuda.is_available():
        line = extract_fails("--model", str(llama), "--task", task, "--device", "cuda")
        assert line.endswith(f"is built without CUDA); {here}"), line


def split_map(model: Any, blocks: str, on_disk: set[str]) -> dict[str, str]:
    """A device map over the children along ``blocks``: odd blocks and the modules named in
    ``on_disk`` on disk, the rest on the CPU."""
    out, parts = {}, blocks.split(".")
    for depth in range(len(parts) + 1):
        prefix = ".".join(parts[:depth])
        for name, _ in model.get_submodule(prefix).named_children():
            full = f"{prefix}.{name}" if prefix else name
            if depth < len(parts) and name == parts[depth]:
                continue
            odd_block = depth == len(parts) and int(name) % 2 == 1
            out[full] = "disk" if odd_block or full in on_disk else "cpu"
    return out


def plain_and_offloaded(model_dir: Path) -> tuple[Any, Any]:
    """The model loaded on the CPU, and loaded again with its odd blocks, embedding, final norm
    and head on disk (accelerate loads them for each forward pass)."""
    source = resolve_source(str(model_dir), None, None, False)
    tok = load_tokenizer(source)
    cpu = torch.device("cpu")
    plain = load_model(source, tok, cpu, torch.float32).model
    names = {id(m): n for n, m in plain.named_modules()}
    adapter = adapter_for(plain.config)
    on_disk = {adapter.final_norm, *(names[id(m)] for m in
               (plain.get_input_embeddings(), plain.get_output_embeddings()))}  # fmt: skip
    device_map = split_map(plain, adapter.blocks, on_disk)
    assert set(device_map.values()) == {"cpu", "disk"}
    return plain, load_model(source, tok, cpu, torch.float32, device_map).model


def decompose(model: Any, option_ids: list[int], tokenizer: Any) -> BatchDecomposition:
    adapter = adapter_for(model.config)
    capture = ComponentCapture(model, adapter, Readout(model, adapter), option_ids)
    batch = tokenizer(["the movie was great", "a plot"], return_tensors="pt", padding=True)
    with torch.inference_mode():
        model(**batch, use_cache=False)
    capture.remove()
    return capture.decompose()


@pytest.mark.numerical
@pytest.mark.parametrize("family", ["llama", "gpt2", "phi"])
def test_cpu_and_disk_offload_gives_identical_components(
    family: str, model_dirs: Any, tokenizer: Any
) -> None:
    """A model whose odd blocks, embedding, final norm and head live on disk (accelerate loads
    them for each forward pass) decomposes exactly as the model loaded on the CPU."""
    plain, offloaded = plain_and_offloaded(model_dirs(family))
    assert offloaded.get_output_embeddings().weight.device.type == "meta"  # really on disk
    ids = tokenizer([" negative", " positive"])["input_ids"]
    want = decompose(plain, [i[0] for i in ids], tokenizer)
    got = decompose(offloaded, [i[0] for i in ids], tokenizer)
    assert [c.name for c in got.components] == [c.name for c in want.components]
    for field in ("logits", "model_logits", "out_norm", "prefix_rms", "final_rms", "sum_error"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=0, atol=0,
                                   equal_nan=True, msg=field)  # fmt: skip
    assert float(got.sum_error.max()) < 1e-5


def test_device_map_auto_extracts_the_same_store(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    task, model = str(make_task(tmp_path / "task", n=6)), str(model_dirs("gpt2"))
    tables = []
    for name, extra in (("plain", []), ("mapped", ["--device-map", "auto"])):
        args = ["extract", "--model", model, "--task", task, "--store", str(tmp_path / name)]
        result = CliRunner().invoke(main, [*args, *extra], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        tables.append(Store(tmp_path / name).scan("components").collect().sort("instance"))
    assert tables[0].equals(tables[1])


CONVERT = (
    "from layerdiv.extract.models import resolve_source\n"
    "s = resolve_source('smollm2-135m-instruct', None, None, False)\n"
    "print('RESULT', s.path, s.weights_fingerprint)\n"
)


@pytest.mark.slow
def test_concurrent_first_use_converts_once_after_a_killed_conversion(tmp_path: Path) -> None:
    """A conversion killed midway leaves no folder a later run takes for a finished one; two
    processes then starting together with that cache convert once, and both succeed."""
    env = {**os.environ, "LAYERDIV_CACHE": str(tmp_path / "cache")}
    models = tmp_path / "cache" / "models"

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", CONVERT], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip

    first = start()
    deadline = time.monotonic() + 300
    while not list(models.glob(".*.tmp/*")) and first.poll() is None:  # mid-write
        assert time.monotonic() < deadline, "the conversion never started writing"
        time.sleep(0.005)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert [p.name for p in models.iterdir() if not p.name.startswith(".")] == []
    assert list(models.glob(".*.tmp"))  # the killed writer's leftover

    procs = [start(), start()]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    results = {line for out in outputs for line in out.splitlines() if line.startswith("RESULT")}
    assert len(results) == 1, outputs  # the same folder and weights for both
    assert sum(out.count("Converting SmolLM2") for out in outputs) == 1, outputs
    assert sum(out.count("Waiting for another process") for out in outputs) == 1, outputs
    (folder,) = [p for p in models.iterdir() if not p.name.startswith(".")]
    assert (folder / "layerdiv-source.json").is_file() and (folder / "model.safetensors").is_file()
    assert not list(models.glob(".*.tmp"))


def test_a_folder_named_from_inside_its_parent_is_stored_under_its_name(
    tmp_path: Path, model_dirs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo extracts SmolLM2's sibling by its folder's name from inside the demo's folder,
    so that its store name is that name wherever the demo's folder is (a path given, absolute
    or relative, becomes part of the model's name)."""
    from tests.test_text_extract import text_task

    out = tmp_path / "somewhere" / "deep"
    out.mkdir(parents=True)
    shutil.copytree(model_dirs("llama"), out / "tiny-sibling")
    task = text_task(tmp_path / "task", ["the cat sat", "a dog ran"])
    store = tmp_path / "store"
    monkeypatch.chdir(out)
    result = CliRunner().invoke(
        main, ["extract", "--model", "tiny-sibling", "--task", str(task), "--store", str(store)]
    )
    assert result.exit_code == 0, result.output
    (info,) = Store(store).select()
    assert info.key.model == "tiny-sibling" and info.manifest.model == "tiny-sibling"
