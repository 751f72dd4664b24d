"""Which share of the work this process does: ``--shard i/N`` as given, or ``--shard auto`` read
from the environment of the engine that started the process.

Engines, the closest to the process first (a ``torchrun`` inside a SLURM array task shards
within that task):

- ``torchrun`` (and other ``torch.distributed`` launchers): ``RANK`` of ``WORLD_SIZE``;
  ``LOCAL_RANK`` picks the GPU.
- Kubernetes indexed job: ``JOB_COMPLETION_INDEX``; the count (the job's ``completions``) is not in
  the environment, so it is given as ``--shard auto/N``.
- SLURM job array: ``SLURM_ARRAY_TASK_ID`` counted from ``SLURM_ARRAY_TASK_MIN`` in steps of
  ``SLURM_ARRAY_TASK_STEP``, of ``SLURM_ARRAY_TASK_COUNT``.

Pure logic on a mapping of variables: no torch here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from layerdiv.errors import LayerdivError

TORCHRUN = ("RANK", "WORLD_SIZE")
KUBERNETES = "JOB_COMPLETION_INDEX"
SLURM_ARRAY = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_COUNT")


class LaunchError(LayerdivError, ValueError):
    """``--shard`` cannot be read, or the launcher's environment is missing or inconsistent."""


@dataclass(frozen=True)
class Shard:
    """This process's share: chunk share ``index`` of ``count``, and where that came from."""

    index: int
    count: int
    source: str = "--shard"
    """What gave the share: ``--shard``, or the engine and its variables."""
    local_rank: int | None = None
    """The process's rank on its node (torchrun's ``LOCAL_RANK``), which picks its GPU."""

    def describe(self) -> str:
        return f"shard {self.index}/{self.count} from {self.source}"


def parse_shard(value: str, environ: Mapping[str, str], given: str = "--shard") -> Shard:
    """``i/N``, ``auto`` or ``auto/N`` (N: the count when the engine does not give it, and a check
    when it does; i and N in decimal digits) into a :class:`Shard`. ``given`` says where the
    value came from (``--shard``, or the variable ``LAYERDIV_SHARD``), for messages."""
    label = f"{given} {value}" if given.startswith("-") else f"{given}={value}"
    head, sep, tail = value.partition("/")
    count = _count(tail, label) if sep else None
    if head != "auto":
        if count is None:
            raise LaunchError(f"{label}: use i/N (e.g. 0/4), auto or auto/N")
        return _checked(Shard(_int(head, label), count, given), label)
    shard = _from_environment(environ, count, label)
    if count is not None and count != shard.count:
        raise LaunchError(
            f"{label}: the count {count} differs from {shard.count} given by {shard.source}"
        )
    return _checked(shard, label)


def _from_environment(environ: Mapping[str, str], count: int | None, label: str) -> Shard:
    if any(name in environ for name in TORCHRUN):
        rank, world = (_need(environ, name, "torchrun", label) for name in TORCHRUN)
        local = environ.get("LOCAL_RANK")
        return Shard(
            rank,
            world,
            f"torchrun (RANK={rank}, WORLD_SIZE={world})",
            None if local is None else _int(local, "LOCAL_RANK"),
        )
    if KUBERNETES in environ:
        index = _need(environ, KUBERNETES, "a Kubernetes indexed job", label)
        if count is None:
            raise LaunchError(
                f"{label}: a Kubernetes indexed job (JOB_COMPLETION_INDEX={index}) does not "
                "say how many indexes it has: use --shard auto/N with N = the job's completions"
            )
        return Shard(index, count, f"a Kubernetes indexed job (JOB_COMPLETION_INDEX={index})")
    if "SLURM_ARRAY_TASK_ID" in environ:
        return _slurm_array(environ, label)
    raise LaunchError(
        f"{label}: no launcher found in the environment: expected a SLURM job array "
        "(SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_MIN, SLURM_ARRAY_TASK_COUNT), torchrun (RANK, "
        "WORLD_SIZE, LOCAL_RANK) or a Kubernetes indexed job (JOB_COMPLETION_INDEX, with "
        "--shard auto/N); otherwise give --shard i/N"
    )


def _slurm_array(environ: Mapping[str, str], label: str) -> Shard:
    """The position of this task in its array: ``--array=0-7``, ``1-8`` and ``0-14:2`` all give
    0..7 of 8; a list that is not evenly spaced (``--array=1,4,5``) has no position."""
    task, first, count = (_need(environ, name, "a SLURM job array", label) for name in SLURM_ARRAY)
    step = _int(environ.get("SLURM_ARRAY_TASK_STEP", "1"), "SLURM_ARRAY_TASK_STEP")
    last = _int(
        environ.get("SLURM_ARRAY_TASK_MAX", str(first + (count - 1) * step)),
        "SLURM_ARRAY_TASK_MAX",
    )
    offset = task - first
    if step < 1 or offset % step or last != first + (count - 1) * step:
        raise LaunchError(
            f"{label}: the SLURM job array (tasks {first}..{last}, step {step}, {count} "
            "tasks) is not an evenly spaced range: submit it with --array=0-<N-1>"
        )
    return Shard(
        offset // step,
        count,
        f"the SLURM job array (SLURM_ARRAY_TASK_ID={task}, SLURM_ARRAY_TASK_MIN={first}, "
        f"SLURM_ARRAY_TASK_COUNT={count})",
    )


def pick_device(device: str, shard: Shard, n_cuda: int) -> str:
    """The device of a process that a launcher gave a local rank: ``cuda:<LOCAL_RANK>`` when
    ``device`` is ``auto`` or ``cuda`` and CUDA devices are visible (``n_cuda``), else
    ``device`` unchanged."""
    if shard.local_rank is None or device not in ("auto", "cuda") or n_cuda == 0:
        return device
    if shard.local_rank >= n_cuda:
        raise LaunchError(
            f"LOCAL_RANK={shard.local_rank} but this process sees {n_cuda} CUDA device(s): "
            "start at most one process per GPU (torchrun --nproc-per-node), or give --device"
        )
    return f"cuda:{shard.local_rank}"


def _checked(shard: Shard, label: str) -> Shard:
    if not 0 <= shard.index < shard.count:
        raise LaunchError(
            f"{label}: need 0 <= i < N, got {shard.index}/{shard.count} from {shard.source}"
        )
    return shard


def _count(text: str, label: str) -> int:
    count = _int(text, label)
    if count < 1:
        raise LaunchError(f"{label}: N must be at least 1")
    return count


def _need(environ: Mapping[str, str], name: str, engine: str, label: str) -> int:
    if name not in environ:
        raise LaunchError(f"{label}: {engine} needs {name} in the environment; it is not set")
    return _int(environ[name], name)


def _int(text: str, what: str) -> int:
    """A decimal integer (no ``_`` separators, signs but ``-``, or spaces inside)."""
    if re.fullmatch(r"-?[0-9]+", text.strip()) is None:
        raise LaunchError(f"{what}: {text!r} is not an integer")
    return int(text)
