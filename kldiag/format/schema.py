"""Run format v1.3: names, the token schema, Parquet encoding, and the manifest (run.json).

docs/format.md is the public contract; this module is its single source in code.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from kldiag.errors import RunFormatError, SchemaError, UnsupportedFormatVersionError

FORMAT_NAME = "kldiag-run"
FORMAT_VERSION = 1.3
READABLE_VERSIONS = (1, 1.1, 1.2, 1.3)  # v1: tokens/rank=R/ (Hive names), no attempt column; v1.1: no OPTIONAL_SCHEMA
MANIFEST = "run.json"
VOCAB = "vocab.parquet"
TOKENS_DIR = "tokens"
WRITERS_DIR = "writers"  # RUN/writers/rank-R-aA.json: per-rank writer statistics, out of the data tree
CACHE_DIR = ".kldiag"
# v1.1: part-S0-S1-aA-N.parquet; v1: part-S0-S1-N.parquet (attempt 0)
PART_RE = re.compile(r"^part-(\d+)-(\d+)(?:-a(\d+))?(?:-(\d+))?\.parquet$")
RANK_RE = re.compile(r"^rank-(\d+)$")
RANK_RE_V1 = re.compile(r"^rank=(\d+)$")  # v1's Hive-style name: its inferred type clashed with the column

TOKEN_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("micro", pa.int32(), nullable=False),
        pa.field("iteration", pa.int16(), nullable=False),
        pa.field("rank", pa.int16(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("group", pa.int64()),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("token_id", pa.int32()),
        pa.field("logp", pa.float32(), nullable=False),
        pa.field("logp_old", pa.float32()),
        pa.field("logp_ref", pa.float32()),
        pa.field("logp_sampler", pa.float32()),
        pa.field("advantage", pa.float32()),
        pa.field("mask", pa.bool_(), nullable=False),
        pa.field("entropy", pa.float32()),
        pa.field("attempt", pa.int16(), nullable=False),  # v1.1: which attempt wrote the row
    ]
)
# v1.2: optional columns. A part holds one only when some of its rows have a value (an all-null
# column costs ~1.4 kB per part of 1,000 rows, ~12 kB per 1M rows: measured, docs/format.md);
# a part without it (every v1.1 part) reads as null there. List columns are list<...>, not
# fixed_size_list: pandas and DuckDB read them as plain lists, and K may differ between sides.
OPTIONAL_SCHEMA = pa.schema(
    [
        pa.field("turn", pa.int16()),  # turn index of the token inside its sequence (0, 1, ...)
        pa.field("topk_ids", pa.list_(pa.int32())),  # trainer side (pi_theta at record time): top-k ids
        pa.field("topk_logp", pa.list_(pa.float32())),  # their log-probs, same order
        pa.field("topk_ids_sampler", pa.list_(pa.int32())),  # engine side (mu): top-k ids
        pa.field("topk_logp_sampler", pa.list_(pa.float32())),
        # v1.3 MoE routing (kldiag.record.routes): per token, over the layers the trainer routed
        pa.field("route_layers", pa.int16()),  # MoE layers with a trainer route at this token
        pa.field("route_differ", pa.int16()),  # of those, layers whose engine expert SET differs
        pa.field("route_missing", pa.int16()),  # of those, layers the engine gave no route (-1)
        pa.field("route_overlap", pa.float32()),  # mean |trainer set & engine set| / k over compared layers
        pa.field("route_differ_at", pa.list_(pa.int16())),  # the layers counted in route_differ
        pa.field("route_missing_at", pa.list_(pa.int16())),  # the layers counted in route_missing
        pa.field("experts", pa.list_(pa.int16())),  # full routes only when asked: trainer ids, L*k, -1 none
        pa.field("experts_sampler", pa.list_(pa.int16())),  # the engine's, same layout
        # v1.3 router confidence: min over MoE layers of the trainer router's margin at the token (the chosen
        # experts' lowest logit minus the others' highest), and the layer giving that minimum
        pa.field("route_margin_trainer", pa.float32()),
        pa.field("route_margin_layer", pa.int16()),
        # v1.3 (asynchronous RL): per sequence, repeated on its tokens
        pa.field("policy_version", pa.int64()),  # weight version (trainer step) that generated the sequence
        pa.field("task", pa.string()),  # task / environment label (Parquet dictionary-encoded)
    ]
)
TOPK_COLUMNS = ("topk_ids", "topk_logp", "topk_ids_sampler", "topk_logp_sampler")
# v1.3 route columns, each name once: the per-token summary, the layer sets, the full routes (trainer, engine)
ROUTE_LAYERS, ROUTE_DIFFER, ROUTE_MISSING, ROUTE_OVERLAP = "route_layers", "route_differ", "route_missing", "route_overlap"
ROUTE_DIFFER_AT, ROUTE_MISSING_AT = "route_differ_at", "route_missing_at"
EXPERTS, EXPERTS_SAMPLER = "experts", "experts_sampler"
ROUTE_MARGIN_TRAINER, ROUTE_MARGIN_LAYER = "route_margin_trainer", "route_margin_layer"
ROUTE_SUMMARY = (ROUTE_LAYERS, ROUTE_DIFFER, ROUTE_MISSING, ROUTE_OVERLAP)
ROUTE_MARGINS = (ROUTE_MARGIN_TRAINER, ROUTE_MARGIN_LAYER)  # the trainer router's confidence, per token
ROUTE_LAYER_SETS = (ROUTE_DIFFER_AT, ROUTE_MISSING_AT)
ROUTE_ARGS = (EXPERTS, EXPERTS_SAMPLER)  # Recorder.record's full routes, [B, T, L, k]: one L and k for both sides
ROUTE_COLUMNS = (*ROUTE_SUMMARY, *ROUTE_LAYER_SETS, *ROUTE_ARGS, *ROUTE_MARGINS)
RUN_SCHEMA = pa.schema([*TOKEN_SCHEMA, *OPTIONAL_SCHEMA])  # every column a reader may ask for, in order
# absent from older parts: attempt (v1) is filled from the part's name, the v1.2/v1.3 columns with nulls
OPTIONAL_ON_READ = ("attempt", *OPTIONAL_SCHEMA.names)
FLOAT_COLUMNS = ("logp", "logp_old", "logp_ref", "logp_sampler", "advantage", "entropy")
VOCAB_SCHEMA = pa.schema([pa.field("token_id", pa.int32(), nullable=False), pa.field("piece", pa.string())])

# Measured in bench/recorder.py: delta encoding stores the constant runs of step/micro/rank/
# seq/group/attempt and the +1 runs of pos in a few bits, faster than dictionaries; plain token
# ids are smaller than a dictionary of 100k+ pieces; byte-stream-split puts float bytes side
# by side, so the zero low bytes of bf16-valued log-probs compress away (17% smaller there).
INT_ID_COLUMNS = ("step", "micro", "iteration", "rank", "seq", "group", "pos", "attempt")
PARQUET_WRITE_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 1,
    "use_dictionary": ["task"],  # v1.3: a few labels repeated on every token; no other column
    "column_encoding": {**dict.fromkeys((*INT_ID_COLUMNS, "turn", "policy_version"), "DELTA_BINARY_PACKED"),
                        **dict.fromkeys(("route_overlap", "route_margin_trainer"), "BYTE_STREAM_SPLIT"),
                        **dict.fromkeys(FLOAT_COLUMNS, "BYTE_STREAM_SPLIT"),
                        # a list column's values are its leaf "<name>.list.element"; absent columns are ignored
                        **dict.fromkeys(("topk_logp.list.element", "topk_logp_sampler.list.element"),
                                        "BYTE_STREAM_SPLIT")},
    "row_group_size": 1 << 20,
    "write_statistics": ["step"],
}


def part_name(step_min: int, step_max: int, index: int, attempt: int | None = 0) -> str:
    """File name of rank's `index`-th part, steps step_min..step_max, written by `attempt`.

    attempt=None gives the v1 name (no attempt field), for tests of old runs.
    """
    if attempt is None:
        return f"part-{step_min:09d}-{step_max:09d}-{index:06d}.parquet"
    return f"part-{step_min:09d}-{step_max:09d}-a{attempt:04d}-{index:06d}.parquet"


def rank_dir_name(rank: int) -> str:
    return f"rank-{rank}"


def column_field(name: str) -> pa.Field:
    """The format's field of column `name` (TOKEN_SCHEMA or OPTIONAL_SCHEMA); SchemaError otherwise."""
    idx = RUN_SCHEMA.get_field_index(name)
    if idx < 0:
        raise SchemaError(f"{name!r} is not a column of run format {FORMAT_VERSION}; ask for one of "
                          f"{', '.join(RUN_SCHEMA.names)}")
    return RUN_SCHEMA.field(idx)


