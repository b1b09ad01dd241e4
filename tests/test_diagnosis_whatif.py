"""What-if replay on hand-built batches with known answers, and on the demo pair."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from kldiag.format.schema import TOKEN_SCHEMA
from kldiag.mismatch import tokenset as TS
from kldiag.mismatch import whatif as W


def batch(logp, logp_old, logp_sampler, advantage, seq, step=None) -> TS.TokenSet:
    n = len(logp)
    seq = np.asarray(seq)
    pos = np.concatenate([np.arange(c) for c in np.unique(seq, return_counts=True)[1]])
    cols = {"step": np.zeros(n, np.int64) if step is None else np.asarray(step), "seq": seq, "pos": pos,
            "logp": logp, "logp_old": logp_old, "logp_sampler": logp_sampler, "advantage": advantage}
    defaults = {"micro": 0, "iteration": 0, "rank": 0, "mask": True, "attempt": 0, "group": 0, "token_id": 1}
    arrays = [pa.array(cols[f.name], f.type) if f.name in cols else
              pa.array([defaults.get(f.name)] * n, f.type) for f in TOKEN_SCHEMA]
    return TS.from_table(pa.Table.from_arrays(arrays, schema=TOKEN_SCHEMA))


LN = math.log
# two sequences of 2 tokens; ratios pi_theta/mu = 3, 1 | 0.25, 1; advantages +1 and -2
TS4 = batch(logp=[LN(0.3), LN(0.5), LN(0.1), LN(0.5)], logp_old=[LN(0.3), LN(0.5), LN(0.1), LN(0.5)],
            logp_sampler=[LN(0.1), LN(0.5), LN(0.4), LN(0.5)], advantage=[1.0, 1.0, -2.0, -2.0], seq=[0, 0, 1, 1])


def row(t):
    return t.to_pylist()[0]


def test_token_tis_clips_and_counts_the_mass_it_removes():
    r = row(W.replay(TS4, W.WhatIf("tis_token", "sampler", cap=2.0)))
    assert r["token_frac"] == 0.25 and r["seq_frac"] == 0.5
    assert r["mass_removed_pos"] == pytest.approx((3 - 2) * 1.0)
    assert r["mass_removed_neg"] == 0.0
    assert r["mass_removed_pos_share"] == pytest.approx(1.0 / (3 + 1))
    w = np.array([2.0, 1.0, 0.25, 1.0])
    assert r["ess"] == pytest.approx(w.sum() ** 2 / (4 * (w**2).sum()))
    assert r["chi2"] == pytest.approx((w**2).mean() - 1)


def test_trainer_convention_uses_pi_old():
    r = row(W.replay(TS4, W.WhatIf("tis_token", "trainer", cap=2.0)))  # pi_theta == pi_old here
    assert r["token_frac"] == 0.0 and r["ess"] == pytest.approx(1.0) and r["mass_removed_pos"] == 0.0


def test_icepop_zeroes_outside_the_band():
    r = row(W.replay(TS4, W.WhatIf("icepop", "sampler", low=0.5, high=2.0)))
    assert r["token_frac"] == 0.5 and r["seq_frac"] == 1.0
    assert r["mass_removed_pos"] == pytest.approx(3.0) and r["mass_removed_neg"] == pytest.approx(0.25 * 2)


def test_sequence_level_methods():
    seq = row(W.replay(TS4, W.WhatIf("tis_seq", "sampler", cap=2.0)))  # R = 3 and 0.25
    assert seq["seq_frac"] == 0.5 and seq["token_frac"] == 0.5
    assert seq["mass_removed_pos"] == pytest.approx(2 * (3 - 2))
    geo = row(W.replay(TS4, W.WhatIf("geo_rs", "sampler", low=0.6, high=1.6)))  # G = sqrt(3), 0.5
    assert geo["seq_frac"] == 1.0
    # G = 1.73 kept (its r = 3 token clipped to 1.5), G = 0.5 dropped
    smt = row(W.replay(TS4, W.WhatIf("seq_mask_tis", "sampler", low=0.6, high=2.0, cap=1.5)))
    assert smt["seq_frac"] == 0.5 and smt["token_frac"] == 0.75
    assert smt["mass_removed_pos"] == pytest.approx(1.5) and smt["mass_removed_neg_share"] == pytest.approx(1.0)


def test_opsm_drops_only_stale_negative_sequences():
    # seq 1 (A < 0): mean(log mu - log pi_theta) = (log 4 + 0)/2 > delta -> dropped; seq 0 has A > 0
    r = row(W.replay(TS4, W.WhatIf("opsm", "sampler", delta=1e-4)))
    assert r["seq_frac"] == 0.5 and r["mass_removed_pos"] == 0.0
    assert r["mass_removed_neg_share"] == pytest.approx(1.0)
    assert row(W.replay(TS4, W.WhatIf("opsm", "sampler", delta=1.0)))["seq_frac"] == 0.0


def test_unknown_method_and_convention_name_the_choices():
    with pytest.raises(ValueError, match="tis_token"):
        W.replay(TS4, W.WhatIf("tis"))
    with pytest.raises(ValueError, match="sampler"):
        W.replay(TS4, W.WhatIf(convention="mu"))


def test_demo_sweep_is_monotone_in_the_cap():
    ts = TS.load("sample_logs/demo_k3")
    t = W.sweep(ts, W.WhatIf("tis_token", "sampler"), "cap", [1.1, 1.5, 2.0, 4.0])
    frac = t.column("token_frac").to_pylist()
    assert frac == sorted(frac, reverse=True) and frac[0] > frac[-1] >= 0
    per_step = W.replay(ts, W.WhatIf("icepop", "sampler"))
    assert per_step.num_rows == 200 and (np.array(per_step.column("tokens").to_pylist()) == 512).all()
