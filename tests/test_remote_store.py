"""A store on object storage (S3, served by a local moto server) reads exactly like the local
copy it was synced from: ls, analyze, report and query, the same refusals, and no writes."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner, Result
from polars.testing import assert_frame_equal

from layerdiv.cli import main
from tests.conftest import write_synthetic_store

BUCKET = "layerdiv-test"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A moto S3 server on 127.0.0.1 with the AWS variables pointing at it; yields a boto3
    client. The server is always terminated."""
    port = _free_port()
    log = (tmp_path_factory.mktemp("moto") / "server.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the moto server did not start (see {log.name})") from None
                time.sleep(0.1)
        endpoint = f"http://127.0.0.1:{port}"
        with pytest.MonkeyPatch.context() as mp:
            for name, value in {
                "AWS_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_REGION": "us-east-1",
                "AWS_EC2_METADATA_DISABLED": "true",
                "AWS_CONFIG_FILE": str(Path(log.name).with_name("none")),
                "AWS_SHARED_CREDENTIALS_FILE": str(Path(log.name).with_name("none")),
            }.items():
                mp.setenv(name, value)
            client = boto3.client("s3", endpoint_url=endpoint)
            client.create_bucket(Bucket=BUCKET)
            yield client
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_store(tmp_path_factory.mktemp("store"), 3, 24, (2, 3), chunk=10)


def publish(client: Any, root: Path, prefix: str) -> str:
    """Upload every file of ``root`` under ``prefix`` (what ``aws s3 sync`` does); the URL."""
    for path in sorted(root.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(root).as_posix()}")
    return f"s3://{BUCKET}/{prefix}"


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def remote(s3: Any, store: Path) -> str:
    return publish(s3, store, "stores/main")


def objects(client: Any) -> list[str]:
    found = client.list_objects_v2(Bucket=BUCKET).get("Contents", [])
    return sorted(o["Key"] for o in found)


def test_ls_and_query_match_the_local_store(store: Path, remote: str) -> None:
    for args in (
        ["ls"],
        [
            "query",
            "SELECT model, task, component, option, sum(logit) AS s, count(*) AS n "
            "FROM components GROUP BY ALL ORDER BY ALL",
            "--max-rows",
            "1000",
        ],
        ["query", "SELECT model, task, n_done, model_id FROM manifests ORDER BY ALL"],
    ):
        local, far = run(*args, "--store", str(store)), run(*args, "--store", remote)
        assert local.exit_code == 0 and far.exit_code == 0, (local.output, far.output)
        assert far.output == local.output
    assert "org--large" in far.output


def test_analyze_and_report_match_the_local_store(
    s3: Any, store: Path, remote: str, tmp_path: Path
) -> None:
    before = objects(s3)
    for where, out in ((str(store), tmp_path / "local"), (remote, tmp_path / "remote")):
        result = run("analyze", "--store", where, "--out", str(out))
        assert result.exit_code == 0, result.output
    tables = sorted(p.name for p in (tmp_path / "local").glob("*.parquet"))
    assert "scores.parquet" in tables
    assert tables == sorted(p.name for p in (tmp_path / "remote").glob("*.parquet"))
    for name in tables:
        assert_frame_equal(
            pl.read_parquet(tmp_path / "remote" / name), pl.read_parquet(tmp_path / "local" / name)
        )
    result = run("report", "--store", remote, "--out", str(tmp_path / "report"))
    assert result.exit_code == 0, result.output
    assert "org--large" in (tmp_path / "report" / "report.md").read_text()
    assert objects(s3) == before  # read-only: nothing written to the bucket


def _first_components_part(root: Path) -> Path:
    return sorted((root / "components").rglob("part-*.parquet"))[0]


def _truncated(root: Path) -> None:
    part = _first_components_part(root)
    part.write_bytes(part.read_bytes()[:-100])


