"""Distribution-level mismatch from the two sides' top-k lists: KL(mu || pi) with bounds, rank agreement.

Per token, the engine (mu, the sampler) and the trainer (pi, pi_theta at record time) each give
their k most likely token ids and log-probs (columns `topk_ids_sampler`/`topk_logp_sampler` and
`topk_ids`/`topk_logp`, docs/format.md). Inputs are [N, K] arrays, one row per token; a slot with
id < 0 or a non-finite log-prob is empty (lists shorter than K are padded so). Notation per token:

    A, B      the engine's and the trainer's listed ids;  S = A & B (shared), E = A - B, T = B - A
    mu(A)     the listed engine mass;  tail_mu = 1 - mu(A), tail_pi = 1 - pi(B)
    q_min     the smallest listed engine prob: every unlisted id has mu <= q_min (p_min: trainer's)

What is known of the unlisted values: pi(x) <= p_min for x in E and sum over them <= tail_pi
(likewise mu on T), and the masses outside A and B are the tails. From that:

* `lower`: a rigorous lower bound. Coarsening both distributions to a partition of the vocabulary
  never increases the KL (log-sum inequality), and a bound that minimises the coarsened KL over the
  unknown cell masses holds whatever they are. Two partitions, each in closed form: S's ids one
  by one, E as one cell (pi(E) = u unknown, 0 <= u <= min(|E| p_min, tail_pi)) and the rest; and
  S, T as one cell (mu(T) = v <= min(|T| q_min, tail_mu)) and the rest. Each is convex in its one
  unknown, whose unconstrained minimiser equalises the cells' mu/pi ratios; clipped to the bound,
  it is the constrained minimum. `lower` is the larger of the two (and >= 0).
* `upper`: no finite upper bound exists from top-k lists alone: an id the engine lists and the
  trainer does not may have any trainer prob in (0, p_min], and pi -> 0 sends the KL to infinity.
  `upper` is rigorous given a floor: every log-prob the trainer did not list is >= `logp_floor`.
  Then each term of E is <= mu(x) (log mu(x) - floor), and the engine's tail mass outside A,
  each of its ids at mu <= q_min, adds <= tail_mu (log q_min - min(floor, log p_min)).
  logp_floor = -inf gives the floor-free bound (infinite unless mu(E) = tail_mu = 0).
* `estimate`: by the chain rule, KL(mu || pi) = KL of the coarsened pair (S's ids one by one, the
  rest R = everything else as one cell) + mu(R) KL(mu|R || pi|R). The first term is known exactly
  (mu(R) = 1 - mu(S), pi(R) = 1 - pi(S)); the second, the divergence inside the unlisted rest, is
  not, and is estimated by the same divergence per unit mass as on the shared ids, KL(mu|S || pi|S)
  of both sides renormalised on S. Then clipped to [lower, upper]. Why not a simpler figure: the
  renormalised KL on S alone ignores a difference of mass between S and the rest, and the plain
  sum over S of mu log(mu / pi) is no divergence (it can be negative). Equal to the exact KL when
  k = vocabulary size (R is empty); on random categorical pairs its mean error is below that of
  the coarsened KL alone (tests/test_topk.py).

Each tail is taken as 1 - listed mass + `tol` (at most 1): log-probs stored as float32 sum to 1
only within about 1e-7, and a listed mass that rounds to >= 1 would leave no room for an id the
other side lists (an infinite KL from rounding). Allowing `tol` more unlisted mass than the lists
leave only loosens both bounds (they stay valid), and leaves the estimate exact when k = vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag.analysis.core import keyed
from kldiag.analysis.reducers.base import num as _num

TOL = 1e-6  # unlisted mass allowed beyond 1 - listed mass: float32 rounding, never a tail of 0


def valid_slots(ids: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """[N, K] bool: slots holding a listed id (id >= 0, finite log-prob)."""
    return (np.asarray(ids) >= 0) & np.isfinite(logp)


def _side(ids: np.ndarray, logp: np.ndarray, tol: float) -> dict[str, np.ndarray]:
    """One side's [N, K] probs (0 in empty slots), listed mass, tail, smallest listed prob, count."""
    logp = np.asarray(logp, np.float64)
    ok = valid_slots(ids, logp)
    prob = np.where(ok, np.exp(np.where(ok, logp, 0.0)), 0.0)
    listed = prob.sum(axis=1)
    tail = np.minimum(np.clip(1.0 - listed, 0.0, 1.0) + tol, 1.0)
    lo = np.where(ok, logp, np.inf).min(axis=1)
    lo = np.where(np.isfinite(lo), lo, 0.0)  # an empty list bounds nothing: prob <= 1
    return {"ok": ok, "logp": np.where(ok, logp, -np.inf), "prob": prob, "tail": tail, "log_min": lo,
            "min": np.exp(lo), "n": ok.sum(axis=1)}


