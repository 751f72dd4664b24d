"""Where a store is: a local folder (a ``pathlib.Path``) or, read-only, a URL of object storage
(a :class:`RemotePath`: a pyarrow FileSystem and a path in it).

Every read of the store (listing, manifests, run records, table markers, Parquet footers and the
part files handed to Polars and DuckDB) takes a path of either kind, so that a remote store is
checked exactly like a local one. The URL schemes are those of
``pyarrow.fs.FileSystem.from_uri`` (``s3://``, ``gs://``, ``abfs://``, ``hf://``, ``hdfs://``)
that Polars reads too; S3 takes the
standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_REGION``). Writing (extract, merge) is local only.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from layerdiv.errors import LayerdivError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


_ACCESS = (
    "the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) and the "
    "endpoint (AWS_ENDPOINT_URL)"
)


class LocationError(LayerdivError, ValueError):
    """A store URL that cannot be read, or a write asked of a store on object storage."""


@dataclass(frozen=True)
class _Listing:
    """A snapshot of every file under a remote store, taken once when the store is opened."""

    files: frozenset[str]
    children: dict[str, frozenset[str]] = field(hash=False)


@dataclass(frozen=True)
class RemotePath:
    """A path of a store on object storage, read-only; ``str()`` is its URL.

    Listing and existence come from the snapshot taken when the store was opened (one recursive
    listing); contents are read from the FileSystem."""

    fs: pafs.FileSystem = field(compare=False, repr=False)
    scheme: str
    path: str
    listing: _Listing = field(compare=False, repr=False)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.path}"

    def __truediv__(self, name: str) -> RemotePath:
        return replace(self, path=f"{self.path}/{name}")

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def parent(self) -> RemotePath:
        return replace(self, path=self.path.rsplit("/", 1)[0])

    def is_dir(self) -> bool:
        return self.path in self.listing.children

    def is_file(self) -> bool:
        return self.path in self.listing.files

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def iterdir(self) -> Iterator[RemotePath]:
        for name in sorted(self.listing.children.get(self.path, ())):
            yield self / name

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        """The children whose name matches ``pattern`` (no ``/`` or ``**``)."""
        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def read_bytes(self) -> bytes:
        if not self.is_file():
            raise FileNotFoundError(f"{self}: no such object")
        try:
            with self.fs.open_input_stream(self.path) as stream:
                return bytes(stream.read())
        except (pa.ArrowException, OSError) as err:
            raise LocationError(
                f"cannot read {self} ({_first_line(err)}): the store is listed but its objects "
                f"cannot be read; check {_ACCESS}"
            ) from err

    def read_text(self) -> str:
        return self.read_bytes().decode()


StorePath = TypeVar("StorePath", Path, RemotePath)
"""A path of a store: local (``Path``) or on object storage (``RemotePath``)."""


def human_bytes(n: float) -> str:
    """``n`` bytes in binary units: ``512 B``, ``3.4 MiB``, ``12.0 GiB``."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    power = 0
    while n >= 1024 and power < len(units) - 1:
        n, power = n / 1024, power + 1
    return f"{n:.0f} B" if power == 0 else f"{n:.1f} {units[power]}"


def file_sizes(paths: Sequence[Path] | Sequence[RemotePath]) -> list[int]:
    """The bytes of each file (on object storage, one request for them all)."""
    if paths and isinstance(paths[0], RemotePath):
        remote = [p for p in paths if isinstance(p, RemotePath)]
        return [i.size or 0 for i in remote[0].fs.get_file_info([p.path for p in remote])]
    return [p.stat().st_size for p in paths if isinstance(p, Path)]


