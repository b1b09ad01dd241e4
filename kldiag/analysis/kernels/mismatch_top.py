"""The candidate rows of the largest-|mismatch| selection in one compiled pass (reducers/mismatch_tokens.py).

Per token in the loss, with o = logp_old (logp where null) and m = logp_sampler, in the stored float32:
size = |o - m|, -1 where that is NaN (a null or inf - inf), +inf kept (the selection ranks it first). Two
lists of row indices come back, ascending:

    largest   rows with a finite size >= the running threshold
    routed    rows with route_differ > 0 and size >= the running threshold (any size: NaN ranks last)

The running threshold starts at the caller's floor (the keep-th size its selection already holds) and
rises to the keep-th largest size among the rows kept so far: a row below it has `keep` rows strictly
larger and cannot be among the `keep` largest, so every row of the true top `keep` is kept, ties with
the threshold included (the selection breaks them by key). Threshold selection of a top-k, as in
a streaming top-k (Cormode and Hadjieleftheriou 2008, "Finding frequent items in data streams", the
space-saving family): one pass and no sort of the batch.

Rows go in chunks of CHUNK: a branch-free loop that LLVM vectorises counts the chunk's rows at or above
the thresholds; only a chunk that has one is scanned again, row by row, to append them. Past the first
few thousand rows the threshold has risen and almost every chunk is one vectorised count.
"""

from __future__ import annotations

import numpy as np

from kldiag.jit import njit

INF32 = np.float32(np.inf)  # top_candidates' `inf`

JIT = dict(cache=True, nogil=True, error_model="numpy")
CHUNK = 64  # rows counted in one vectorised loop; a chunk with a hit is appended whole (fewer rows: fewer)


@njit(inline="always", **JIT)
def size_of(lp, lo, mu):  # pragma: no cover - compiled
    """|o - m| in float32 as the reducer computes it (o = lo, or lp where lo is NaN), -1 where NaN."""
    o = lo if lo == lo else lp
    s = abs(o - mu)
    return s if s == s else np.float32(-1.0)


@njit(inline="always", **JIT)
def _count(mask, lp, lo, mu, differ, routes, a, b, t_w, t_r, inf):  # pragma: no cover - compiled
    """Rows of [a, b) that pass the largest (finite size >= t_w) or routed (differ > 0, size >= t_r) test."""
    m_, p_, o_, u_ = mask[a:b], lp[a:b], lo[a:b], mu[a:b]
    hits = 0
    for i in range(len(m_)):
        s = size_of(p_[i], o_[i], u_[i])
        hits += m_[i] & (s >= t_w) & (s < inf)
    if routes:
        d_ = differ[a:b]
        for i in range(len(m_)):
            s = size_of(p_[i], o_[i], u_[i])
            hits += m_[i] & (d_[i] > 0) & (s >= t_r)
    return hits


@njit(**JIT)
def _room(rows, sizes, n, keep, t):  # pragma: no cover - compiled
    """(rows, sizes, n, t) with room for CHUNK more entries: the threshold raised to the keep-th largest
    size held (exact: every row above the old threshold is held), the entries below it dropped, and the
    arrays doubled when ties with the threshold still fill half of them."""
    if n + CHUNK <= len(rows):
        return rows, sizes, n, t
    if n >= keep:
        t = max(t, np.partition(sizes[:n].copy(), n - keep)[n - keep])
        k = 0
        for j in range(n):
            if sizes[j] >= t:
                rows[k], sizes[k] = rows[j], sizes[j]
                k += 1
        n = k
    if 2 * (n + CHUNK) > len(rows):
        grown_rows, grown_sizes = np.empty(2 * len(rows), np.int64), np.empty(2 * len(rows), np.float32)
        grown_rows[:n], grown_sizes[:n] = rows[:n], sizes[:n]
        return grown_rows, grown_sizes, n, t
    return rows, sizes, n, t


@njit(**JIT)
def top_candidates(mask, lp, lo, mu, differ, routes, keep, floor_w, floor_r, inf):  # pragma: no cover - compiled
    """(largest rows, routed rows), int64 ascending (module docstring). mask bool [n]; lp, lo, mu float32 [n]
    (NaN where null); differ int [n] (read only when `routes`); floor_w, floor_r: the thresholds to start
    from (0 and -1: none; float32 values, compared in float32 as the sizes are); keep >= 1; inf: INF32 from
    the caller (a constant the compiler sees turns the compare into a class test that it does not vectorise).

    The candidate arrays hold 2 * keep + CHUNK entries: the threshold is brought up to date each time
    CHUNK more might not fit, so it lags the exact running keep-th largest by a factor of about two. A
    chunk with a hit is appended branch-free (every row stored, the count advanced by the test)."""
    n = len(mask)
    cap = 2 * keep + 2 * CHUNK
    rows_w, size_w = np.empty(cap, np.int64), np.empty(cap, np.float32)
    rows_r, size_r = np.empty(cap, np.int64), np.empty(cap, np.float32)
    n_w = n_r = 0
    t_w, t_r = np.float32(max(floor_w, 0.0)), np.float32(max(floor_r, -1.0))
    for a in range(0, n, CHUNK):
        b = min(a + CHUNK, n)
        if _count(mask, lp, lo, mu, differ, routes, a, b, t_w, t_r, inf) == 0:
            continue
        rows_w, size_w, n_w, t_w = _room(rows_w, size_w, n_w, keep, t_w)
        for i in range(a, b):
            s = size_of(lp[i], lo[i], mu[i])
            rows_w[n_w], size_w[n_w] = i, s
            n_w += mask[i] & (s >= t_w) & (s < inf)
        if routes:
            rows_r, size_r, n_r, t_r = _room(rows_r, size_r, n_r, keep, t_r)
            for i in range(a, b):
                s = size_of(lp[i], lo[i], mu[i])
                rows_r[n_r], size_r[n_r] = i, s
                n_r += mask[i] & (differ[i] > 0) & (s >= t_r)
    return rows_w[:n_w].copy(), rows_r[:n_r].copy()
