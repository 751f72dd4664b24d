"""Analysis on a Ray cluster (``layerdiv analyze --executor ray``): the per-partition work of
every analysis (:func:`~layerdiv.analyze.registry.map_partitions`) runs as Ray tasks, each
reading its partition's files where it runs (a store on a shared file system or object storage),
and the reduction stays on the driver, so the tables are those of the local executor.

Ray is an optional dependency (the ``ray`` extra); it is imported only here, when asked for.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from layerdiv.analyze.options import EXECUTORS, Executor
from layerdiv.analyze.registry import LocalExecutor, PartitionExecutor, partition_engine
from layerdiv.errors import LayerdivError

P = TypeVar("P")
T = TypeVar("T")

ADDRESS_ENV = "RAY_ADDRESS"
"""The variable Ray itself reads for the cluster's address (``--ray-address`` wins)."""
TASKS_PER_CPU = 2
"""Partitions in flight per CPU of the cluster: enough to keep every worker busy while the
driver takes the results in order, few enough to bound the results that wait."""


class ExecutorError(LayerdivError, RuntimeError):
    """The cluster cannot be used: Ray is not installed, no address, or no connection."""


class RayExecutor:
    """Every partition a Ray task (one CPU each), at most ``window`` in flight, results taken in
    submission order. A task that fails raises its own error here (a ``LayerdivError`` stays one
    line)."""

    def __init__(self, window: int) -> None:
        self.window = window

    def map(self, fn: Callable[[P], T], parts: Iterable[P]) -> Iterator[T]:
        import ray

        task = ray.remote(num_cpus=1)(partition_engine(fn))
        running: deque[Any] = deque()

        def take() -> T:
            try:
                return ray.get(running.popleft())
            except ray.exceptions.RayTaskError as err:
                if isinstance(err.cause, Exception):
                    raise err.cause from None
                raise

        for part in parts:
            running.append(task.remote(part))
            if len(running) >= self.window:
                yield take()
        while running:
            yield take()


CONNECT_TIMEOUT_S = 10.0
"""How long the cluster's address may take to accept a connection (Ray itself retries for
minutes)."""


