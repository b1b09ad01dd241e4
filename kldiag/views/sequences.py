"""What the pages show of the per-sequence table, read without holding it whole.

A long run's sequence table lives on disk (`Analysis.sequence_rows`, analysis/core/seqrows.py: about 20M
rows at 10B tokens); a page shows a few of its rows: the worst N (Overview), the sequences of one step
(Sequence page, group view), the run's first faulty or worst sequence (where the Sequence page opens).
Each function here reads only those rows (predicate pushdown on the Parquet pieces) and falls back to
the in-memory table of a short run, with the same result either way (tests/test_views_sequences.py).
A long run's answers, and the tokens of the sequences a page shows, are kept in the run's result store
(kldiag.analysis.cache.store): a fresh process reads them, not the Parquet pieces or parts again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kldiag.analysis.cache import store
from kldiag.views import groups as VG
from kldiag.views import pages as V
from kldiag.views.leads import shown
from kldiag.views.numbers import fault_first

WORST_BY = "weight_k3_abs_max"


def count(analysis) -> int:
    """How many sequences the run has (no row read)."""
    return int(analysis.sequence_count)


def worst(analysis, n: int, by: str = WORST_BY) -> pd.DataFrame:
    """The n sequences with the largest `by`, largest first (NaN rows left out, ties in table order):
    `sequences.nlargest(n, by)` as pandas gives it, from the few row groups that hold them."""
    rows = analysis.sequence_rows
    if rows is None:
        return analysis.sequences.to_pandas().nlargest(n, by)

    def query() -> pd.DataFrame:
        got = rows.worst(n, by).to_pandas()  # largest first, ties in table order, as nlargest
        return got[got[by].notna()]  # seqrows orders nulls last; nlargest drops them

    return store.cached(analysis, "worst_sequences", [int(n), by], query)  # a long run's: kept (result store)


def of_step(analysis, step: int) -> pd.DataFrame:
    """Every sequence of `step`, in table order (seq ascending)."""
    rows = analysis.sequence_rows
    if rows is None:
        t = analysis.sequences
        return t.filter(pc.equal(t.column("step"), step)).to_pandas()
    return store.cached(analysis, "step_sequences", [int(step)], lambda: rows.steps(step, step).to_pandas())


def steps_with_sequences(analysis) -> list[int]:
    """The steps that have at least one sequence, ascending (from the per-step table)."""
    s = analysis.steps
    if "sequences" not in s.column_names:
        return sorted(set(analysis.sequences.column("step").to_pylist()))
    keep = np.asarray(s.column("sequences").to_numpy(zero_copy_only=False), np.float64) > 0
    return [int(x) for x in np.asarray(s.column("step").to_numpy())[keep]]


def first_to_show(analysis) -> tuple[int, int] | None:
    """(step, seq) of `fault_first(sequences)`'s first row: the sequence with the most non-finite
    log-probs, else the largest max |k3 weight|; None when empty. Reads the faulty rows (usually
    none), else the worst one."""
    rows = analysis.sequence_rows
    if rows is None:
        t = analysis.sequences.to_pandas()
        if t.empty:
            return None
        top = fault_first(t).iloc[0]
        return int(top["step"]), int(top["seq"])
    if rows.num_rows == 0:
        return None
    return store.cached(analysis, "first_sequence", [], lambda: _first_on_disk(rows))


def _first_on_disk(rows) -> tuple[int, int]:
    cols = ["step", "seq", "nonfinite_count", WORST_BY]
    maxima = [m for _, _, m in rows.group_maxima("nonfinite_count")] if "nonfinite_count" in rows.schema.names else []
    if any(m is None or m > 0 for m in maxima):  # else no row group holds a faulty row: none read
        faulty = rows.table(cols, pc.field("nonfinite_count") > 0)
        if faulty.num_rows:
            return _first(faulty)
    # a NaN weight needs a non-finite log-prob, so the faulty rows above hold every NaN weight; the
    # largest's row group found by its statistics (worst(1)'s row, without ranking every piece)
    return _first(rows.first_largest(WORST_BY, [c for c in cols if c in rows.schema.names]))


def _first(t: pa.Table) -> tuple[int, int]:
    top = fault_first(t.to_pandas()).iloc[0]
    return int(top["step"]), int(top["seq"])


def tokens(analysis, step: int, seq: int, vocab: Mapping[int, str] | None = None) -> pd.DataFrame:
    """pages.read_sequence of an analysed run: one sequence's tokens (`vocab`: the run's own, or None),
    kept in the run's result store, so a fresh process that opens the Sequence page reads no part.
    A sequence with siblings in its GRPO group is read with them, in one pass, and their tokens kept as
    `group_tokens` gives them: the Sequence page shows the group below it, and a read decodes the step's
    row groups (300M rows: 1M-row groups, up to 0.07 s of CPU a read)."""
    step, seq = int(step), int(seq)

    def read() -> pd.DataFrame:
        group = VG.siblings(of_step(analysis, step), step, seq)["seq"].astype(int).tolist()
        if len(group) < 2:
            return V.read_sequence(analysis.run_dir, step, seq, vocab=vocab)
        table = VG.group_table(analysis.run_dir, step, group)
        _group_tokens(analysis, step, group, vocab, lambda: VG.group_frames(table, vocab=vocab))
        # its rows of the group's (read_sequence's order) made into a frame as read_sequence makes it: a
        # column another sequence of the group has nulls in keeps this one's type
        return V.sequence_frame(table.filter(pc.equal(table.column("seq"), seq)), vocab=vocab)

    return store.cached(analysis, "sequence", [step, seq, vocab is not None], read)


def group_tokens(analysis, step: int, seqs: Sequence[int],
                 vocab: Mapping[int, str] | None = None) -> dict[int, pd.DataFrame]:
    """groups.read_group of an analysed run (the Sequence page's group view), kept like `tokens` (under
    the set of `seqs`: read_group's answer does not depend on their order)."""
    seqs = sorted({int(s) for s in seqs})
    return _group_tokens(analysis, step, seqs, vocab, lambda: VG.read_group(analysis.run_dir, step, seqs, vocab=vocab))


def _group_tokens(analysis, step: int, seqs: Sequence[int], vocab, compute) -> dict[int, pd.DataFrame]:
    return store.cached(analysis, "group", [int(step), sorted({int(s) for s in seqs}), vocab is not None], compute)


def choice_label(r) -> str:
    """A sequence's entry in the picker: its non-finite count, else its max |k3 weight| (when measured)."""
    if r.nonfinite_count > 0:
        return f"{int(r.seq)}  ({int(r.nonfinite_count)} non-finite log-prob{'s' if r.nonfinite_count != 1 else ''})"
    w = r.weight_k3_abs_max
    return f"{int(r.seq)}  (max |k3 weight| {w:.3g})" if w == w and w is not None else str(int(r.seq))


def routed_count(df: pd.DataFrame) -> int:
    """Tokens of a sequence the engine routed to other experts than the trainer (0 without both routes)."""
    if "route_differ" not in df:
        return 0
    return int((df["route_differ"].fillna(0) > 0).sum())


def caption(df: pd.DataFrame, row) -> str:
    """The Sequence page's line above the text: what the run measured of this sequence (no 'nan')."""
    bits = [f"{len(df)} tokens"]
    if row["advantage"] == row["advantage"] and row["advantage"] is not None:
        bits.append(f"advantage {row['advantage']:.3g}")
    if row["k3_mean"] == row["k3_mean"] and row["k3_mean"] is not None:
        bits += [f"mean k3 {shown(row['k3_mean'])}", f"mean k3_is {shown(row['k3_is_mean'])}",
                 f"flagged tokens {int(row['flagged_count'])}"]
    if "mismatch" in df and df["mismatch"].notna().any():
        bits.append(f"mean |log pi_old/mu| {shown(df['mismatch'].abs().mean())}")
    if (n := routed_count(df)):
        bits.append(f"{n} token(s) routed to other experts (purple underline)")
    return " · ".join(bits) + " · hover a token for its values"


def drawn(df: pd.DataFrame, columns) -> list[str]:
    """The columns of `columns` that hold a finite value (a chart draws, and lists in its legend, only those)."""
    return [c for c in columns if c in df and np.isfinite(df[c].to_numpy(np.float64, na_value=np.nan)).any()]
