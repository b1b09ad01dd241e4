"""The learning signal (kldiag.analysis.reducers.signal, kldiag.diagnosis.signal): dead groups and the KL term's share of the
gradient weight mass on a hand-built batch, and kl_dominated_signal on small known-truth runs with a healthy twin."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.reducers import signal as SG
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers
from kldiag.tools import truth as T


def _batch() -> pa.RecordBatch:
    # step 0: group 0 = seqs 0, 1 with advantages +1, -1 (live); group 1 = seqs 2, 3 both 0 (dead); one token each
    # but seq 0 (two tokens); step 1: group 5 = one sequence (not judged)
    return pa.RecordBatch.from_pydict({
        "step": [0, 0, 0, 0, 0, 1], "seq": [0, 0, 1, 2, 3, 9], "group": [0, 0, 0, 1, 1, 5],
        "mask": [True] * 6, "advantage": [1.0, 1.0, -1.0, 0.0, 0.0, 0.5],
        "logp": [math.log(0.5)] * 6, "logp_old": [math.log(0.25)] + [math.log(0.5)] * 5,
        "logp_ref": [math.log(0.25)] * 6})


def test_groups_dead_share_and_the_kl_terms_mass():
    m = SG.merge_partials([SG.batch_partial(_batch())])
    g = SG.groups(m)
    assert g["step"].tolist() == [0, 0, 1] and g["dead"].tolist() == [False, True, False]
    ps = SG.per_step(m, beta=0.1, estimator="k3")
    assert ps["groups"].tolist() == [2, 0] and ps["dead_groups"].tolist() == [1, 0]
    assert ps["dead_group_share"][0] == 0.5 and math.isnan(ps["dead_group_share"][1])
    assert ps["kl_alone_share"][0] == pytest.approx(2 / 5)
    # |A rho|: 1 * 2 (rho = 0.5/0.25), 1, 1, 0, 0; K3 weight 1 - pi_ref/pi_theta = 0.5 on every token
    assert ps["pg_mass"][0] == pytest.approx(4.0) and ps["kl_mass"][0] == pytest.approx(0.1 * 0.5 * 5)
    assert ps["kl_mass_share"][0] == pytest.approx(0.25 / 4.25)
    assert np.isnan(SG.per_step(m, beta=0.0, estimator="k3")["kl_mass"]).all()  # no KL term: not measured
    assert SG.dead_groups_at(m, 0) == [1]


def _run(tmp_path, name, **kw):
    sc = replace(T.SCENARIOS[name], steps=60, seqs=16, group=4, min_len=16, max_len=24, dead_from=20, **kw)
    return diagnose(analyze(T.make_run(tmp_path / name, sc), AnalysisConfig(), reducers()))


def test_kl_dominated_signal_and_its_twin(tmp_path):
    dg = _run(tmp_path, "kl_dominated_signal")
    assert [(c.cause, c.severity) for c in dg.causes] == [("kl_dominated_signal", "warning")]
    c = dg.causes[0]
    assert abs(c.onset - 20) <= 3 and c.evidence["dead_groups_at_onset"]
    assert c.evidence["kl_alone_share_mean_after"] > 0.5 and c.evidence["kl_mass_share_early"] < 0.2
    assert _run(tmp_path, "dead_groups_few").causes == []


def test_no_kl_term_no_cause(tmp_path):
    sc = replace(T.SCENARIOS["kl_dominated_signal"], manifest="trl_beta0", steps=60, seqs=16, group=4, min_len=16,
                 max_len=24, dead_from=20)
    dg = diagnose(analyze(T.make_run(tmp_path / "beta0", sc), AnalysisConfig(), reducers()))
    assert "kl_dominated_signal" not in {c.cause for c in dg.causes}


def test_fused_weights_equal_the_estimators():
    from kldiag import estimators as E

    rng = np.random.default_rng(0)
    logp, ref = -rng.exponential(2.0, 2000), -rng.exponential(2.0, 2000)
    old = logp + rng.normal(0, 0.3, 2000)
    ref[:5] = np.nan
    got = SG.weights_abs(logp, ref, old)
    assert set(got) == set(E.ESTIMATORS)
    for name, w in got.items():
        want = np.abs(E.weight(name, logp, ref, old))
        ok = np.isfinite(want) & np.isfinite(ref)
        assert np.allclose(w[ok], want[ok], rtol=1e-12, atol=1e-300), name
        assert not np.isfinite(w[:5]).any(), name  # no pi_ref, no KL weight (k1's 1 included)


def test_the_compiled_pass_sums_the_numpy_weights():
    """signal_kernel.signal_rows per (step, group, seq) run equals weights_abs summed with numpy (float32 inputs)."""
    from kldiag.analysis.kernels import signal as SK

    rng = np.random.default_rng(1)
    n = 3000
    logp = (-rng.exponential(2.0, n)).astype(np.float32)
    ref = (-rng.exponential(2.0, n)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, n)).astype(np.float32)
    seq = np.repeat(np.arange(n // 30), 30)
    b = pa.RecordBatch.from_pydict({"step": seq // 10, "group": seq // 4, "seq": seq, "mask": rng.random(n) > 0.1,
                                    "advantage": rng.normal(0, 1, n).astype(np.float32), "logp": logp,
                                    "logp_old": old, "logp_ref": ref})
    got = SG.batch_partial(b)
    m = b.column("mask").to_numpy(zero_copy_only=False)
    w = SG.weights_abs(logp.astype(np.float64), ref.astype(np.float64), old.astype(np.float64))
    assert set(SK.ESTIMATOR_ORDER) == set(w)
    for name in SK.ESTIMATOR_ORDER:
        want = np.bincount(seq[m], weights=w[name][m], minlength=n // 30)
        assert np.allclose(got[f"sum_w_{name}"], want, rtol=1e-10), name
    pg = np.abs(b.column("advantage").to_numpy().astype(np.float64) * np.exp(logp.astype(np.float64) - old))
    assert np.allclose(got["sum_pg"], np.bincount(seq[m], weights=pg[m], minlength=n // 30), rtol=1e-10)


def _reference_rows(b: pa.RecordBatch) -> dict[tuple, list]:
    """The signal rows of a batch by a plain Python loop over its tokens (the kernel's conventions)."""
    d = b.to_pydict()
    out: dict[tuple, list] = {}
    for i in range(b.num_rows):
        a, lp = d["advantage"][i], d["logp"][i]
        if not d["mask"][i] or a is None or lp is None or not (math.isfinite(a) and math.isfinite(lp)):
            continue
        row = out.setdefault((d["step"][i], d["group"][i], d["seq"][i]), [0, 0, 0, -math.inf, math.inf] + [0.0] * 7)
        row[0] += 1
        row[1] += abs(a) <= SG.SPREAD_TOL
        row[3], row[4] = max(row[3], a), min(row[4], a)
        lo = d["logp_old"][i] if d["logp_old"][i] is not None else lp
        rho = math.exp(min(lp - lo, 700.0))
        row[5] += abs(a * rho) if math.isfinite(abs(a * rho)) else 0.0
        rf = d["logp_ref"][i]
        if rf is None or not math.isfinite(rf):
            continue
        row[2] += 1
        w = SG.weights_abs(np.array([lp]), np.array([rf]), np.array([lo]))
        for j, name in enumerate(("k1", "k2", "k3", "k3_is", "k3_clamped", "kl_rev")):
            v = float(w[name][0]) if name != "k1" else 1.0
            row[6 + j] += v if math.isfinite(v) else 0.0
    return out


def test_the_compiled_pass_on_findings_nulls_and_keys_that_come_back():
    """Non-finite and null log-probs and advantages, a sequence whose loss tokens come back after another
    sequence's non-loss rows, rows of no loss token: the merged rows equal a plain loop's (sums to rounding)."""
    nan, inf = float("nan"), float("inf")
    b = pa.RecordBatch.from_pydict({
        "step": [0] * 9 + [1] * 3, "group": [0, 0, 0, 0, 1, 1, 0, 0, 2, 3, 3, 3],
        "seq": [0, 0, 1, 1, 2, 2, 0, 0, 4, 5, 5, 6],
        "mask": [True, True, False, False, True, True, True, False, True, True, True, False],
        "advantage": pa.array([0.5, -1.0, 2.0, 2.0, 0.0, None, 1.5, 1.0, nan, 1e-7, 0.3, 0.3], pa.float32()),
        "logp": pa.array([-1.0, -2.0, -1.0, -1.0, -0.5, -0.7, inf, -1.0, -1.0, -3.0, -0.1, -1.0], pa.float32()),
        "logp_old": pa.array([-1.1, None, -1.0, -1.0, -0.4, -0.7, -1.0, -1.0, -1.0, -30.0, -0.1, -1.0], pa.float32()),
        "logp_ref": pa.array([-0.5, -9.0, -1.0, None, None, -0.2, -1.0, -1.0, -1.0, -1.0, nan, -1.0], pa.float32())})
    m = SG.merge_partials([SG.batch_partial(b)])
    want = _reference_rows(b)
    got = {(int(s), int(g), int(q)): i for i, (s, g, q) in enumerate(zip(m["step"], m["group"], m["seq"], strict=True))}
    assert sorted(got) == sorted(want)
    names = ["n_tokens", "n_kl_alone", "n_ref", "max_adv", "min_adv", "sum_pg",
             *(f"sum_w_{n}" for n in ("k1", "k2", "k3", "k3_is", "k3_clamped", "kl_rev"))]
    for key, i in got.items():
        # float32 inputs read as float64 in both; the kernel's fastexp is within 2 ulp of math.exp's
        assert [m[n][i] for n in names] == pytest.approx(want[key], rel=1e-12), key


def test_no_advantage_no_rows():
    b = _batch().drop_columns(["advantage"])
    assert SG.batch_partial(b) is None
    assert SG.merge_partials([SG.batch_partial(b)])["step"].tolist() == []


def test_the_compiled_pass_on_no_rows():
    from kldiag.analysis.kernels import signal as SK

    i, b, f = np.zeros(0, np.int64), np.zeros(0, bool), np.zeros(0, np.float32)
    assert SK.key_runs(i, i, i).tolist() == [0]
    keys, cnt, val = SK.signal_rows(i, i, i, b, f, b, f, b, f, b, f, b, SG.SPREAD_TOL, 10.0)
    assert keys.shape == (0, 3) and cnt.shape == (0, 3) and val.shape == (0, 9)
