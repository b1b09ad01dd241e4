"""Decomposition log(pi_theta/mu) = drift + mismatch: the identity, the buckets, and the demo's
low-probability pitfall (the engine at temperature 1.2 flattens mu, so mismatch grows as mu's probability falls)."""

from __future__ import annotations

import numpy as np
import pytest

from kldiag.mismatch import decompose as D
from kldiag.mismatch import tokenset as TS

DEMO = "sample_logs/demo_k3"


@pytest.fixture(scope="module")
def ts():
    return TS.load(DEMO)


def test_terms_add_up_and_steps_agree_with_the_tokens(ts):
    t = D.terms(ts)
    np.testing.assert_allclose(t["total"], ts.logp - ts.logp_sampler, rtol=0, atol=1e-12)
    table = D.by_step(ts).to_pylist()
    assert len(table) == 200 and table[0]["drift_abs"] == 0.0  # step 0: pi_theta is pi_old
    sel = ts.step == 37
    row = table[37]
    assert row["mismatch_abs"] == pytest.approx(np.abs(ts.logp_old[sel] - ts.logp_sampler[sel]).mean())
    assert row["drift_abs"] == pytest.approx(np.abs(ts.logp[sel] - ts.logp_old[sel]).mean())


def test_low_probability_pitfall_on_the_demo(ts):
    b = D.by_sampler_prob(ts).to_pylist()
    assert sum(r["tokens"] for r in b) == len(ts)
    low, high = b[0], b[-1]
    assert low["hi"] <= 0.01 and high["lo"] >= 0.1
    assert low["mismatch_abs"] > 5 * high["mismatch_abs"]
    assert low["mismatch_k3"] > 10 * high["mismatch_k3"]


def test_position_and_entropy_buckets(ts):
    pos = D.by_position(ts).to_pylist()
    assert [(r["lo"], r["hi"]) for r in pos] == [(0, 1), (1, 2), (2, 4), (4, 8)]  # 8-token completions
    assert [r["tokens"] for r in pos] == [12800, 12800, 25600, 51200]
    assert D.by_entropy(ts) is None  # the demo records no entropy
    ts2 = TS.load("sample_logs/trl_grpo_tiny")
    ent = D.by_entropy(ts2)
    assert ent is not None and sum(ent.column("tokens").to_pylist()) == int(ts2.mask.sum())


def test_summary_share(ts):
    s = D.summary(ts)
    assert s["tokens"] == 102400
    assert s["mismatch_share"] == pytest.approx(s["mismatch_abs"] / (s["drift_abs"] + s["mismatch_abs"]))


def test_mismatch_k3_keeps_precision_near_zero():
    """K3 of KL(mu || pi_old) for a tiny log-ratio d: exp(d) - d - 1 gives 0 at d = 1e-9 (cancellation);
    the expm1 form (kldiag.estimators) matches the series d^2/2 + d^3/6 + d^4/24 to a few 1e-7."""
    m = np.array([-1e-9, 1e-9, -0.5 - 1e-9, -1e-6, -3e-5])  # log mu; one token per step
    o = np.array([0.0, 0.0, -0.5, 0.0, 0.0])  # log pi_old
    n = len(m)
    ints = np.arange(n, dtype=np.int64)
    ts = TS.TokenSet(step=ints, seq=np.zeros(n, np.int64), group=np.full(n, -1), pos=np.zeros(n, np.int64),
                     token_id=np.full(n, -1), iteration=np.zeros(n, np.int64), micro=np.zeros(n, np.int64),
                     rank=np.zeros(n, np.int64), logp=o.copy(), logp_old=o, logp_ref=np.full(n, np.nan),
                     logp_sampler=m, advantage=np.full(n, np.nan), mask=np.ones(n, bool), entropy=np.full(n, np.nan),
                     has_old=np.ones(n, bool))
    d = o - m  # exact in float64 (Sterbenz), the d decompose sees
    series = d**2 / 2 + d**3 / 6 + d**4 / 24
    got = np.array(D.by_step(ts).column("mismatch_k3").to_pylist())
    np.testing.assert_allclose(got, series, rtol=1e-6)
    assert np.exp(d[0]) - d[0] - 1 == 0.0  # what the naive form gives: every digit lost


def _random_set(n: int, seed: int = 0, sort: bool = True) -> TS.TokenSet:
    """n tokens over 7 steps with what the sums must skip: masked tokens, NaN and -inf log-probs, no sampler
    log-prob, NaN entropy, positions past the last finite edge."""
    rng = np.random.default_rng(seed)
    step = np.sort(rng.integers(0, 7, n)) if sort else rng.integers(0, 7, n)
    logp_old = -rng.exponential(2.0, n)
    logp = logp_old + rng.normal(0, 0.05, n)
    logp_sampler = logp_old + rng.normal(0, 0.2, n)
    logp[rng.random(n) < 0.01] = np.nan
    logp_old[rng.random(n) < 0.01] = -np.inf
    logp_sampler[rng.random(n) < 0.05] = np.nan
    entropy = rng.gamma(2.0, 0.5, n)
    entropy[rng.random(n) < 0.03] = np.nan
    ints = np.zeros(n, np.int64)
    return TS.TokenSet(step=step, seq=ints, group=ints - 1, pos=rng.integers(-1, 40000, n), token_id=ints - 1,
                       iteration=ints, micro=ints, rank=ints, logp=logp, logp_old=logp_old, logp_ref=np.full(n, np.nan),
                       logp_sampler=logp_sampler, advantage=np.full(n, np.nan), mask=rng.random(n) > 0.1,
                       entropy=entropy, has_old=np.ones(n, bool))


