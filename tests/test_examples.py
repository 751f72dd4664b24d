"""The sbatch scripts of ``examples/`` run as an array task would, with a stand-in ``layerdiv``
that prints what it was asked to do (the real cluster run is ``scripts/slurm-check.sh``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def sbatch_task(tmp_path: Path, script: str, *args: str, task: str | None = "2") -> tuple[int, str]:
    """Run ``examples/<script>`` as SLURM array task ``task``; returns (status, output)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "layerdiv"
    fake.write_text('#!/bin/sh\necho "threads=$OMP_NUM_THREADS layerdiv $*"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_CPUS_PER_TASK="8")
    if task is not None:
        env["SLURM_ARRAY_TASK_ID"] = task
    done = subprocess.run(
        ["bash", str(EXAMPLES / script), *args], env=env, capture_output=True, text=True
    )
    return done.returncode, (done.stdout + done.stderr).strip()


def test_the_models_array_takes_the_model_of_its_line(tmp_path: Path) -> None:
    models = tmp_path / "models.txt"
    models.write_text("# the study\nHuggingFaceTB/SmolLM2-135M\n\n  Qwen/Qwen2.5-0.5B  \n")
    status, out = sbatch_task(tmp_path, "models.sbatch", str(models), "--task", "sst2")
    assert status == 0, out
    assert out == "threads=8 layerdiv extract --model Qwen/Qwen2.5-0.5B --task sst2"
    status, out = sbatch_task(tmp_path, "models.sbatch", str(models), "--task", "sst2", task="3")
    assert status == 2 and "no model on line 3 of" in out
    status, out = sbatch_task(tmp_path, "models.sbatch", str(models), "--task", "x", task=None)
    assert status == 2 and out.startswith("usage: sbatch --array=1-<number of models>")


def test_the_shards_array_extracts_its_share_into_one_store(tmp_path: Path) -> None:
    status, out = sbatch_task(
        tmp_path, "shards.sbatch", "org/big-model", "boolq", "/shared/store", "--limit", "5"
    )
    assert status == 0, out
    assert out == (
        "threads=8 layerdiv extract --model org/big-model --task boolq --store /shared/store "
        "--shard auto --limit 5"
    )
    status, out = sbatch_task(tmp_path, "shards.sbatch", "org/big-model", "boolq")
    assert status == 2 and out.startswith("usage: sbatch --array=0-<N-1>")
