"""Turns of multi-turn (agentic) completions: a turn index per token and the figures per turn.

An agentic rollout interleaves spans the engine generated (mask True, in the loss) with spans it
did not (tool output, environment replies, the prompt: mask False). A token's turn is the recorded
`turn` column where a part has it (format v1.2), otherwise derived from the mask: within one
(step, iteration, rank, seq), ordered by pos, turn 0 is the first contiguous True span, turn 1 the
next, ...; tokens outside the loss belong to no turn (-1). `pos_in_turn` counts from 0 at a turn's
first token.

`TurnReducer` (the reducer protocol, reduce.py) folds every token in the loss into a grid of
turn bucket (0..MAX_TURN - 1, then MAX_TURN for "MAX_TURN or later") x position-in-turn bin
(POS_BINS), and per (step, turn bucket) the engine mismatch, plus per part the sequences whose
later turns start with the largest mismatch (the re-tokenisation cause's examples). Figures, with
o = logp_old (logp where null: on-policy) and m = logp_sampler:

    mismatch   m - o on tokens where both are finite (|.| mean and max, signed mean)
    drift      |logp - o| mean, and K3 of pi_theta against pi_old: mean exp(o - logp) - (o - logp) - 1
    weight     |1 - pi_ref/pi_theta| mean (Schulman 2020's K3 weight, estimators.weight_k3)
    flagged    share of tokens with any per-token flag (estimators.flags: theta_ll_ref, weight_blowup,
               clamp_saturated at the reducer's thresholds, and a present log-prob non-finite or > 0)

One compiled pass (`turn_kernel.fold`, numba, float64 inside) gives every sum; tests/test_turns.py checks it against
turn_index and kldiag.estimators in numpy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag import estimators as E
from kldiag.analysis.core.batch import bools
from kldiag.analysis.kernels.turns import MAX_TURN, N_POS, N_TURN, SUMS, fold, seq_bounds, seq_starts
from kldiag.analysis.reducers.base import num as _num
from kldiag.analysis.reducers.base import ratio
from kldiag.analysis.runtime.runner import reduced

POS_EDGES = np.array([0, 1, 2, 3, 8, 32])  # position-in-turn bins: 0, 1, 2, 3-7, 8-31, 32+
POS_LABELS = ("0", "1", "2", "3-7", "8-31", "32+")
if len(POS_EDGES) != N_POS:
    raise ImportError("turns.POS_EDGES must match turn_kernel's position bins")
KEY = ("step", "iteration", "seq")  # with the part's rank: one sequence of one reuse iteration
EXAMPLE_COLS = ("step", "rank", "seq", "iteration", "turn", "start_abs", "body_abs")


# ---- the turn index ------------------------------------------------------------------------


def turn_index(new_seq: np.ndarray, mask: np.ndarray,
               recorded: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(turn, pos_in_turn), both int64 [N], of tokens sorted by sequence then pos.

    new_seq [N] bool: True at each sequence's first row; mask [N] bool: in the loss. Derived turn:
    the index of the token's contiguous mask-True span within its sequence (0 = the first span);
    -1 outside the loss, where pos_in_turn is -1 too. recorded [N] int (optional): the recorded
    turn, negative where null; where given it replaces the derived index, and a change of recorded
    turn inside a span starts a new turn. Vectorised: cumulative sums, no loop over sequences.
    """
    n = len(mask)
    mask = np.asarray(mask, bool)
    new_seq = np.asarray(new_seq, bool).copy()
    if n:
        new_seq[0] = True
    prev_in = np.concatenate([[False], mask[:-1]])
    start = mask & (new_seq | ~prev_in)
    if recorded is not None:
        recorded = np.asarray(recorded, np.int64)
        prev_rec = np.concatenate([[-1], recorded[:-1]])
        start |= mask & ~new_seq & prev_in & (recorded != prev_rec)
    spans = np.cumsum(start)
    seq_base = np.maximum.accumulate(np.where(new_seq, spans - start, 0))  # spans before this sequence
    turn = np.where(mask, spans - seq_base - 1, -1)
    if recorded is not None:
        turn = np.where(mask & (recorded >= 0), recorded, turn)
    idx = np.arange(n)
    first = np.maximum.accumulate(np.where(start, idx, 0))
    pos_in_turn = np.where(mask, idx - first, -1)
    return turn.astype(np.int64), pos_in_turn.astype(np.int64)


