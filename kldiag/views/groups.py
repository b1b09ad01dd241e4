"""GRPO groups for display: a sequence beside the other completions of its prompt.

GRPO's advantage of a completion is its reward normalised within its group (TRL
grpo_trainer.py 1.16, `_generate_and_score_completions`: (r - mean_group(r)) / std_group(r)),
so a group whose rewards have zero spread gives every completion advantage 0: no policy
gradient, only the KL term acts on it. Format v1 keeps `group` and `advantage` per token
(no reward), so the spread is judged on `reward` when a sequences table carries it, else
on `advantage`. Pure package code; app/app_pages/sequence.py displays it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kldiag import format as F
from kldiag.analysis.reducers import signal as SG
from kldiag.analysis.types import AnalysisConfig
from kldiag.views.pages import DEFAULT_CONFIG, SEQUENCE_READ, decode, derive, nulls, token_columns

SPREAD_TOL = SG.SPREAD_TOL  # rewards (or advantages) closer than this count as equal; the diagnosis's dead groups
# (kl_dominated_signal) are judged the same way, per step over the run: kldiag.analysis.reducers.signal
GROUP_COLUMNS = ("seq", "rank", "length", "advantage", "reward", "k3_mean", "k3_is_mean", "weight_k3_abs_max",
                 "flagged_count", "zero_spread")


def spread_column(sequences: pd.DataFrame) -> str:
    """The column whose spread within a group tells whether the group carried a signal."""
    return "reward" if "reward" in sequences.columns and sequences["reward"].notna().any() else "advantage"


def group_spread(sequences: pd.DataFrame) -> pd.DataFrame:
    """One row per (step, group): size, spread (max - min of reward or advantage), zero_spread.

    A group of one completion has no spread to judge: zero_spread is False for it.
    """
    col = spread_column(sequences)
    g = sequences.groupby(["step", "group"], sort=True)[col]
    out = g.agg(size="size", spread=lambda v: float(np.ptp(v.to_numpy(dtype=np.float64, na_value=np.nan))))
    out = out.reset_index()
    out["zero_spread"] = (out["size"] > 1) & (out["spread"].abs() <= SPREAD_TOL)
    out.attrs["spread_of"] = col
    return out


def siblings(sequences: pd.DataFrame, step: int, seq: int) -> pd.DataFrame:
    """The completions of `seq`'s group at `step` (itself included, first), best advantage next.

    Columns: GROUP_COLUMNS that the table has, plus `self` (True for `seq`). Empty when the
    (step, seq) is unknown.
    """
    at = sequences[sequences["step"] == step]
    me = at[at["seq"] == seq]
    if me.empty:
        return pd.DataFrame(columns=["self", *GROUP_COLUMNS])
    group = me["group"].iloc[0]
    sib = at[at["group"] == group].copy()
    col = spread_column(sequences)
    v = sib[col].to_numpy(dtype=np.float64, na_value=np.nan)
    sib["zero_spread"] = bool(len(sib) > 1 and np.isfinite(v).all() and np.ptp(v) <= SPREAD_TOL)
    sib["self"] = sib["seq"] == seq
    sib = sib.sort_values(["self", "advantage"], ascending=[False, False], kind="stable")
    return sib[["self", *[c for c in GROUP_COLUMNS if c in sib.columns]]].reset_index(drop=True)


def read_group(run_dir: str | os.PathLike, step: int, seqs: Sequence[int],
               config: AnalysisConfig = DEFAULT_CONFIG,
               vocab: Mapping[int, str] | None = None) -> dict[int, pd.DataFrame]:
    """Tokens of several sequences of one step, read in one pass: seq -> frame as
    `views.read_sequence` gives it (sorted by iteration, pos; every derived column; piece)."""
    return group_frames(group_table(run_dir, step, seqs), config, vocab)


def group_table(run_dir: str | os.PathLike, step: int, seqs: Sequence[int]) -> pa.Table:
    """The token rows (SEQUENCE_READ) of `seqs` at `step`, read in one pass, sorted by seq, iteration, pos
    (a stable sort: each sequence's rows in `views.read_sequence`'s order)."""
    parts = [p for p in F.list_parts(run_dir) if p.step_min <= step <= p.step_max]
    want = pa.array([int(s) for s in seqs], pa.int64())
    table = F.open_run(run_dir).read_rows(parts, [int(step)], lambda b: pc.is_in(b.column("seq"), value_set=want),
                                          columns=SEQUENCE_READ)
    return table.sort_by([("seq", "ascending"), ("iteration", "ascending"), ("pos", "ascending")])


def group_frames(table: pa.Table, config: AnalysisConfig = DEFAULT_CONFIG,
                 vocab: Mapping[int, str] | None = None) -> dict[int, pd.DataFrame]:
    """`read_group`'s answer from `group_table`'s rows: seq -> frame, ascending seq."""
    df = table.to_pandas()
    for name, values in derive(token_columns(table), config, nulls(table)).items():
        df[name] = values
    df["piece"] = decode(df["token_id"], vocab)
    return {int(s): g.reset_index(drop=True) for s, g in df.groupby("seq", sort=False)}


def worst_tokens(tokens: pd.DataFrame, k: int = 3) -> pd.DataFrame:
    """The k tokens with the largest |k3 weight| (non-finite first): pos, piece, d, weight_k3."""
    cols = ["pos", "piece", "d", "weight_k3"]
    if tokens.empty:
        return pd.DataFrame(columns=cols)
    w = tokens["weight_k3_abs"].to_numpy(dtype=np.float64, na_value=np.nan)
    order = np.argsort(-np.where(np.isnan(w), np.inf, w), kind="stable")[:k]
    return tokens.iloc[order][cols].reset_index(drop=True)


def text_of(tokens: pd.DataFrame, max_chars: int = 600) -> str:
    """The completion's text (its pieces joined), cut at max_chars with an ellipsis."""
    text = "".join(tokens["piece"].astype(str).tolist())
    return text if len(text) <= max_chars else text[: max_chars - 1] + "…"
