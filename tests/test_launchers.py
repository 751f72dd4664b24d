"""`--shard auto`: the share i/N read from each launcher's environment, the GPU picked by
LOCAL_RANK, and one clear line for every missing or inconsistent environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from layerdiv.cli import main
from layerdiv.errors import LayerdivError
from layerdiv.extract.launchers import KUBERNETES, SLURM_ARRAY, TORCHRUN, parse_shard, pick_device
from layerdiv.store import Store

LAUNCHER_VARS = (*TORCHRUN, "LOCAL_RANK", *KUBERNETES, *SLURM_ARRAY)


def slurm(task: int, first: int, count: int, step: int = 1) -> dict[str, str]:
    """The variables sbatch sets for task ``task`` of ``--array=first-last:step``."""
    return {
        "SLURM_ARRAY_JOB_ID": "77",
        "SLURM_ARRAY_TASK_ID": str(task),
        "SLURM_ARRAY_TASK_MIN": str(first),
        "SLURM_ARRAY_TASK_MAX": str(first + (count - 1) * step),
        "SLURM_ARRAY_TASK_STEP": str(step),
        "SLURM_ARRAY_TASK_COUNT": str(count),
    }


@pytest.mark.parametrize(
    ("value", "expected"), [("0/1", (0, 1)), ("3/4", (3, 4)), ("0/16", (0, 16))]
)
def test_an_explicit_share_ignores_the_environment(value: str, expected: tuple[int, int]) -> None:
    shard = parse_shard(value, {**slurm(2, 0, 8), "RANK": "1", "WORLD_SIZE": "2"})
    assert (shard.index, shard.count) == expected and shard.source == "--shard"
    assert shard.local_rank is None


@pytest.mark.parametrize(
    ("task", "first", "count", "step", "index"),
    [(0, 0, 4, 1, 0), (3, 0, 4, 1, 3), (5, 1, 8, 1, 4), (14, 0, 8, 2, 7), (7, 3, 3, 2, 2)],
)
def test_a_slurm_array_task_counts_from_the_arrays_first_id(
    task: int, first: int, count: int, step: int, index: int
) -> None:
    shard = parse_shard("auto", slurm(task, first, count, step))
    assert (shard.index, shard.count, shard.local_rank) == (index, count, None)
    assert f"SLURM_ARRAY_TASK_ID={task}" in shard.describe()
    assert parse_shard(f"auto/{count}", slurm(task, first, count, step)).index == index


def test_slurm_without_step_and_max_is_a_plain_range() -> None:
    env = {"SLURM_ARRAY_TASK_ID": "12", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_COUNT": "3"}
    assert parse_shard("auto", env) == parse_shard("auto", slurm(12, 10, 3))


def test_torchrun_gives_rank_of_world_size_and_local_rank_picks_the_gpu() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    shard = parse_shard("auto", env)
    assert (shard.index, shard.count, shard.local_rank) == (5, 8, 1)
    assert pick_device("auto", shard, n_cuda=4) == "cuda:1"
    assert pick_device("cuda", shard, n_cuda=4) == "cuda:1"
    assert pick_device("cuda:3", shard, n_cuda=4) == "cuda:3"  # an explicit device wins
    assert pick_device("cpu", shard, n_cuda=4) == "cpu"
    assert pick_device("auto", shard, n_cuda=0) == "auto"  # no GPU: auto stays auto (the CPU)
    with pytest.raises(LayerdivError, match="LOCAL_RANK=1 but this process sees 1 CUDA"):
        pick_device("auto", shard, n_cuda=1)


def test_torchrun_inside_a_slurm_array_task_shards_within_the_task() -> None:
    shard = parse_shard("auto", {**slurm(2, 0, 4), "RANK": "1", "WORLD_SIZE": "2"})
    assert (shard.index, shard.count) == (1, 2) and shard.source.startswith("torchrun")
    assert pick_device("auto", shard, n_cuda=2) == "auto"  # no LOCAL_RANK: device unchanged


def test_a_kubernetes_indexed_job_takes_its_count_from_the_option() -> None:
    shard = parse_shard("auto/8", {"JOB_COMPLETION_INDEX": "6"})
    assert (shard.index, shard.count) == (6, 8)
    assert "JOB_COMPLETION_INDEX=6" in shard.describe()


@pytest.mark.parametrize(
    ("value", "env", "message"),
    [
        ("auto", {}, "no launcher found .*SLURM_ARRAY_TASK_ID.*WORLD_SIZE.*JOB_COMPLETION_"),
        ("auto/4", {"SLURM_JOB_ID": "3"}, "no launcher found"),  # a job, not an array
        ("auto", {"JOB_COMPLETION_INDEX": "2"}, "use --shard auto/N with N = the job's comp"),
        ("auto/2", {"JOB_COMPLETION_INDEX": "2"}, "need 0 <= i < N, got 2/2"),
        ("auto", {"RANK": "0"}, "torchrun needs WORLD_SIZE"),
        ("auto", {"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE: 'two' is not an integer"),
        ("auto", {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": ""}, "LOCAL_RANK: '' is not"),
        ("auto/4", {"RANK": "0", "WORLD_SIZE": "2"}, "count 4 differs from 2 given by torchrun"),
        ("auto", {"SLURM_ARRAY_TASK_ID": "1"}, "SLURM job array needs SLURM_ARRAY_TASK_MIN"),
        ("auto", {**slurm(4, 1, 3), "SLURM_ARRAY_TASK_MAX": "5"}, "not an evenly spaced range"),
        ("auto", slurm(3, 0, 4, step=2), "not an evenly spaced range"),
        ("2/2", {}, "need 0 <= i < N, got 2/2"),
        ("-1/2", {}, "need 0 <= i < N"),
        ("1/0", {}, "N must be at least 1"),
        ("3", {}, "use i/N"),
        ("a/1", {}, "'a' is not an integer"),
        ("automatic", {}, "use i/N"),
    ],
)
def test_a_missing_or_inconsistent_environment_is_one_clear_line(
    value: str, env: dict[str, str], message: str
) -> None:
    with pytest.raises(LayerdivError, match=message) as err:
        parse_shard(value, env)
    assert "\n" not in str(err.value)


def extract(env: dict[str, str], *args: str) -> Any:
    cleared: dict[str, str | None] = dict.fromkeys(LAUNCHER_VARS)
    return CliRunner(env={**cleared, **env}).invoke(main, ["extract", *args])


def test_a_slurm_array_splits_the_work_through_the_command_line(
    tmp_path: Path, model_dirs: Any, make_task: Any
) -> None:
    task = make_task(tmp_path / "task", n=30)
    store = tmp_path / "store"
    args = ["--model", str(model_dirs("llama")), "--task", str(task), "--store", str(store),
            "--chunk-size", "4", "--shard", "auto"]  # fmt: skip
    first = extract(slurm(1, 1, 2), *args)
    assert first.exit_code == 0, first.output
    assert first.output.startswith("shard 0/2 from the SLURM job array (SLURM_ARRAY_TASK_ID=1,")
    assert "reviews: 16/30" in first.output
    second = extract({"LAYERDIV_SHARD": "auto/2", "JOB_COMPLETION_INDEX": "1"}, *args[:-2])
    assert second.exit_code == 0, second.output
    assert "shard 1/2 from a Kubernetes indexed job" in second.output
    assert "reviews: 30/30" in second.output
    inst = Store(store).scan("instances").collect()
    assert sorted(inst["instance"].to_list()) == list(range(30))


def test_shard_auto_without_a_launcher_exits_with_one_line_and_writes_nothing(
    tmp_path: Path, make_task: Any
) -> None:
    task = make_task(tmp_path / "task", n=4)
    store = tmp_path / "store"
    out = extract({}, "--model", "nowhere", "--task", str(task), "--store", str(store),
                  "--shard", "auto")  # fmt: skip
    assert out.exit_code == 1
    (line,) = out.output.strip().splitlines()
    assert line.startswith("Error: --shard auto: no launcher found")
    assert "SLURM_ARRAY_TASK_ID" in line and "WORLD_SIZE" in line and "JOB_COMPLETION_INDEX" in line
    assert not store.exists()


def test_torchrun_processes_share_the_work(tmp_path: Path, model_dirs: Any, make_task: Any) -> None:
    """A real ``torchrun`` (standalone rendezvous on this machine) starting two processes."""
    task = make_task(tmp_path / "task", n=20)
    store = tmp_path / "store"
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--no-python", sys.executable, "-m", "layerdiv.cli", "extract", "--model",
           str(model_dirs("llama")), "--task", str(task), "--store", str(store),
           "--chunk-size", "4", "--shard", "auto"]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"shard {rank}/2 from torchrun (RANK={rank}, WORLD_SIZE=2), device auto" in (
            done.stdout
        )
    inst = Store(store).scan("instances").collect()
    assert sorted(inst["instance"].to_list()) == list(range(20))
    runs = Store(store).partitions[0].manifest.runs
    assert sorted(r["shard"] for r in runs) == [[0, 2], [1, 2]]
