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
