"""The query views of a store (``layerdiv query``, ``Store.duckdb``): one DuckDB view per table
over the checked parts of the partitions that hold it whole, read through Arrow with every page's
checksum verified, and a NaN or an infinite value read from any of them an error (the failed
query names the part: ``Store.query_error``).

Nothing here imports torch or transformers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import duckdb
import polars as pl
import pyarrow as pa

from layerdiv.measurements import table_schemas
from layerdiv.schemas import DEFAULT, VECTOR_TABLES
from layerdiv.store.key import ABSENT, KEY, MODEL_KEY
from layerdiv.store.location import RemotePath, arrow_source

if TYPE_CHECKING:
    from pathlib import Path

    from layerdiv.store.reader import PartitionInfo

NOT_FINITE = "layerdiv: a NaN or an infinite value in"
"""How a view's error for a NaN or an infinite value begins (followed by ``<table>.<column>``)."""


MANIFEST_FACTS = {
    "commit": pl.String,
    "step": pl.Int64,
    "tokens_seen": pl.Int64,
    "weights": pl.String,
}
"""The types of the ``manifests`` view's columns that may be null in every row
(``Store.manifests``)."""

MODEL_COLUMNS = pl.Schema(
    {
        **dict.fromkeys(MODEL_KEY, pl.String),
        "model_id": pl.String,
        "revision_name": pl.String,
        "commit": pl.String,
        "step": pl.Int64,
        "tokens_seen": pl.Int64,
        "width": pl.Int64,
        "depth": pl.Int64,
        "vocab_size": pl.Int64,
        "n_params": pl.Int64,
        "n_params_non_embedding": pl.Int64,
        "weights_hash": pl.String,
    }
)
"""The ``models`` view (``Store.models``): per (model, revision) the model id and revision
as given, the hub commit, training step and tokens seen D of the revision (null where unknown),
width d_model, depth l (decoder blocks), vocabulary, total and non-embedding parameters
(``Manifest.n_params_non_embedding``) and the fingerprint of the weights."""


def connect(
    root: Path | RemotePath,
    parts: Sequence[PartitionInfo[Any]],
    frames: Mapping[str, pl.DataFrame],
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view of every table
    (``layerdiv.measurements.table_schemas``) the partitions ``parts`` of the store at ``root``
    hold: the required tables of their task kinds (``components`` and ``instances``;
    ``documents``, ``tokens`` and ``token_blocks``) and each optional one over the partitions
    that hold it for every stored instance or document (``Store.incomplete`` names the others),
    and a view of each of ``frames`` (``manifests``, ``models``); and no file-system access: SQL
    run on it cannot read or write any file (the views scan the checked parts through Arrow), so
    the store cannot be changed through it. A floating-point value a view reads that is NaN or
    infinite stops the query with an error that begins with :data:`NOT_FINITE`."""
    import pyarrow.dataset as ds  # only here: it takes a third of a second to import

    con = duckdb.connect(config={"enable_external_access": False})
    for table, declared in table_schemas().items():
        if table in VECTOR_TABLES:
            continue
        whole = [p for p in parts if table in p.kind.required or table in p.tables]
        files = [f for p in whole for f in p.files(table)]
        if not files:
            continue
        # Every version's columns under today's schema: a column an older part lacks is null.
        schema = declared
        for name in KEY:
            schema = schema.append(pa.field(name, pa.string()))
        paths, filesystem, base = arrow_source(files, root / table)
        verified = ds.ParquetFragmentScanOptions(page_checksum_verification=True)
        dataset = ds.dataset(
            paths,
            filesystem=filesystem,
            schema=schema,
            format=ds.ParquetFileFormat(default_fragment_scan_options=verified),
            partitioning=ds.partitioning(
                pa.schema([pa.field(n, pa.string()) for n in KEY]),
                flavor="hive",
            ),
            partition_base_dir=base,
        )
        # Parts of older layouts lack folder levels: their key columns read as ABSENT says;
        # a column older parts lack reads as its declared default (schemas.DEFAULT).
        absent = {c for p in whole for c in p.partition.absent}
        fills = {c: f"coalesce({c}, '{ABSENT[c]}')" for c in sorted(absent)}
        for f in declared:
            if DEFAULT in (f.metadata or {}):
                fills[f.name] = f"coalesce({f.name}, '{f.metadata[DEFAULT].decode()}')"
            elif pa.types.is_floating(f.type):
                fills[f.name] = (
                    f"CASE WHEN {f.name} IS NULL OR isfinite({f.name}) THEN {f.name} "
                    f"ELSE error('{NOT_FINITE} {table}.{f.name}') END"
                )
        con.register(f"_{table}", dataset)
        filled = ", ".join(f"{v} AS {c}" for c, v in fills.items())
        replace = f" REPLACE ({filled})" if filled else ""
        con.execute(f"CREATE VIEW {table} AS SELECT *{replace} FROM _{table}")
    for name, frame in frames.items():
        con.register(name, frame.to_arrow())
    con.execute("SET lock_configuration = true")
    return con
