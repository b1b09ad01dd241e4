"""The shared half of every importer: sequences in, a kldiag run out, through kldiag.Recorder.

An importer yields `Sequence` objects (one sampled sequence: its trained tokens and their
log-probs); `Sink` packs them into [B, T] micro-batches (right padding, dropped through
`completion_mask`) and hands them to one `kldiag.Recorder` per source rank, so the run
follows the current run format (layout, attempts, URIs) without writing a part itself.
The manifest's `config["import"]` remembers the source and the files already imported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kldiag.errors import DumpError, NotARunError
from kldiag.format import read_manifest
from kldiag.record.recorder import Recorder

TOKEN_FIELDS = ("logp", "logp_old", "logp_ref", "logp_sampler", "entropy", "advantage", "token_ids")
CHUNK_SEQUENCES = 256  # sequences per recorded micro-batch: bounds the importer's memory
ROWS_BUFFERED = 1 << 20  # rows all ranks' writers hold before publishing a part (split among ranks)
QUEUE_BATCHES = 4  # micro-batches queued per recorder


@dataclass
class Sequence:
    """One sequence's trained tokens, [T] arrays (None: the dump lacks the field).

    `mask` is the framework's loss mask; positions are counted from the first token stored.
    """

    step: int
    rank: int
    seq: int
    logp: np.ndarray
    mask: np.ndarray
    group: int | None = None
    micro: int = 0
    logp_old: np.ndarray | None = None
    logp_ref: np.ndarray | None = None
    logp_sampler: np.ndarray | None = None
    entropy: np.ndarray | None = None
    advantage: np.ndarray | None = None
    token_ids: np.ndarray | None = None
    experts_sampler: np.ndarray | None = None  # format v1.3: the engine's routes, [T, L, k] ints (-1: none)
    policy_version: int | np.ndarray | None = None  # format v1.3: the step whose weights generated it, or [T] per token
    task: str | None = None  # format v1.3: its task / environment label


@dataclass
class ImportResult:
    """What one `kldiag import` did."""

    run: str
    framework: str
    imported: list[str] = field(default_factory=list)  # files read now (relative to the source)
    already: list[str] = field(default_factory=list)  # files a previous import read
    pending: list[str] = field(default_factory=list)  # files the framework has not finished writing
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, why): corrupt or foreign
    sequences: int = 0
    tokens: int = 0
    steps: list[int] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # columns the dumps never had (null in the run)
    placeholders: int = 0  # tokens outside the loss whose logp_sampler/logp_old the dumps hold as 0.0 or NaN

    def lines(self) -> list[str]:
        out = [f"imported {len(self.imported)} {self.framework} file(s) into {self.run}: {self.sequences:,} "
               f"sequences, {self.tokens:,} tokens, steps {_span(self.steps)}"]
        if self.already:
            out.append(f"{len(self.already)} file(s) were imported before; left as they are")
        if self.pending:
            out.append(f"{len(self.pending)} file(s) still being written (no completion marker) wait for the "
                       "next import: " + ", ".join(self.pending[:5]))
        for name, why in self.skipped:
            out.append(f"skipped {name}: {why}")
        if self.missing:
            out.append("null in this run (the dumps do not have them): " + ", ".join(self.missing))
        if self.placeholders:
            out.append(f"ignored {self.placeholders:,} placeholder log-probs: tokens outside the loss (tool output, "
                       "prompt echo) whose logp_sampler/logp_old the dumps hold as 0.0 or NaN; stored as they are, "
                       "read by no figure (manifest writer.placeholders)")
        return out


def _span(steps: list[int]) -> str:
    return f"{min(steps)}..{max(steps)}" if steps else "none"


def previous_import(run: str | os.PathLike) -> dict[str, Any]:
    """The manifest's config["import"] of an existing run ({} for a new run).

    DumpError for a run that kldiag import did not make: imported rows never mix with a
    recorded run's.
    """
    try:
        manifest = read_manifest(run)
    except NotARunError:
        return {}
    if not manifest.config.get("import"):
        raise DumpError(f"{run} is a kldiag run that kldiag import did not make (trainer "
                        f"{manifest.trainer.get('name')!r}); import into a new run directory")
    return dict(manifest.config["import"])


class Sink:
    """Packs Sequences into micro-batches and records them, one Recorder per source rank."""

    def __init__(self, run: str | os.PathLike, *, framework: str, dump_version: str, world_size: int,
                 config: dict[str, Any], chunk: int | None = None):
        self.run, self.framework, self.dump_version = run, framework, dump_version
        self.world_size, self.config, self.chunk = int(world_size), config, chunk or CHUNK_SEQUENCES
        self.recorders: dict[int, Recorder] = {}
        self.buffers: dict[int, list[Sequence]] = {}
        self.present: set[str] = set()
        self.sequences = self.tokens = 0
        self.placeholders = 0  # summed over the recorders when they close
        self.steps: set[int] = set()
        self._recorder(0)  # rank 0 writes the manifest, even when it has no rows in this import

    def _recorder(self, rank: int) -> Recorder:
        rec = self.recorders.get(rank)
        if rec is None:
            if rank < 0:
                raise ValueError(f"a {self.framework} dump names rank {rank}; ranks are >= 0")
            self.world_size = max(self.world_size, rank + 1)  # a later file from a larger job
            rec = Recorder(self.run, rank=rank, world_size=self.world_size, trainer=self.framework,
                           trainer_version=self.dump_version, config=self.config, rotate_seconds=None,
                           rotate_rows=max(ROWS_BUFFERED // self.world_size, 65_536), queue_batches=QUEUE_BATCHES,
                           strict=True)
            self.recorders[rank] = rec
        return rec

    def add(self, s: Sequence) -> None:
        if len(s.logp) == 0:  # no trained token (a prompt-only sample): nothing to store
            return
        buf = self.buffers.setdefault(s.rank, [])
        if buf and (buf[0].step, buf[0].micro) != (s.step, s.micro):
            self._flush(s.rank)
            buf = self.buffers.setdefault(s.rank, [])
        buf.append(s)
        self.sequences += 1
        self.tokens += int(np.count_nonzero(s.mask))
        self.steps.add(s.step)
        if len(buf) >= self.chunk:
            self._flush(s.rank)

    def _flush(self, rank: int) -> None:
        buf = self.buffers.pop(rank, [])
        if not buf:
            return
        args = pack(buf)
        self.present.update(k for k in TOKEN_FIELDS if k in args)
        args = {("advantages" if k == "advantage" else k): v for k, v in args.items()}
        self._recorder(rank).record(step=buf[0].step, micro=buf[0].micro, **args)

    def close(self, import_state: dict[str, Any]) -> None:
        """Publish everything; rank 0 closes last, after writing `import_state` to the manifest."""
        for rank in list(self.buffers):
            self._flush(rank)
        rec0 = self.recorders[0]
        rec0.manifest.world_size = self.world_size
        rec0.update_config(**{"import": {**import_state, "world_size": self.world_size}})
        for rank, rec in sorted(self.recorders.items()):
            if rank:
                rec.close()
        rec0.close()
        self.placeholders = sum(rec.stats["placeholders"] for rec in self.recorders.values())

    def abort(self) -> None:
        """Close without recording what is still buffered (an error interrupted the import)."""
        self.buffers.clear()
        for rec in self.recorders.values():
            rec.close(_from_exit=True)


def pack(seqs: list[Sequence]) -> dict[str, np.ndarray]:
    """Right-padded [B, T] arrays for Recorder.record, with completion_mask marking real tokens.

    A field some sequences lack is NaN there; a field none has is left out (null in the run).
    """
    lengths = np.array([len(s.logp) for s in seqs])
    b, t = len(seqs), int(lengths.max()) if len(seqs) else 0
    comp = np.arange(t)[None, :] < lengths[:, None]
    out: dict[str, np.ndarray] = {"completion_mask": comp, "mask": np.zeros((b, t), bool),
                                  "seq_ids": np.array([s.seq for s in seqs], np.int64)}
    if all(s.group is not None for s in seqs):
        out["group_ids"] = np.array([s.group for s in seqs], np.int64)
    if seqs and all(s.policy_version is not None for s in seqs):  # per row; a chunk with gaps leaves it out
        out["policy_version"] = versions_of(seqs, t)
    if seqs and all(s.task is not None for s in seqs):
        out["task"] = np.array([s.task for s in seqs], dtype=str)
    for name in TOKEN_FIELDS:
        if all(getattr(s, name) is None for s in seqs):
            continue
        dtype = np.int32 if name == "token_ids" else np.float32
        a = np.zeros((b, t), dtype) if name == "token_ids" else np.full((b, t), np.nan, dtype)
        out[name] = a
    for i, s in enumerate(seqs):
        n = lengths[i]
        out["mask"][i, :n] = s.mask
        for name in TOKEN_FIELDS:
            v = getattr(s, name)
            if name in out and v is not None:
                out[name][i, :n] = v
    routed = [s.experts_sampler for s in seqs if s.experts_sampler is not None]
    if routed:  # one [L, k] for the run: a sequence without routes is -1 (no route) throughout
        out["experts_sampler"] = np.full((b, t, *routed[0].shape[1:]), -1, np.int32)
        for i, s in enumerate(seqs):
            if s.experts_sampler is not None:
                out["experts_sampler"][i, :lengths[i]] = s.experts_sampler
    return out


def versions_of(seqs: list[Sequence], t: int) -> np.ndarray:
    """policy_version for Recorder.record: [B] when every sequence has one version, else [B, t] (a sequence with
    one version repeats it; the padding repeats its last token's)."""
    if all(np.ndim(s.policy_version) == 0 for s in seqs):
        return np.array([s.policy_version for s in seqs], np.int64)
    out = np.zeros((len(seqs), t), np.int64)
    for i, s in enumerate(seqs):
        v = np.asarray(s.policy_version, np.int64).reshape(-1)
        n = min(len(v), t)
        out[i] = v[0] if v.size == 1 else np.r_[v[:n], np.full(t - n, v[n - 1] if n else 0, np.int64)]
    return out
