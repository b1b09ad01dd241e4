"""Run format v1.2: the public contract between recorders, importers and every reader.

Layout (docs/format.md is the contract; a run may be a local directory or a URI)::

    RUN/run.json                                  manifest (Manifest), with its attempts
    RUN/vocab.parquet                             optional: token_id -> piece
    RUN/tokens/rank-R/part-S0-S1-aA-N.parquet     rank R, steps S0..S1, attempt A, N-th file of R
    RUN/writers/rank-R-aA.json                    writer statistics of rank R's attempt A
    RUN/.kldiag/                                  analysis cache (derived; remote runs: a local cache)

Every Parquet tool reads RUN/tokens as one table: directory names are not Hive partitions
(v1's `rank=R` clashed with the int16 rank column) and nothing but parts lives under it.
Modules: schema (names, token schema, manifest), storage (local paths and URIs), parts
(listing, attempts, atomic publish), run (the reader, vocab, writer statistics).
"""

from __future__ import annotations

import os
from pathlib import Path

from kldiag.format.parts import (
    PartInfo,
    attempt_hulls,
    clean_stale_temps,
    list_parts,
    next_attempt,
    next_index,
    open_part,
    publish,
    publish_part,
    rank_rel,
    superseded_intervals,
    superseded_mask,
)
from kldiag.format.run import (
    WRITER_STATS,
    Run,
    absent_column,
    open_run,
    part_batches,
    read_manifest,
    read_rank_stats,
    resume_manifest,
    run_path,
    upgrade_v1,
    vocab_pieces,
    vocab_stamp,
    write_manifest,
    write_rank_stats,
    write_vocab,
)
from kldiag.format.schema import (
    CACHE_DIR,
    EXPERTS,
    EXPERTS_SAMPLER,
    FLOAT_COLUMNS,
    FORMAT_NAME,
    FORMAT_VERSION,
    INT_ID_COLUMNS,
    MANIFEST,
    OPTIONAL_ON_READ,
    OPTIONAL_SCHEMA,
    PARQUET_WRITE_OPTIONS,
    PART_RE,
    RANK_RE,
    RANK_RE_V1,
    READABLE_VERSIONS,
    ROUTE_ARGS,
    ROUTE_COLUMNS,
    ROUTE_DIFFER,
    ROUTE_DIFFER_AT,
    ROUTE_LAYER_SETS,
    ROUTE_LAYERS,
    ROUTE_MARGIN_LAYER,
    ROUTE_MARGIN_TRAINER,
    ROUTE_MARGINS,
    ROUTE_MISSING,
    ROUTE_MISSING_AT,
    ROUTE_OVERLAP,
    ROUTE_SUMMARY,
    RUN_SCHEMA,
    TOKEN_SCHEMA,
    TOKENS_DIR,
    TOPK_COLUMNS,
    VOCAB,
    VOCAB_SCHEMA,
    WRITERS_DIR,
    Manifest,
    check_schema,
    column_field,
    columns_schema,
    part_name,
    part_schema,
    rank_dir_name,
)
from kldiag.format.storage import Store, is_uri, resolve


def rank_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    """Local directory of rank R's parts (v1.1 name)."""
    return Path(run_dir) / TOKENS_DIR / rank_dir_name(rank)


__all__ = [
    "CACHE_DIR", "FLOAT_COLUMNS", "FORMAT_NAME", "FORMAT_VERSION", "INT_ID_COLUMNS", "MANIFEST", "OPTIONAL_ON_READ",
    "OPTIONAL_SCHEMA", "PARQUET_WRITE_OPTIONS", "PART_RE", "RANK_RE", "RANK_RE_V1", "READABLE_VERSIONS", "RUN_SCHEMA",
    "ROUTE_COLUMNS", "EXPERTS", "EXPERTS_SAMPLER", "ROUTE_ARGS", "ROUTE_DIFFER", "ROUTE_DIFFER_AT", "ROUTE_LAYERS", "ROUTE_LAYER_SETS", "ROUTE_MARGIN_LAYER", "ROUTE_MARGIN_TRAINER", "ROUTE_MARGINS", "ROUTE_MISSING", "ROUTE_MISSING_AT", "ROUTE_OVERLAP", "ROUTE_SUMMARY", "TOKENS_DIR", "TOKEN_SCHEMA", "TOPK_COLUMNS", "VOCAB", "VOCAB_SCHEMA", "WRITERS_DIR", "WRITER_STATS", "Manifest",
    "PartInfo", "Run", "Store", "absent_column", "attempt_hulls", "check_schema", "column_field", "columns_schema",
    "clean_stale_temps", "is_uri", "list_parts", "next_attempt", "next_index", "open_part", "open_run",
    "part_batches", "part_name", "part_schema", "publish", "publish_part", "rank_dir", "rank_dir_name", "rank_rel",
    "read_manifest", "read_rank_stats", "resolve", "resume_manifest", "run_path", "superseded_intervals",
    "superseded_mask", "upgrade_v1", "vocab_pieces", "vocab_stamp", "write_manifest", "write_rank_stats",
    "write_vocab",
]