def sequence_starts(step: np.ndarray, iteration: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """[N] bool: True where a row's (step, iteration, seq) differs from the previous row's."""
    out = np.empty(len(seq), bool)
    seq_starts(step, iteration, seq, out)
    return out


def pos_bin(pos_in_turn: np.ndarray) -> np.ndarray:
    """Position-in-turn bin (POS_LABELS) of each token; -1 outside a turn."""
    return np.where(pos_in_turn >= 0, np.searchsorted(POS_EDGES, pos_in_turn, side="right") - 1, -1)


def turn_bucket(turn: np.ndarray) -> np.ndarray:
    return np.minimum(turn, MAX_TURN)


# ---- one batch's figures --------------------------------------------------------------------


_CONSTANT: dict[tuple, np.ndarray] = {}  # read-only arrays of one value, shared by every batch (_constant)


def _constant(n: int, dtype: Any, value: Any) -> np.ndarray:
    """n rows of `value`, read-only, from one array kept per (dtype, value): a fresh array per batch cost its
    page faults, a third of the per-turn pass outside its kernel."""
    key = (np.dtype(dtype).str, value)
    a = _CONSTANT.get(key)
    if a is None or len(a) < n:
        a = np.full(max(n, 1 << 16), value, dtype)
        a.flags.writeable = False
        _CONSTANT[key] = a
    return a[:n]


def _columns(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    """The batch's columns as numpy, no copy where Arrow allows; nulls filled, with `valid_<name>` masks
    for the log-probs (a null logp_old means on-policy: the kernel reads logp there). Arrays may be read-only."""
    n = batch.num_rows
    t: dict[str, np.ndarray] = {}
    for name, fill in (("step", 0), ("iteration", 0), ("seq", 0), ("pos", 0), ("mask", False), ("logp", 0.0),
                       ("logp_old", 0.0), ("logp_ref", 0.0), ("logp_sampler", 0.0), ("turn", -1)):
        i = batch.schema.get_field_index(name)
        if i < 0:
            if name == "turn":
                continue
            t[name] = _constant(n, np.float32 if name.startswith("logp") else np.int64, 0)
            t[f"valid_{name}"] = _constant(n, bool, False)
            continue
        col = batch.column(i)
        if name.startswith("logp"):
            t[f"valid_{name}"] = col.is_valid().to_numpy(zero_copy_only=False) if col.null_count else _constant(n, bool, True)
        if name == "mask" and isinstance(batch, pa.RecordBatch):
            t[name] = bools(batch, name)  # Arrow's bitmap unpacked by numpy: 20x to_numpy's conversion
            continue
        t[name] = (pc.fill_null(col, fill) if col.null_count else col).to_numpy(zero_copy_only=False)
    return t


def _sorted(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The rows grouped by sequence and ordered by pos inside one: as they are when they already are (each
    sequence's rows together, pos rising; fold's check asks more, the sequences in key order), else sorted."""
    new = sequence_starts(t["step"], t["iteration"], t["seq"])
    heads = np.flatnonzero(new)
    pos_up = len(new) < 2 or bool(np.all(np.diff(t["pos"])[~new[1:]] > 0))
    keys = np.stack([t[k][heads].astype(np.int64) for k in KEY], 1)
    if pos_up and len(np.unique(keys, axis=0)) == len(heads):
        return t
    order = np.lexsort([t["pos"], t["seq"], t["iteration"], t["step"]])
    return {k: v[order] for k, v in t.items()}


def _step_index(step: np.ndarray, ordered: bool = False) -> tuple[np.ndarray, np.ndarray, int]:
    """(the distinct steps, an index per row, its offset): a row's step is steps[index - offset]. The
    steps' own values with offset min(step) when they are a short range, else np.unique's inverse.
    `ordered`: steps taken to rise, so the first and last rows' are the least and largest (fold's check
    says whether they do: a step outside the range is a row out of order)."""
    if not len(step):
        return np.zeros(0, np.int64), step, 0
    lo, hi = (int(step[0]), int(step[-1])) if ordered else (int(step.min()), int(step.max()))
    if 0 <= hi - lo < 1 << 16:
        return np.arange(lo, hi + 1, dtype=np.int64), step, lo
    steps, inv = np.unique(step, return_inverse=True)
    return steps.astype(np.int64), inv.astype(np.int64), 0


def batch_partial(t: dict[str, np.ndarray], rank: int, thresholds, keep: int,
                  check: bool = False) -> dict[str, np.ndarray] | None:
    """The partial of whole sequences, t grouped by sequence and ordered by pos inside one; with `check`,
    None when they are not in the recorder's order (fold's test; _sorted then orders them)."""
    steps, idx, lo = _step_index(t["step"], check)
    grid, gmax = np.zeros((N_TURN, N_POS, len(SUMS))), np.full((N_TURN, N_POS), -np.inf)
    per_step, seqs = np.zeros((len(steps), N_TURN, 4)), np.zeros(4)
    rec = np.asarray(t["turn"], np.int64) if "turn" in t else np.zeros(0, np.int64)
    tau, limit, clamp = thresholds
    params = np.array([np.log(tau), limit, clamp, 0.0, -np.inf])
    has = np.array([t["valid_logp_old"].any(), t["valid_logp_ref"].any()], np.int64)  # else fold skips an expm1
    spans, n_spans = fold(t["step"], t["iteration"], t["seq"], t["pos"], idx, lo, np.asarray(t["mask"], bool), rec,
                          t["logp"], t["logp_old"], t["valid_logp_old"], t["logp_ref"], t["valid_logp_ref"],
                          t["logp_sampler"], t["valid_logp_sampler"], has, params, check, grid, gmax, per_step, seqs,
                          keep)
    if n_spans < 0:
        return None
    used = per_step[:, :, 1].sum(1) > 0  # steps with a token whose mismatch is known
    out = {k: grid[:, :, j] for j, k in enumerate(SUMS)}
    out.update(mismatch_abs_max=gmax, step=steps[used], step_abs=per_step[used, :, 0], step_n=per_step[used, :, 1],
               step_start_abs=per_step[used, :, 2], step_start_n=per_step[used, :, 3],
               seq_single=np.array([seqs[0]], np.int64), seq_multi=np.array([seqs[1]], np.int64),
               single_n=seqs[2:3].copy(), single_abs=seqs[3:4].copy(),
               turn_max=np.array([_turn_max(grid)], np.int64))
    sp = spans[:n_spans][_above_kth(spans[:n_spans, 1], keep)]
    rows = sp[:, 0].astype(np.int64)
    with np.errstate(invalid="ignore", divide="ignore"):
        body = np.where(sp[:, 3] > 0, sp[:, 2] / np.maximum(sp[:, 3], 1.0), np.nan)
    ex = {"step": t["step"][rows].astype(np.int64), "rank": np.full(len(rows), rank, np.int64),
          "seq": t["seq"][rows].astype(np.int64), "iteration": t["iteration"][rows].astype(np.int64),
          "turn": sp[:, 4].astype(np.int64), "start_abs": sp[:, 1].copy(), "body_abs": body}
    return {**out, **{f"ex_{k}": v for k, v in top_examples(ex, keep).items()}}


def _turn_max(grid: np.ndarray) -> int:
    """The largest turn bucket holding a token (-1: none)."""
    held = np.flatnonzero(grid[:, :, 0].sum(1) > 0)
    return int(held[-1]) if len(held) else -1


def _above_kth(a: np.ndarray, keep: int) -> np.ndarray | slice:
    """Rows of a that can be among its `keep` largest (tied with or above the keep-th); all when few."""
    if len(a) <= 4 * keep:
        return slice(None)
    return a >= np.partition(a, len(a) - keep)[len(a) - keep] if keep else np.zeros(len(a), bool)


def top_examples(ex: dict[str, np.ndarray], keep: int) -> dict[str, np.ndarray]:
    """The `keep` largest start_abs; ties by step, rank, seq, iteration, turn (a total order: any split of
    the rows merges alike)."""
    sel = _above_kth(ex["start_abs"], keep)  # only rows tied with or above the keep-th largest can be kept
    ex = {k: v[sel] for k, v in ex.items()}
    a = ex["start_abs"]
    order = np.lexsort([ex["turn"], ex["iteration"], ex["seq"], ex["rank"], ex["step"], -a])[:keep]
    return {k: v[order] for k, v in ex.items()}


def merge_partials(partials, keep: int) -> dict[str, np.ndarray]:
    """Sum the grids, union the steps, keep the `keep` largest examples (ties by step, rank, seq, iteration, turn)."""
    partials = list(partials)
    if not partials:
        return empty(keep)
    out = {k: sum(p[k] for p in partials) for k in (*SUMS, "seq_single", "seq_multi", "single_n", "single_abs")}
    out["mismatch_abs_max"] = np.maximum.reduce([p["mismatch_abs_max"] for p in partials])
    out["turn_max"] = np.maximum.reduce([p["turn_max"] for p in partials])
    steps = np.concatenate([p["step"] for p in partials])
    uniq, inv = np.unique(steps, return_inverse=True)
    out["step"] = uniq
    cell = (inv.reshape(-1, 1) * N_TURN + np.arange(N_TURN)).reshape(-1)  # a row's steps' cells, flat
    for k in ("step_abs", "step_n", "step_start_abs", "step_start_n"):  # bincount: np.add.at's sums, 10x faster
        rows = np.concatenate([p[k].reshape(-1, N_TURN) for p in partials]).reshape(-1)
        out[k] = np.bincount(cell, rows, len(uniq) * N_TURN).reshape(len(uniq), N_TURN)
    ex = {k: np.concatenate([p[f"ex_{k}"] for p in partials]) for k in EXAMPLE_COLS}
    out.update({f"ex_{k}": v for k, v in top_examples(ex, keep).items()})
    return out


def empty(keep: int = 0) -> dict[str, np.ndarray]:
    """The partial of no token."""
    t = _columns(pa.RecordBatch.from_pydict({k: pa.array([], pa.int64()) for k in KEY}))
    return batch_partial(t, 0, (E.TAU, E.WEIGHT_LIMIT, E.CLAMP), keep)


# ---- the reducer ------------------------------------------------------------------------------


@dataclass
class _State:
    rank: int
    carry: dict[str, np.ndarray] | None = None  # the rows of the last sequence seen (it may go on)
    partials: list = field(default_factory=list)


@dataclass(frozen=True)
class TurnReducer:
    """Per-turn figures of a run (module docstring); flags use the analysis's default thresholds."""

    tau: float = E.TAU
    weight_limit: float = E.WEIGHT_LIMIT
    clamp: float = E.CLAMP
    examples: int = 8  # sequence turns kept, by the |mismatch| of their first token
    name: str = "turns"
    version: int = 2  # 2: sums per run of a cell (another order of the float additions)
    columns: tuple[str, ...] = ("step", "iteration", "seq", "pos", "mask", "logp", "logp_old", "logp_ref",
                                "logp_sampler", "turn")

    def settings(self) -> dict:
        return {"tau": self.tau, "weight_limit": self.weight_limit, "clamp": self.clamp,
                "examples": self.examples, "max_turn": MAX_TURN, "pos_edges": POS_EDGES.tolist()}

    def start(self, part) -> _State:
        return _State(int(getattr(part, "rank", 0)))

    def add(self, state: _State, batch: pa.RecordBatch) -> None:
        t = _columns(batch)
        n = len(t["seq"])
        if not n:
            return
        head, cut = seq_bounds(t["step"], t["iteration"], t["seq"])  # the second sequence's first row, the last's
        if state.carry is None:
            head = 0
        else:  # the carried sequence's rows go with this batch's first sequence only
            c = state.carry
            if any(c[k][-1] != t[k][0] for k in KEY):
                head = 0  # the batch starts a new sequence: the carried one ends here
            joined = {k: np.concatenate([c[k], t[k][:head]]) for k in t if k in c}
            if head == n:  # the whole batch goes on with the carried sequence: it may go on further
                state.carry = joined
                return
            state.partials.append(self._partial(joined, state.rank))
        if cut > head:  # the last sequence may go on in the next batch: carried
            state.partials.append(self._partial({k: v[head:cut] for k, v in t.items()}, state.rank))
        state.carry = {k: v[cut:] for k, v in t.items()}

    def finish(self, state: _State, dropped: int) -> dict[str, np.ndarray]:
        if state.carry is not None and len(state.carry["seq"]):
            state.partials.append(self._partial(state.carry, state.rank))
            state.carry = None
        return self.merge(state.partials)

    def merge(self, partials) -> dict[str, np.ndarray]:
        return merge_partials(partials, self.examples)

    def _partial(self, t: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
        """The partial of whole sequences: in one pass where the rows are in the recorder's order (fold
        checks it as it goes), else of the rows _sorted."""
        th = (self.tau, self.weight_limit, self.clamp)
        out = batch_partial(t, rank, th, self.examples, check=True)
        return out if out is not None else batch_partial(_sorted(t), rank, th, self.examples)


# ---- what faces read --------------------------------------------------------------------------



def _figures(g: dict[str, np.ndarray], axis: int | None) -> dict[str, np.ndarray]:
    """The means of a grid summed over `axis` (None: the cells themselves)."""
    s = {k: (g[k] if axis is None else g[k].sum(axis)) for k in SUMS}
    mx = g["mismatch_abs_max"] if axis is None else g["mismatch_abs_max"].max(axis)
    return {"tokens": s["tokens"], "mismatch_abs_mean": ratio(s["mismatch_abs"], s["n_mismatch"]),
            "mismatch_abs_max": np.where(np.isfinite(mx), mx, np.nan),
            "mismatch_mean": ratio(s["mismatch"], s["n_mismatch"]),
            "drift_abs_mean": ratio(s["drift_abs"], s["n_drift"]),
            "drift_k3_mean": ratio(s["drift_k3"], s["n_drift"]),
            "weight_k3_abs_mean": ratio(s["weight_k3_abs"], s["n_weight"]),
            "flagged_frac": ratio(s["flagged"], s["tokens"])}


def scalar(v: np.ndarray) -> int:
    """A one-element count of the partial (stored as shape [1]: the cache format keeps no 0-d array)."""
    return int(np.asarray(v).reshape(-1)[0])


def turn_label(b: int) -> str:
    return f"{MAX_TURN}+" if b == MAX_TURN else str(b)



def _rows(fig: dict[str, np.ndarray], labels: list, key: str) -> list[dict]:
    return [{key: lab, **{k: (int(v[i]) if k == "tokens" else _num(v[i])) for k, v in fig.items()}}
            for i, lab in enumerate(labels) if fig["tokens"][i] > 0]


def summary(m: dict[str, np.ndarray]) -> dict[str, Any]:
    """The per-turn figures as JSON-ready rows (`kldiag analyze --json` "turns"; docs/metrics.md)."""
    n_b = min(scalar(m["turn_max"]), MAX_TURN) + 1
    g = {k: np.asarray(m[k], np.float64) for k in (*SUMS, "mismatch_abs_max")}
    by_turn = _figures(g, 1)
    start, body = (ratio(g["mismatch_abs"][:, sl].sum(1), g["n_mismatch"][:, sl].sum(1))
                   for sl in (slice(0, 1), slice(1, None)))
    turns = _rows({**by_turn, "start_mismatch_abs_mean": start, "body_mismatch_abs_mean": body},
                  [turn_label(b) for b in range(N_TURN)], "turn")
    cells = _figures(g, None)
    grid = [{"turn": turn_label(b), **r} for b in range(n_b)
            for r in _rows({k: v[b] for k, v in cells.items()}, list(POS_LABELS), "pos")]
    per_turn = ratio(m["step_abs"][:, :n_b], m["step_n"][:, :n_b])
    at_start = ratio(m["step_start_abs"][:, :n_b], m["step_start_n"][:, :n_b])
    steps = [{"step": int(s), "mismatch_abs_mean": [_num(v) for v in per_turn[i]],
              "start_mismatch_abs_mean": [_num(v) for v in at_start[i]]} for i, s in enumerate(m["step"])]
    examples = [{"step": int(m["ex_step"][i]), "rank": int(m["ex_rank"][i]), "seq": int(m["ex_seq"][i]),
                 "iteration": int(m["ex_iteration"][i]), "turn": int(m["ex_turn"][i]),
                 "start_mismatch_abs": _num(m["ex_start_abs"][i]), "body_mismatch_abs_mean": _num(m["ex_body_abs"][i])}
                for i in range(len(m["ex_step"]))]
    return {"turns": n_b if scalar(m["turn_max"]) >= 0 else 0, "multi_turn": scalar(m["seq_multi"]) > 0,
            "sequences": {"single_turn": scalar(m["seq_single"]), "multi_turn": scalar(m["seq_multi"])},
            "single_turn_mismatch_abs_mean": _num(ratio(m["single_abs"], m["single_n"])[0]),
            "position_bins": list(POS_LABELS), "by_turn": turns,
            "by_position": _rows(_figures(g, 0), list(POS_LABELS), "pos"), "by_turn_position": grid,
            "steps": steps, "examples": examples}


def multi_turn(analysis, reducer: TurnReducer | None = None) -> bool:
    """summary()'s "multi_turn" of an analysed run (a sequence with two or more turns) without the rest of
    summary (its per-step rows: 0.1 s at 2,000 steps)."""
    return scalar(reduced(analysis, reducer or TurnReducer())["seq_multi"]) > 0


def turns_of(analysis, reducer: TurnReducer | None = None) -> dict[str, Any]:
    """summary() of an analysed run: from the analysis's own read when it was made with the reducer
    (diagnosis.core.reducers() lists it), else one more pass over the parts lacking a cached partial."""
    return summary(reduced(analysis, reducer or TurnReducer()))