def _reachable(address: str) -> None:
    """Raise ``OSError`` unless HOST:PORT (or ``ray://HOST:PORT``) accepts a TCP connection
    (``auto`` and other forms are left to Ray)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return
    with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
        pass


@contextmanager
def executor(kind: Executor = "local", address: str | None = None) -> Iterator[PartitionExecutor]:
    """The executor ``kind`` names (:data:`~layerdiv.analyze.options.EXECUTORS`). For ``ray``:
    connected to the cluster at ``address`` (else ``$RAY_ADDRESS``; ``auto`` = the cluster this
    node belongs to) for the block, disconnected after unless the process was connected
    already."""
    if kind not in EXECUTORS:
        raise ExecutorError(f"unknown executor {kind!r}: use one of {', '.join(EXECUTORS)}")
    if kind == "local":
        yield LocalExecutor()
        return
    address = address or os.environ.get(ADDRESS_ENV)
    try:
        import ray
    except ImportError:
        raise ExecutorError(
            "--executor ray needs Ray: pip install 'layerdiv[ray]' (docs/cluster.md)"
        ) from None
    connect = not ray.is_initialized()
    if connect:
        if not address:
            raise ExecutorError(
                "--executor ray needs a running Ray cluster: give --ray-address HOST:PORT (or "
                f"auto) or set {ADDRESS_ENV} (docs/cluster.md, 'Analysis on Ray')"
            )
        try:
            _reachable(address)
            ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False)
        except (OSError, RuntimeError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ExecutorError(
                f"cannot connect to the Ray cluster at {address}: {first}; start one (`ray "
                "start --head`) or correct --ray-address"
            ) from None
    try:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        yield RayExecutor(TASKS_PER_CPU * max(cpus, 1))
    finally:
        if connect:
            ray.shutdown()


# --- a cluster on this machine ------------------------------------------------------------------

STARTED = "Ray runtime started"
"""What ``ray start`` prints once its node is up."""
AGENT_PORTS = (
    "--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
)  # fmt: skip
"""The fixed ports of a Ray node, each given a free one (another cluster may be running here)."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _node(
    args: list[str], log: Path, stack: ExitStack, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], Path]:
    """Start one ``ray start --block`` (with ``env`` added to the environment) in a process group
    of its own, stopped (the whole group) when ``stack`` closes."""
    ray = Path(sys.executable).with_name("ray")
    ports = [f"{flag}={_free_port()}" for flag in AGENT_PORTS]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(ray), "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1",
             *ports, *args],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
    stack.callback(_stop, proc)
    return proc, log


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the node's process group (``ray start --block`` stops its processes), SIGKILL
    to what is left after 20 s."""
    for sig, wait in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # the group may outlive its leader
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return


def _wait_started(nodes: list[tuple[subprocess.Popen[bytes], Path]], deadline: float) -> None:
    for proc, log in nodes:
        while STARTED not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace").strip().splitlines()[-3:]
                raise ExecutorError(f"a local Ray node did not start: {' / '.join(tail)}")
            time.sleep(0.2)


LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
"""The environment under which Ray keeps a node on 127.0.0.1 (its one-machine mode: otherwise it
binds every interface and swaps 127.0.0.1 for the machine's address, in the nodes and in a
process that connects, when Ray is imported)."""


JOINING = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}
"""The environment of the nodes of a cluster with worker nodes: Ray refuses to add a node to a
cluster in its one-machine mode (:data:`LOOPBACK`). Its nodes then listen on every interface and
name themselves by the machine's address (Ray swaps 127.0.0.1 for it); the driver still connects
through 127.0.0.1."""


@contextmanager
def local_cluster(cpus: int = 2, workers: int = 1, timeout: float = 180) -> Iterator[str]:
    """A Ray cluster on this machine for trying ``--executor ray`` (and for the tests), started
    as on several machines: a head node (``ray start --head``), then ``workers`` worker nodes
    (``ray start --address``, each a process group of its own) that share ``cpus`` CPUs; the head
    node then only schedules (no CPU), so every task runs on a worker node (:data:`JOINING`: the
    nodes listen on every interface). With ``workers=0`` the head node alone has the ``cpus``
    CPUs, bound to 127.0.0.1. Every node is stopped when the block
    ends (also on failure), the workers first, and the cluster's files (a fresh temporary folder)
    removed. Yields the address to give ``--ray-address``.

    For the block, this process's environment holds :data:`LOOPBACK`, which Ray reads when it is
    imported: import Ray (run the first ``--executor ray`` analysis) inside the block, and
    connect to no other cluster from this process afterwards. Raises ``ExecutorError`` when Ray
    was imported without it, when ``cpus`` cannot give every worker one, or when a node is not up
    within ``timeout`` seconds."""
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and getattr(constants, "ENABLE_RAY_CLUSTER", False):
        raise ExecutorError(
            "Ray was imported in this process before the local cluster started: start "
            "local_cluster first (Ray would connect to the machine's address, not 127.0.0.1)"
        )
    if workers and cpus < workers:
        raise ExecutorError(f"{workers} worker node(s) need at least as many CPUs, not {cpus}")
    deadline = time.monotonic() + timeout
    temp = Path(tempfile.mkdtemp(prefix="layerdiv-ray-"))
    port = _free_port()
    saved = {k: os.environ.get(k) for k in LOOPBACK}
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, temp, ignore_errors=True)
        stack.callback(_restore, saved)
        os.environ.update(LOOPBACK)
        head = _node(
            ["--head", f"--port={port}", f"--temp-dir={temp}", "--include-dashboard=false",
             f"--num-cpus={0 if workers else cpus}"],
            temp / "head.log", stack, JOINING if workers else None,
        )  # fmt: skip
        _wait_started([head], deadline)
        shares = [cpus // workers + (i < cpus % workers) for i in range(workers)]
        nodes = [
            _node([f"--address=127.0.0.1:{port}", f"--num-cpus={n}"], temp / f"worker{i}.log",
                  stack, JOINING)
            for i, n in enumerate(shares)
        ]  # fmt: skip
        _wait_started(nodes, deadline)
        yield f"127.0.0.1:{port}"


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