def _logit_as_float64(root: Path) -> None:
    part = _first_components_part(root)
    table = pq.read_table(part)
    column = table.schema.get_field_index("logit")
    pq.write_table(table.set_column(column, "logit", table["logit"].cast(pa.float64())), part)


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_truncated, "unreadable Parquet"),
        (_logit_as_float64, "columns do not match the components schema"),
    ],
)
def test_a_tampered_remote_part_is_refused_like_a_local_one(
    s3: Any, store: Path, tmp_path: Path, damage: Callable[[Path], None], says: str
) -> None:
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    damage(copy)
    url = publish(s3, copy, f"stores/{damage.__name__}")
    part = _first_components_part(copy).relative_to(copy).as_posix()
    said = []
    for where in (str(copy), url):  # the other partitions are analysed, this one is left out
        result = run("analyze", "--store", where, "--out", str(tmp_path / "out"))
        assert result.exit_code == 1
        said.append(result.output.replace(where, "<store>"))
    assert said[0] == said[1]
    error = said[1].splitlines()[-1]
    assert error.startswith("Error: left out") and says in error and f"<store>/{part}" in error


def test_writes_to_a_url_are_refused_and_write_nothing(s3: Any, tmp_path: Path) -> None:
    before = objects(s3)
    url = f"s3://{BUCKET}/new-store"
    for args, what in (
        (["extract", "any/model", "--task", "sst2", "--store", url], "--store"),
        (["merge", str(tmp_path / "a"), "--into", url], "--into"),
        (["merge", url, "--into", str(tmp_path / "b")], "merge source"),
    ):
        result = run(*args)
        assert result.exit_code == 1
        line = result.output.strip()
        assert "\n" not in line and line.startswith(f"Error: {what} {url}: "), line
        assert "read-only" in line and "into a local folder" in line and "aws s3 sync" in line
    assert objects(s3) == before
    assert not Path("s3:").exists() and list(tmp_path.iterdir()) == []


def test_missing_store_and_bad_url_are_one_line(s3: Any, tmp_path: Path) -> None:
    for url, says in (
        (f"s3://{BUCKET}/nothing-here", f"no store at s3://{BUCKET}/nothing-here: no object"),
        ("nosuch://bucket/store", "cannot open the store nosuch://bucket/store"),
    ):
        result = run("ls", "--store", url)
        assert result.exit_code == 1
        assert "\n" not in result.output.strip() and says in result.output, result.output


def test_results_to_a_url_are_refused_in_one_line(
    s3: Any, store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    before = objects(s3)
    url = f"s3://{BUCKET}/results"
    for args in (
        ["query", "SELECT 1 AS x", "--out", f"{url}/x.parquet"],
        ["analyze", "--out", url],
        ["report", "--out", url],
    ):
        result = run(*args, "--store", str(store))
        assert result.exit_code == 1, result.output
        line = result.output.strip()
        assert "\n" not in line and line.startswith(f"Error: {url}"), line
        assert "local path only" in line and "aws s3 cp" in line
    assert objects(s3) == before and list(tmp_path.iterdir()) == []


def test_missing_bucket_and_credentials_are_named(
    s3: Any, store: Path, remote: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    said = {"bucket": run("ls", "--store", "s3://no-such-bucket/store").output}
    with monkeypatch.context() as env:
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            env.delenv(name)
        said["credentials"] = run("analyze", "--store", remote, "--out", "unused").output
    with monkeypatch.context() as env:
        env.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        said["endpoint"] = run("ls", "--store", remote).output
    for line in said.values():
        assert line.startswith("Error: ") and line.count("\n") == 1, line
        assert "extract" not in line and "--overwrite" not in line, line
        assert "AWS_ACCESS_KEY_ID" in line and "AWS_ENDPOINT_URL" in line, line
    assert "there is no bucket 'no-such-bucket' at the endpoint http://127.0.0.1" in said["bucket"]
    assert "cannot read s3://" in said["credentials"]


def test_text_analyses_match_the_local_store(s3: Any, tmp_path: Path) -> None:
    """The running-text analyses read their part files in Arrow batches through the store's
    filesystem: the same tables from S3 as from the local copy."""
    from layerdiv.analyze.api import analyze
    from layerdiv.analyze.synthetic import synthesize_text_store

    root = tmp_path / "text"
    synthesize_text_store(root, 1, 5, 12, 3, chunk=2, lens=True, skips=True, progress=False)
    local, far = analyze(root), analyze(publish(s3, root, "stores/text"))
    names = sorted(n for n in local.tables() if n.startswith("text_"))
    assert {"text_geometry", "text_lens", "text_skips", "text_profile_pca"} <= set(names)
    for name in names:
        assert_frame_equal(far.tables()[name], local.tables()[name])