def xlogx_over(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a log(a / b) elementwise: 0 where a = 0, +inf where a > 0 = b (the KL's conventions)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = a * (np.log(a) - np.log(b))
    out = np.where(a <= 0, 0.0, out)
    return np.where((a > 0) & (b <= 0), np.inf, out)


def align(ids_a: np.ndarray, ok_a: np.ndarray, ids_b: np.ndarray, ok_b: np.ndarray) -> np.ndarray:
    """[N, Ka] int: for each slot of list a, the slot of list b holding the same id, -1 if none."""
    a = np.where(ok_a, ids_a, -1).astype(np.int32)  # empty slots: ids that match nothing (ids are int32 on disk)
    b = np.where(ok_b, ids_b, -2).astype(np.int32)
    j = (a[:, :, None] == b[:, None, :]).argmax(axis=2)  # one [N, Ka, Kb] pass: 2-3x less than any + argmax
    return np.where(np.take_along_axis(b, j, axis=1) == a, j, -1)


def inverse(j: np.ndarray, kb: int) -> np.ndarray:
    """[N, kb]: align's map the other way (slot of list b -> slot of list a, -1 if none), from j."""
    back = np.full((len(j), kb), -1, np.int64)
    rows, cols = np.nonzero(j >= 0)
    back[rows, j[rows, cols]] = cols
    return back


def _gather(x: np.ndarray, idx: np.ndarray, fill: float) -> np.ndarray:
    """x[n, idx[n, k]] for idx >= 0, `fill` where idx < 0 ([N, K])."""
    got = np.take_along_axis(x, np.maximum(idx, 0), axis=1)
    return np.where(idx >= 0, got, fill)


def kl_topk(ids_sampler: np.ndarray, logp_sampler: np.ndarray, ids: np.ndarray, logp: np.ndarray,
            logp_floor: float = -np.inf, tol: float = TOL) -> dict[str, np.ndarray]:
    """KL(mu || pi) per token from the engine's and the trainer's top-k lists ([N, K] each, K may
    differ between sides): `estimate`, `lower`, `upper` [N] (nats; see the module docstring), and
    `shared` [N] (number of ids both list), `mass_sampler`, `mass` [N] (listed mass of each side).
    A row where either list is empty has NaN figures."""
    ids_s, ids_t = np.asarray(ids_sampler), np.asarray(ids)
    mu, pi = _side(ids_s, logp_sampler, tol), _side(ids_t, logp, tol)
    j = align(ids_s, mu["ok"], ids_t, pi["ok"])  # engine slot -> trainer slot
    return _kl(mu, pi, j, inverse(j, ids_t.shape[1]) >= 0, logp_floor, tol)


def _kl(mu, pi, j, in_a, logp_floor: float, tol: float) -> dict[str, np.ndarray]:
    """kl_topk from both sides (_side), the engine-to-trainer slot map j and the trainer slots the
    engine also lists (in_a)."""
    shared = j >= 0
    pi_at = _gather(pi["prob"], j, 0.0)
    kl_s = np.where(shared, xlogx_over(mu["prob"], pi_at), 0.0).sum(axis=1)
    m_e = np.where(mu["ok"] & ~shared, mu["prob"], 0.0).sum(axis=1)
    n_e = (mu["ok"] & ~shared).sum(axis=1)
    p_t = np.where(pi["ok"] & ~in_a, pi["prob"], 0.0).sum(axis=1)
    n_t = (pi["ok"] & ~in_a).sum(axis=1)
    lower = kl_s + np.maximum(_lower_e(m_e, n_e, p_t, mu, pi), _lower_t(m_e, p_t, n_t, mu, pi))
    lower = np.maximum(lower, 0.0)
    upper = _upper(kl_s, shared, mu, pi, logp_floor)
    m_s = np.where(shared, mu["prob"], 0.0).sum(axis=1)
    est = _estimate(kl_s, m_s, np.where(shared, pi_at, 0.0).sum(axis=1), tol)
    est = np.minimum(np.maximum(est, lower), upper)
    empty = (mu["n"] == 0) | (pi["n"] == 0)
    nan = lambda x: np.where(empty, np.nan, x)  # noqa: E731
    return {"estimate": nan(est), "lower": nan(lower), "upper": nan(upper), "shared": shared.sum(axis=1),
            "mass_sampler": mu["prob"].sum(axis=1), "mass": pi["prob"].sum(axis=1)}


def _lower_e(m_e, n_e, p_t, mu, pi) -> np.ndarray:
    """min over u = pi(E) of the KL of the cells (E, everything outside S and E) beyond S."""
    m_r = mu["tail"]  # mu outside A = mu(T) + mu(outside both)
    p_all = p_t + pi["tail"]  # pi outside S
    u_max = np.minimum(n_e * pi["min"], pi["tail"])
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.where(m_e + m_r > 0, p_all * m_e / (m_e + m_r), 0.0)
    u = np.minimum(u, u_max)
    return xlogx_over(m_e, u) + xlogx_over(m_r, p_all - u)


def _lower_t(m_e, p_t, n_t, mu, pi) -> np.ndarray:
    """min over v = mu(T) of the KL of the cells (T, everything outside S and T) beyond S."""
    m_all = m_e + mu["tail"]  # mu outside S
    p_r = pi["tail"]  # pi outside B
    v_max = np.minimum(n_t * mu["min"], mu["tail"])
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(p_t + p_r > 0, m_all * p_t / (p_t + p_r), 0.0)
    v = np.minimum(v, v_max)
    return xlogx_over(v, p_t) + xlogx_over(m_all - v, p_r)


def _upper(kl_s, shared, mu, pi, logp_floor: float) -> np.ndarray:
    """kl_s plus the largest the rest can be when no unlisted trainer log-prob is below the floor."""
    floor_e = np.minimum(logp_floor, pi["log_min"])  # an unlisted trainer log-prob is <= log p_min too
    only_e = mu["ok"] & ~shared
    with np.errstate(invalid="ignore"):
        e_terms = np.where(only_e, mu["prob"] * (mu["logp"] - floor_e[:, None]), 0.0).sum(axis=1)
        # sum over unlisted y of mu(y)(log mu(y) - log pi(y)) <= tail_mu * max(that gap, 0)
        tail = mu["tail"] * np.maximum(mu["log_min"] - floor_e, 0.0)
    return kl_s + e_terms + tail


def _estimate(kl_s, m_s, p_s, tol: float) -> np.ndarray:
    """The coarsened KL (S's ids, the rest) plus the rest's mass times the renormalised KL on S
    (the rest's masses get `tol` each, as the tails do)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        cond = np.where(m_s > 0, kl_s / m_s - np.log(m_s / p_s), 0.0)  # KL(mu|S || pi|S)
    cond = np.where(np.isfinite(cond), np.maximum(cond, 0.0), cond)
    m_r, p_r = np.maximum(1.0 - m_s, 0.0), np.maximum(1.0 - p_s, 0.0)
    return kl_s + xlogx_over(m_r + tol, p_r + tol) + np.where(m_r > 0, m_r * cond, 0.0)


def top1(ids: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """[N] the id with the largest log-prob in each list (the first on a tie), -1 for an empty list."""
    ids, logp = np.asarray(ids), np.asarray(logp, np.float64)
    ok = valid_slots(ids, logp)
    at = np.where(ok, logp, -np.inf).argmax(axis=1)
    return np.where(ok.any(axis=1), np.take_along_axis(ids, at[:, None], axis=1)[:, 0], -1)


def discordant_pairs(ids_sampler: np.ndarray, logp_sampler: np.ndarray, ids: np.ndarray,
                     logp: np.ndarray) -> np.ndarray:
    """[N] Kendall's discordant-pair count over the shared ids: pairs the two sides order
    oppositely by log-prob (ties on either side count as neither)."""
    ok_s, ok_t = valid_slots(ids_sampler, logp_sampler), valid_slots(ids, logp)
    j = align(np.asarray(ids_sampler), ok_s, np.asarray(ids), ok_t)
    return _discordant(np.asarray(logp_sampler, np.float64), np.asarray(logp, np.float64), j)


def _discordant(logp_sampler: np.ndarray, logp: np.ndarray, j: np.ndarray) -> np.ndarray:
    """discordant_pairs from the engine-to-trainer slot map j (align)."""
    a = np.where(j >= 0, logp_sampler, np.nan).astype(np.float32)
    b = _gather(logp, j, np.nan).astype(np.float32)
    # ordered pairs (i, k) the engine ranks i above k and the trainer below: each discordant pair
    # once; comparisons with NaN (not shared) are False
    opposite = (a[:, :, None] > a[:, None, :]) & (b[:, :, None] < b[:, None, :])
    return np.count_nonzero(opposite.reshape(len(a), -1), axis=1)


def rank_of(ids: np.ndarray, logp: np.ndarray, token: np.ndarray) -> np.ndarray:
    """[N] 1-based rank of `token` [N] in each list by log-prob (1 = the list's top), 0 when not listed."""
    ids, logp = np.asarray(ids), np.asarray(logp, np.float64)
    ok = valid_slots(ids, logp)
    here = ok & (ids == np.asarray(token)[:, None])
    at = np.where(here, logp, -np.inf).max(axis=1)
    above = (ok & (np.where(ok, logp, -np.inf) > at[:, None])).sum(axis=1)
    return np.where(here.any(axis=1), above + 1, 0)


def compare(ids_sampler: np.ndarray, logp_sampler: np.ndarray, ids: np.ndarray, logp: np.ndarray,
            token: np.ndarray | None = None, logp_floor: float = -np.inf,
            tol: float = TOL) -> dict[str, np.ndarray]:
    """Every per-token figure from both lists ([N, K]): kl_topk's, `top1_agree` [N] bool (the two
    lists' top ids are the same), `discordant` [N], `rank_disagree` [N] bool (a discordant pair, or
    either side's top id missing from the other's list), and with `token` [N] (the sampled ids)
    `rank_sampler` / `rank` [N] (rank_of in each list). One id match per direction for all."""
    ids_s, ids_t = np.asarray(ids_sampler), np.asarray(ids)
    mu, pi = _side(ids_s, logp_sampler, tol), _side(ids_t, logp, tol)
    j = align(ids_s, mu["ok"], ids_t, pi["ok"])
    back = inverse(j, ids_t.shape[1])
    out = _kl(mu, pi, j, back >= 0, logp_floor, tol)
    top_s, top_t = mu["logp"].argmax(axis=1)[:, None], pi["logp"].argmax(axis=1)[:, None]
    both = (mu["n"] > 0) & (pi["n"] > 0)
    same = np.take_along_axis(j, top_s, axis=1)[:, 0] == top_t[:, 0]  # engine's top is the trainer's top
    out["top1_agree"] = both & same
    out["discordant"] = _discordant(mu["logp"], pi["logp"], j)
    s_in_t = np.take_along_axis(j, top_s, axis=1)[:, 0] >= 0
    t_in_s = np.take_along_axis(back, top_t, axis=1)[:, 0] >= 0
    out["rank_disagree"] = both & ((out["discordant"] > 0) | ~s_in_t | ~t_in_s)
    if token is not None:
        out["rank_sampler"] = rank_of(ids_s, logp_sampler, token)
        out["rank"] = rank_of(ids_t, logp, token)
    return out


def top_k_of(logp_full: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest log-probs of full distributions [N, V] and their ids, largest first ([N, k])."""
    logp_full = np.asarray(logp_full)
    idx = np.argsort(-logp_full, axis=1, kind="stable")[:, :k]
    return idx.astype(np.int64), np.take_along_axis(logp_full, idx, axis=1)


# ---- the reducer: per step figures and the worst tokens, from parts that hold the columns --------

SIDES = (("topk_ids_sampler", "topk_logp_sampler"), ("topk_ids", "topk_logp"))  # engine (mu), trainer (pi)
OFFENDER_KEY = ("step", "rank", "seq", "iteration", "pos")
CHUNK = 16_384  # tokens per vectorised call: the [N, K, K] id match stays ~6 MB at K = 20
STEP_SUMS = ("n_both", "n_trainer", "n_sampler", "sum_kl", "sum_lower", "sum_upper", "n_top1_agree",
             "n_rank_disagree", "n_unlisted", "n_unlisted_sampler")
STEP_MAXES = ("max_kl", "max_lower", "max_upper")


def padded(column: pa.Array | pa.ChunkedArray, fill: float | int, dtype) -> np.ndarray | None:
    """A list column as [N, K] (K: its longest list), short and null lists padded with `fill`;
    None when every entry is null."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if arr.null_count == len(arr):
        return None
    lengths = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = pc.list_flatten(arr).to_numpy(zero_copy_only=False)  # values of non-null lists, in order
    out = np.full((len(arr), int(lengths.max(initial=0))), fill, dtype)
    rows = np.repeat(np.arange(len(arr)), lengths)
    slots = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows, slots] = flat
    return out


def side(batch: pa.RecordBatch, ids_name: str, logp_name: str) -> tuple[np.ndarray, np.ndarray] | None:
    """One side's padded (ids, logp) of a batch, None when the batch lacks the columns or all are null."""
    if batch.schema.get_field_index(ids_name) < 0 or batch.schema.get_field_index(logp_name) < 0:
        return None
    ids = padded(batch.column(ids_name), -1, np.int64)
    logp = padded(batch.column(logp_name), np.nan, np.float64)
    if ids is None or logp is None:
        return None
    k = min(ids.shape[1], logp.shape[1])
    return ids[:, :k], logp[:, :k]


def _empty_side(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full((n, 1), -1, np.int64), np.full((n, 1), np.nan)


@dataclass
class _State:
    rank: int
    steps: list = field(default_factory=list)  # Keyed per batch
    worst: dict[str, np.ndarray] | None = None


@dataclass(frozen=True)
class TopkReducer:
    """Per step: tokens in the loss with each side's list, KL(mu || pi) estimate and bounds (mean
    and max, over tokens with both lists), top-1 agreement, rank disagreement, the sampled token
    unlisted by each side; and the `keep` tokens with the largest estimate. Rows without the
    columns (v1.1 parts, tokens a side did not record) add nothing; out of the loss, nothing."""

    keep: int = 32
    logp_floor: float = -40.0  # the bound `upper` assumes no unlisted trainer log-prob below it
    name: str = "topk"
    version: int = 1
    columns: tuple[str, ...] = ("step", "seq", "iteration", "pos", "token_id", "mask", *sum(SIDES, ()))

    def settings(self) -> dict:
        return {"keep": self.keep, "logp_floor": self.logp_floor, "tol": TOL}

    def start(self, part) -> _State:
        return _State(int(part.rank))

    def add(self, state: _State, batch: pa.RecordBatch) -> None:
        got = [side(batch, *names) for names in SIDES]
        if got[0] is None and got[1] is None:
            return
        mask = pc.fill_null(batch.column("mask"), False).to_numpy(zero_copy_only=False).astype(bool)
        n = batch.num_rows
        (ids_s, lp_s), (ids_t, lp_t) = (g if g is not None else _empty_side(n) for g in got)
        rows = np.flatnonzero(mask & (valid_slots(ids_s, lp_s).any(1) | valid_slots(ids_t, lp_t).any(1)))
        if not len(rows):
            return
        col = {c: pc.fill_null(batch.column(c), -1).to_numpy(zero_copy_only=False).astype(np.int64)[rows]
               for c in ("step", "seq", "iteration", "pos", "token_id")}
        per = [compare(ids_s[rows[i:i + CHUNK]], lp_s[rows[i:i + CHUNK]], ids_t[rows[i:i + CHUNK]],
                       lp_t[rows[i:i + CHUNK]], col["token_id"][i:i + CHUNK], self.logp_floor)
               for i in range(0, len(rows), CHUNK)]
        f = {k: np.concatenate([p[k] for p in per]) for k in per[0]}
        f["has_s"] = valid_slots(ids_s[rows], lp_s[rows]).any(1)
        f["has_t"] = valid_slots(ids_t[rows], lp_t[rows]).any(1)
        f["has_token"] = col["token_id"] >= 0  # a null token id: no rank to tell
        state.steps.append(step_table(col["step"], f))
        both = f["has_s"] & f["has_t"]
        cand = {**{c: col[c][both] for c in ("step", "seq", "iteration", "pos")},
                "rank": np.full(int(both.sum()), state.rank, np.int64),
                **{c: f[c][both] for c in ("estimate", "lower", "upper")}}
        state.worst = worst([cand] + ([state.worst] if state.worst else []), self.keep)

    def finish(self, state: _State, dropped: int) -> dict[str, np.ndarray]:
        steps = keyed.merge(state.steps) or step_table(np.zeros(0, np.int64), None)
        w = state.worst or worst([], 0)
        return {**{f"s_{k}": v for k, v in steps.items()}, **{f"w_{k}": v for k, v in w.items()}}

    def merge(self, partials) -> dict[str, np.ndarray]:
        steps = keyed.merge([{k[2:]: v for k, v in p.items() if k.startswith("s_")} for p in partials])
        steps = steps or step_table(np.zeros(0, np.int64), None)
        w = worst([{k[2:]: v for k, v in p.items() if k.startswith("w_")} for p in partials], self.keep)
        return {**{f"s_{k}": v for k, v in steps.items()}, **{f"w_{k}": v for k, v in w.items()}}

    def result(self, merged: dict[str, np.ndarray]) -> dict | None:
        return summary(merged, self.logp_floor)


def step_table(step: np.ndarray, f: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Per-step sums and maxima (keyed.merge reduces them) of the per-token figures `f` [N]."""
    if f is None:
        return {"step": step, **{c: np.zeros(0, np.int64 if c.startswith("n_") else np.float64)
                                 for c in (*STEP_SUMS, *STEP_MAXES)}}
    both = f["has_s"] & f["has_t"]
    t = {"step": step, "n_both": both.astype(np.int64), "n_trainer": f["has_t"].astype(np.int64),
         "n_sampler": f["has_s"].astype(np.int64),
         "n_top1_agree": (both & f["top1_agree"]).astype(np.int64),
         "n_rank_disagree": (both & f["rank_disagree"]).astype(np.int64),
         "n_unlisted": (f["has_t"] & f["has_token"] & (f["rank"] == 0)).astype(np.int64),
         "n_unlisted_sampler": (f["has_s"] & f["has_token"] & (f["rank_sampler"] == 0)).astype(np.int64)}
    for c in ("kl", "lower", "upper"):
        v = f["estimate" if c == "kl" else c]
        t[f"sum_{c}"] = np.where(both, v, 0.0)
        t[f"max_{c}"] = np.where(both, v, np.nan)
    return keyed.reduce_by_key(t)


def worst(tables: Sequence[dict[str, np.ndarray]], keep: int) -> dict[str, np.ndarray]:
    """The `keep` rows with the largest estimate (ties: step, rank, seq, pos, iteration) of tables."""
    tables = [t for t in tables if t and len(t["estimate"])]
    if not tables:
        return {**{c: np.zeros(0, np.int64) for c in OFFENDER_KEY},
                **{c: np.zeros(0, np.float64) for c in ("estimate", "lower", "upper")}}
    t = {c: np.concatenate([x[c] for x in tables]) for c in tables[0]}
    est = np.where(np.isnan(t["estimate"]), -np.inf, t["estimate"])
    order = np.lexsort([t["iteration"], t["pos"], t["seq"], t["rank"], t["step"], -est])[:keep]
    return {c: v[order] for c, v in t.items()}


def _rates(t: dict[str, float]) -> dict[str, float | None]:
    """Means and shares of one step's (or the run's) sums; None where no token has what they need."""
    def share(a: str, b: str) -> float | None:
        return float(t[a]) / float(t[b]) if t[b] else None

    return {"tokens_both": int(t["n_both"]), "tokens_trainer": int(t["n_trainer"]),
            "tokens_sampler": int(t["n_sampler"]),
            "kl_mean": share("sum_kl", "n_both"), "kl_max": _num(t["max_kl"]) if t["n_both"] else None,
            "lower_mean": share("sum_lower", "n_both"), "lower_max": _num(t["max_lower"]) if t["n_both"] else None,
            "upper_mean": share("sum_upper", "n_both"), "upper_max": _num(t["max_upper"]) if t["n_both"] else None,
            "top1_agree": share("n_top1_agree", "n_both"), "rank_disagree": share("n_rank_disagree", "n_both"),
            "sampled_unlisted": share("n_unlisted", "n_trainer"),
            "sampled_unlisted_sampler": share("n_unlisted_sampler", "n_sampler")}



def summary(merged: dict[str, np.ndarray], logp_floor: float) -> dict | None:
    """What `kldiag analyze --json` prints under "topk" (docs/metrics.md); None when no token in
    the loss has either side's top-k list (a run without the columns)."""
    steps = {k[2:]: v for k, v in merged.items() if k.startswith("s_")}
    if not len(steps.get("step", ())) or not (steps["n_trainer"].sum() + steps["n_sampler"].sum()):
        return None
    total = {c: steps[c].sum() for c in STEP_SUMS}
    total.update({c: np.fmax.reduce(steps[c]) for c in STEP_MAXES})  # fmax: NaN (no token) never wins
    rows = [{"step": int(s), **_rates({c: steps[c][i] for c in (*STEP_SUMS, *STEP_MAXES)})}
            for i, s in enumerate(steps["step"])]
    w = {k[2:]: v for k, v in merged.items() if k.startswith("w_")}
    offenders = [{**{c: int(w[c][i]) for c in OFFENDER_KEY}, "kl": float(w["estimate"][i]),
                  "lower": float(w["lower"][i]), "upper": float(w["upper"][i])} for i in range(len(w["estimate"]))]
    return {"logp_floor": logp_floor, **_rates(total), "steps": rows, "offenders": offenders}
