"""Analysis on Ray (``--executor ray``): every table equals the local executor's, on a cluster
on this machine that the test starts and stops: a head node that only schedules and a worker node
started apart (``ray start --address``) that runs every task."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import numpy as np
import pytest
from polars.testing import assert_frame_equal

from layerdiv.analyze.api import analyze
from layerdiv.analyze.cluster import ExecutorError, executor, local_cluster
from layerdiv.analyze.synthetic import (
    random_heads,
    random_partition,
    synthesize_store,
    synthesize_text_store,
    write_partition,
)

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed (the ray extra)"
)  # not imported here: the local cluster must start before Ray is imported

RTOL, ATOL = 1e-9, 1e-12
"""Floats may differ in their last bits: the local executor differs from itself that much run to
run (Polars sums groups in an order that varies: ``modules``, ``information``); every other
column (keys, counts, integers, strings) and the order of the rows must be equal."""
LOOSE = {"depth_fits": 1e-5}
"""Tables whose standard errors come from an ill-conditioned fit (the made-up curves of a store
of 3- and 4-block models), which magnifies those last bits: two local runs differ by about 3e-7
there (relative), so their ``*_se`` columns are compared to this relative tolerance."""
LIMIT_S = 600
"""The most the cluster test may run: then it fails, and the cluster is stopped."""


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Choice partitions of two models and two tasks, one with heads, and text partitions with
    the lens and future effects: every analysis has partitions to work on."""
    root = tmp_path_factory.mktemp("cluster-store")
    synthesize_store(root, n_models=2, n_tasks=2, n_instances=60, blocks=(3, 4), progress=False)
    rng = np.random.default_rng(3)
    logits, gold, rms, kinds = random_partition(rng, 40, 3, 3)
    logits, heads, ids = random_heads(rng, logits, gold, kinds, 2)
    write_partition(root, "org/heads", "task", logits, gold, kinds, rms, optional={"heads": heads},
                    head_ids=ids)  # fmt: skip
    synthesize_text_store(root, 2, 6, 20, 3, chunk=4, lens=True, skips=True, progress=False)
    return root


@pytest.fixture
def deadline() -> Iterator[None]:
    def expire(signum: int, frame: FrameType | None) -> None:
        raise TimeoutError(f"the Ray cluster test ran past {LIMIT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_ray_tables_equal_the_local_executor(store: Path, deadline: None) -> None:
    options = {"reweight": True}
    local = analyze(store, options=options)
    assert {"paper", "depth", "heads", "text_lens", "text_skips"} <= set(local.analyses)
    with local_cluster(cpus=2, workers=1) as address:
        remote = analyze(store, options=options, executor="ray", ray_address=address)
        import ray

        assert not ray.is_initialized()  # disconnected after the analysis
    assert remote.analyses == local.analyses
    assert remote.names() == local.names()
    assert remote.notes == local.notes
    mine, theirs = local.tables(), remote.tables()
    for name in local.names():
        try:
            loose = [c for c in mine[name].columns if name in LOOSE and c.endswith("_se")]
            assert_frame_equal(theirs[name].drop(loose), mine[name].drop(loose), rel_tol=RTOL,
                               abs_tol=ATOL)  # fmt: skip
            for c in loose:
                assert_frame_equal(theirs[name].select(c), mine[name].select(c),
                                   rel_tol=LOOSE[name], abs_tol=ATOL)  # fmt: skip
        except AssertionError as err:
            raise AssertionError(f"table {name}: {err}") from None


def test_cli_refuses_an_unreachable_cluster_in_one_line(store: Path, tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "layerdiv.cli", "analyze", "--store", str(store), "--out",
         str(tmp_path / "r"), "--executor", "ray", "--ray-address", "127.0.0.1:9"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot connect to the Ray cluster at 127.0.0.1:9" in lines[0], lines


def test_no_address_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ExecutorError, match="needs a running Ray cluster: give --ray-address"):
        executor("ray").__enter__()
    with pytest.raises(ExecutorError, match="2 worker node"):
        local_cluster(cpus=1, workers=2).__enter__()
    with pytest.raises(ExecutorError, match="unknown executor 'spark'"):
        executor("spark").__enter__()  # type: ignore[arg-type]