def columns_schema(columns: Sequence[str]) -> pa.Schema:
    """The schema of `columns`, in the order given (for tables and batches a reader returns)."""
    return pa.schema([column_field(c) for c in columns])


def part_schema(present: Sequence[str]) -> pa.Schema:
    """Schema of a part that holds the optional columns `present`: TOKEN_SCHEMA, then those of
    OPTIONAL_SCHEMA in its order. With none present it is TOKEN_SCHEMA, a v1.1 part byte for byte."""
    return pa.schema([*TOKEN_SCHEMA, *(f for f in OPTIONAL_SCHEMA if f.name in present)])


def check_schema(schema: pa.Schema, source: str, columns: Sequence[str] | None = None) -> None:
    """Raise SchemaError when a needed column is missing or has another type.

    Columns of OPTIONAL_ON_READ may be absent (v1 and v1.1 parts); present, their type must match.
    """
    for name in columns if columns is not None else TOKEN_SCHEMA.names:
        want = column_field(name).type
        idx = schema.get_field_index(name)
        if idx < 0:
            if name in OPTIONAL_ON_READ:
                continue
            raise SchemaError(f"{source}: column {name!r} is missing; every run format requires it "
                              f"(see docs/format.md); re-write the part with kldiag.Recorder")
        got = schema.field(idx).type
        if got != want:
            raise SchemaError(f"{source}: column {name!r} is {got}, run format {FORMAT_VERSION} says {want}; "
                              "re-write the part with kldiag.Recorder")