def _reference(ts: TS.TokenSet, group: np.ndarray) -> dict[int, dict[str, float]]:
    """COLUMNS per group value, from plain per-group numpy means (the definitions in the module docstring)."""
    keep = ts.mask & np.isfinite(ts.logp) & np.isfinite(ts.logp_old)
    d = ts.logp_old - ts.logp_sampler
    has_m = keep & np.isfinite(d)
    out = {}
    for g in np.unique(group[keep]):
        k, m = keep & (group == g), has_m & (group == g)
        out[int(g)] = {"tokens": int(k.sum()), "drift_abs": np.abs(ts.logp - ts.logp_old)[k].mean(),
                       "mismatch_abs": np.abs(d[m]).mean() if m.any() else np.nan,
                       "mismatch_mean": d[m].mean() if m.any() else np.nan,
                       "mismatch_k3": (np.expm1(d[m]) - d[m]).mean() if m.any() else np.nan,
                       "total_abs": np.abs(ts.logp - ts.logp_sampler)[m].mean() if m.any() else np.nan}
    return out


def _agrees(rows: list[dict], ref: dict[int, dict[str, float]], key) -> None:
    assert len(rows) == len(ref)
    for row in rows:
        want = ref[key(row)]
        assert row["tokens"] == want["tokens"]
        for c in D.MEANS:  # sums in another order than the reference's mean: equal to rounding
            np.testing.assert_allclose(row[c], want[c], rtol=1e-12, err_msg=c)


@pytest.mark.parametrize("sort", [True, False])
def test_every_view_agrees_with_per_group_means_across_blocks(monkeypatch, sort):
    """every_view in blocks (BLOCK made small: 12 blocks, a step's run split across them) gives each grouping's
    per-group means, the standalone functions' tables and summary; unsorted steps too."""
    monkeypatch.setattr(D, "BLOCK", 997)
    ts = _random_set(12_000, sort=sort)
    v = D.every_view(ts)
    _agrees(v["by_step"].to_pylist(), _reference(ts, ts.step), lambda r: r["step"])
    prob = np.clip(np.searchsorted(D.PROB_EDGES, np.exp(ts.logp_sampler), side="right") - 1, 0, len(D.PROB_EDGES) - 2)
    prob[~np.isfinite(ts.logp_sampler)] = -1  # no bucket
    ref = {g: r for g, r in _reference(ts, prob).items() if g >= 0}
    _agrees(v["by_prob"].to_pylist(), ref, lambda r: int(np.flatnonzero(D.PROB_EDGES == r["lo"])[0]))
    pos = np.clip(np.searchsorted(D.POS_EDGES, ts.pos, side="right") - 1, 0, len(D.POS_EDGES) - 2)
    _agrees(v["by_pos"].to_pylist(), _reference(ts, pos), lambda r: int(np.flatnonzero(D.POS_EDGES == r["lo"])[0]))
    assert [r["tokens"] for r in v["by_entropy"].to_pylist()] == [r["tokens"] for r in D.by_entropy(ts).to_pylist()]
    kept = ts.mask & np.isfinite(ts.logp) & np.isfinite(ts.logp_old)
    assert sum(r["tokens"] for r in v["by_entropy"].to_pylist()) == int((kept & np.isfinite(ts.entropy)).sum())
    for name, alone in (("by_step", D.by_step(ts)), ("by_prob", D.by_sampler_prob(ts)), ("by_pos", D.by_position(ts))):
        got, want = v[name].to_pandas(), alone.to_pandas()
        assert list(got.columns) == list(want.columns) and len(got) == len(want), name
        np.testing.assert_allclose(got.to_numpy(float), want.to_numpy(float), rtol=1e-12, err_msg=name)
    whole = _reference(ts, np.zeros(len(ts), np.int64))[0]
    for c, want in whole.items():
        assert v["summary"][c] == pytest.approx(want, rel=1e-12) and D.summary(ts)[c] == pytest.approx(want, rel=1e-12)


def test_empty_set_gives_empty_tables():
    ts = _random_set(0)
    v = D.every_view(ts)
    assert v["by_step"].num_rows == 0 and v["by_prob"].num_rows == 0 and v["by_entropy"] is None
    assert v["summary"]["tokens"] == 0


@pytest.mark.parametrize("edges", [D.PROB_EDGES, D.POS_EDGES.astype(np.float64), np.linspace(0.1, 3.0, 11),
                                   np.arange(300.0)])
def test_bucket_index_is_the_clipped_searchsorted(edges):
    """Values on the edges, between them, outside them and not finite: the bucket searchsorted gives (clipped to
    the buckets), k where not finite; the counting form and (past 255 buckets) searchsorted itself."""
    rng = np.random.default_rng(1)
    x = np.concatenate([edges, np.nextafter(edges, -np.inf), np.nextafter(edges, np.inf),
                        rng.uniform(edges[0] - 1, edges[-1] * 1.5 + 1, 5000), [np.nan, np.inf, -np.inf, -1e300]])
    k = len(edges) - 1
    want = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, k - 1)
    want[~np.isfinite(x)] = k
    got = D.bucket_index(x, edges)
    assert got.dtype == np.int64 and np.array_equal(got, want)
