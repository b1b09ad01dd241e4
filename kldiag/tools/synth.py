"""Synthetic runs in run format v1.1, for tests and benchmarks: known truth, any size.

    from kldiag.tools.synth import SynthConfig, make_run
    make_run("runs/synth", SynthConfig(steps=20, seqs_per_step=64, blowup_step=12))

Each step samples `seqs_per_step` sequences of random length; log-probs of the sampled
tokens are drawn so that d = logp_ref - logp is small (a healthy run) and, from
`blowup_step` on, a fraction `blowup_frac` of the tokens has pi_theta far below pi_ref
(d in [4, 10]): K3's gradient weight 1 - exp(d) reaches -2e4 there (DeepSeek-V3.2 3.1).
Parts are written with kldiag.format.publish_part, so with the recorder's Parquet
settings (PARQUET_WRITE_OPTIONS) and names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from kldiag.format import (
    TOKEN_SCHEMA,
    Manifest,
    next_index,
    part_name,
    publish_part,
    rank_dir,
    write_manifest,
    write_vocab,
)
from kldiag.version import __version__


@dataclass(frozen=True)
class SynthConfig:
    """Shape and pathologies of a synthetic run. Every default on one screen."""

    steps: int = 10
    seqs_per_step: int = 32  # per rank
    seq_len: tuple[int, int] = (16, 64)  # completion length, uniform in [low, high)
    ranks: int = 1
    micro_batches: int = 2  # per step and rank; sequences split evenly
    group_size: int = 4  # GRPO group: sequences sharing a prompt
    zero_spread_every: int = 0  # every n-th group (0: none) has equal rewards: advantage 0 for all
    vocab_size: int = 256  # 0 for no vocab.parquet and null token ids
    estimator: str = "k3"  # manifest config: the estimator the "trainer" used
    beta: float = 0.04
    on_policy: bool = False  # logp_old null (the trainer reused logp)
    reference: bool = True  # False: logp_ref null (beta = 0)
    sampler: bool = True  # logp_sampler (the inference engine's log-prob) present
    d_scale: float = 0.05  # std of d = logp_ref - logp on healthy tokens
    drift_scale: float = 0.02  # std of logp - logp_old
    mismatch_scale: float = 0.01  # std of logp_old - logp_sampler
    blowup_step: int | None = None  # from this step on, some tokens have pi_theta << pi_ref
    blowup_frac: float = 0.002
    nonfinite: tuple[tuple[int, str], ...] = ()  # (step, column): one NaN in that step's column
    positive: tuple[int, ...] = ()  # steps with one logp > 0 (an invalid probability)
    unmasked_frac: float = 0.05  # tokens stored with mask false (tool output)
    rows_per_file: int = 1 << 20  # rotate to a new part after about this many rows
    seed: int = 0
    attempt: int = 0  # written as this attempt of every rank (restart tests)
    extra_config: dict = field(default_factory=dict)  # merged into manifest config


def _step_table(cfg: SynthConfig, step: int, rank: int, rng: np.random.Generator) -> pa.Table:
    """One step of one rank: [rows] arrays of format v1."""
    n_seq = cfg.seqs_per_step
    lengths = rng.integers(cfg.seq_len[0], cfg.seq_len[1], n_seq)
    rows = int(lengths.sum())
    seq_local = np.repeat(np.arange(n_seq), lengths)
    seq0 = (step * cfg.ranks + rank) * n_seq
    starts = np.cumsum(lengths) - lengths
    pos = np.arange(rows) - np.repeat(starts, lengths)
    micro = seq_local * cfg.micro_batches // n_seq
    groups = (seq0 + np.arange(n_seq)) // cfg.group_size
    advantage = rng.standard_normal(n_seq).astype(np.float32)
    if cfg.zero_spread_every:
        advantage[groups % cfg.zero_spread_every == 0] = 0.0

    logp = -rng.exponential(0.7, rows)
    d = rng.normal(0.0, cfg.d_scale, rows)
    if cfg.blowup_step is not None and step >= cfg.blowup_step:
        hit = rng.random(rows) < cfg.blowup_frac
        d[hit] = rng.uniform(4.0, 10.0, int(hit.sum()))
        logp[hit] = np.minimum(logp[hit], -d[hit] - 0.01)  # keeps logp_ref <= 0
    logp_ref = np.minimum(logp + d, 0.0)
    logp_old = np.minimum(logp - rng.normal(0.0, cfg.drift_scale, rows), 0.0)
    logp_sampler = np.minimum(logp_old - rng.normal(0.0, cfg.mismatch_scale, rows), 0.0)
    cols = {"logp": logp, "logp_old": logp_old, "logp_ref": logp_ref, "logp_sampler": logp_sampler}
    cols = {k: v.astype(np.float32) for k, v in cols.items()}
    for at_step, column in cfg.nonfinite:
        if at_step == step and rank == 0:
            cols[column][rows // 2] = np.nan
    if step in cfg.positive and rank == 0:
        cols["logp"][rows // 3] = 0.5

    def f32(name: str, present: bool) -> pa.Array:
        return pa.array(cols[name]) if present else pa.nulls(rows, pa.float32())

    token_id = (pa.array(rng.integers(0, cfg.vocab_size, rows).astype(np.int32)) if cfg.vocab_size
                else pa.nulls(rows, pa.int32()))
    arrays = [
        pa.array(np.full(rows, step, np.int64)), pa.array(micro.astype(np.int32)),
        pa.array(np.zeros(rows, np.int16)), pa.array(np.full(rows, rank, np.int16)),
        pa.array((seq0 + seq_local).astype(np.int64)), pa.array(np.repeat(groups, lengths).astype(np.int64)),
        pa.array(pos.astype(np.int32)), token_id,
        f32("logp", True), f32("logp_old", not cfg.on_policy), f32("logp_ref", cfg.reference),
        f32("logp_sampler", cfg.sampler), pa.array(np.repeat(advantage, lengths)),
        pa.array(rng.random(rows) >= cfg.unmasked_frac),
        pa.array((-logp * 0.5).astype(np.float32)),
        pa.array(np.full(rows, cfg.attempt, np.int16)),
    ]
    return pa.Table.from_arrays(arrays, schema=TOKEN_SCHEMA)


def make_manifest(cfg: SynthConfig) -> Manifest:
    config = {"beta": cfg.beta if cfg.reference else 0.0, "estimator": cfg.estimator,
              "clip_range": [0.2, 0.2], "use_bias_correction_kl": cfg.estimator == "k3_is",
              **cfg.extra_config}
    return Manifest(kldiag_version=__version__, trainer={"name": "kldiag.tools.synth", "version": __version__},
                    config=config, world_size=cfg.ranks, tags={"synthetic": True, "seed": cfg.seed})


def make_run(run_dir: str | os.PathLike, cfg: SynthConfig = SynthConfig(),
             steps: range | None = None, manifest: bool = True) -> list[Path]:
    """Write a synthetic run (or, with `steps`, more steps of it); returns the new part paths.

    Calling again with later `steps` appends parts, like a live run that grows.
    """
    run_dir = Path(run_dir)
    if manifest:
        write_manifest(run_dir, make_manifest(cfg))
        if cfg.vocab_size:
            write_vocab(run_dir, [f"tok{i}" for i in range(cfg.vocab_size)])
    written: list[Path] = []
    for rank in range(cfg.ranks):
        index = next_index(run_dir, rank)
        buf: list[pa.Table] = []
        for step in steps if steps is not None else range(cfg.steps):
            rng = np.random.default_rng([cfg.seed, step, rank])
            buf.append(_step_table(cfg, step, rank, rng))
            if sum(t.num_rows for t in buf) >= cfg.rows_per_file:
                written.append(_publish(run_dir, rank, index, buf, cfg.attempt))
                index, buf = index + 1, []
        if buf:
            written.append(_publish(run_dir, rank, index, buf, cfg.attempt))
    return written


def _publish(run_dir: Path, rank: int, index: int, tables: list[pa.Table], attempt: int) -> Path:
    table = pa.concat_tables(tables)
    steps = table.column("step")
    name = part_name(int(steps[0].as_py()), int(steps[-1].as_py()), index, attempt)
    return Path(publish_part(table, rank_dir(run_dir, rank), name))