def is_url(text: str | Path) -> bool:
    """True when ``text`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(text, str) and _URL.match(text) is not None


def store_root(root: str | Path) -> Path | RemotePath:
    """The root of the store at ``root``: a local folder, or a URL opened read-only (one
    recursive listing of its objects). Refuses a URL that pyarrow cannot open or list."""
    if not is_url(root):
        return Path(root).expanduser()
    url = str(root).rstrip("/")
    scheme = url.split("://", 1)[0].lower()
    try:
        fs, base = pafs.FileSystem.from_uri(url)
    except (pa.ArrowException, OSError, ValueError) as err:
        raise LocationError(
            f"cannot open the store {url} ({_first_line(err)}): give a local folder or a URL "
            "pyarrow reads (s3://, gs://, abfs://, hf://) and, for S3, the AWS_* variables"
        ) from err
    base = base.rstrip("/")
    try:
        infos = fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except (pa.ArrowException, OSError) as err:
        raise LocationError(
            f"cannot list the store {url} ({_first_line(err)}): check the URL and {_ACCESS}"
        ) from err
    bucket = base.split("/", 1)[0]
    if not infos and _missing(fs, bucket):
        endpoint = os.environ.get("AWS_ENDPOINT_URL")
        raise LocationError(
            f"cannot open the store {url}: there is no bucket {bucket!r}"
            + (f" at the endpoint {endpoint}" if endpoint else "")
            + f"; check the bucket's name, and that {_ACCESS} let you see it"
        )
    files = frozenset(i.path.rstrip("/") for i in infos if i.type == pafs.FileType.File)
    children: dict[str, set[str]] = {}
    for path in files:
        while path != base and "/" in path:  # every folder above a file, up to the root
            folder, name = path.rsplit("/", 1)
            children.setdefault(folder, set()).add(name)
            path = folder
    listing = _Listing(files, {k: frozenset(v) for k, v in children.items()})
    return RemotePath(fs, scheme, base, listing)


def _missing(fs: pafs.FileSystem, path: str) -> bool:
    """Whether ``path`` is known not to exist (False where that cannot be asked)."""
    try:
        return bool(fs.get_file_info(path).type == pafs.FileType.NotFound)
    except (pa.ArrowException, OSError):
        return False


def local_root(root: str | Path, what: str = "--store") -> Path:
    """The local folder a writer may write into; a URL is refused (stores on object storage
    are read-only: write locally, then publish the finished store by a sync). ``what`` names
    the argument in the message."""
    if is_url(root):
        raise LocationError(
            f"{what} {root}: stores on object storage are read-only; extract or merge into a "
            "local folder, then publish the finished store with e.g. `aws s3 sync <folder> <url>`"
        )
    return Path(root)


def read_table(path: Path | RemotePath, columns: Sequence[str] | None = None) -> pa.Table:
    """A Parquet file (its ``columns``, default all), every page's checksum verified (the store
    writes them: a damaged page is an ``OSError``, never numbers)."""
    with open_parquet(path) as file:
        return file.read(columns=None if columns is None else list(columns), use_threads=False)


def read_batches(
    path: Path | RemotePath, columns: Sequence[str], rows: int
) -> Iterator[pa.RecordBatch]:
    """The ``columns`` of a Parquet file in order, in record batches of ``rows`` rows (the last
    one shorter), every page's checksum verified."""
    with open_parquet(path) as file:
        yield from file.iter_batches(batch_size=rows, columns=list(columns), use_threads=False)


@contextlib.contextmanager
def open_parquet(path: Path | RemotePath) -> Iterator[pq.ParquetFile]:
    """A Parquet file opened to read with the checksum of every page it reads verified (pages
    written without one, by earlier versions of layerdiv, are read unverified)."""
    with contextlib.ExitStack() as stack:
        source = (
            stack.enter_context(path.fs.open_input_file(path.path))
            if isinstance(path, RemotePath)
            else path
        )
        yield stack.enter_context(pq.ParquetFile(source, page_checksum_verification=True))


def arrow_source(
    paths: Sequence[Path | RemotePath], base: Path | RemotePath
) -> tuple[list[str], pafs.FileSystem | None, str]:
    """``paths`` and ``base`` as pyarrow dataset arguments: file paths, the FileSystem (None:
    local) and the partition base folder."""
    filesystem = base.fs if isinstance(base, RemotePath) else None
    return [_arrow_path(p) for p in paths], filesystem, _arrow_path(base)


def _arrow_path(path: Path | RemotePath) -> str:
    return path.path if isinstance(path, RemotePath) else str(path)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