@dataclass
class Manifest:
    """run.json. `config` holds what the trainer used (beta, estimator, clip range, ...).

    `attempts` lists every start of a recorder on this run (rank 0's view): attempt number,
    start time, kldiag version; a restart appends one and keeps the earlier ones.
    """

    format: str = FORMAT_NAME
    format_version: float = FORMAT_VERSION
    kldiag_version: str = ""
    trainer: dict[str, Any] = field(default_factory=dict)  # {"name": "trl", "version": "1.16.0"}
    config: dict[str, Any] = field(default_factory=dict)  # beta, estimator, clip_range, ...
    world_size: int = 1
    started: float = field(default_factory=time.time)  # unix seconds, first attempt
    sampling: dict[str, Any] = field(default_factory=dict)  # every_n_steps, seq_fraction
    tags: dict[str, Any] = field(default_factory=dict)
    writer: dict[str, Any] = field(default_factory=dict)  # per-rank writer statistics
    attempts: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # keys from newer writers, kept as they are

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        return {**extra, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "run.json") -> Manifest:
        if not isinstance(d, dict):  # valid JSON, but a list, a string or a number: not a manifest
            raise RunFormatError(f"{source} holds a JSON {type(d).__name__}, not an object: it is not a kldiag "
                                 "manifest; restore it or re-create it with kldiag.format.write_manifest")
        if d.get("format") != FORMAT_NAME:
            raise RunFormatError(f"{source} is not a kldiag manifest (format={d.get('format')!r}); "
                                 "point kldiag at a directory written by kldiag.Recorder")
        version = d.get("format_version")
        if version not in READABLE_VERSIONS:
            raise UnsupportedFormatVersionError(
                f"{source} declares run format version {version!r}, but this kldiag reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}; upgrade kldiag (pip install -U kldiag) to read it")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        return cls(**known, extra={k: v for k, v in d.items() if k not in names})
