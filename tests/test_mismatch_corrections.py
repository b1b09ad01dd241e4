"""The 2026 corrections (kldiag.mismatch.corrections) on hand-built tokens with known answers, DPPO against verl
0.9.1's own loss functions on the demo run's tokens, and their what-if rows (kldiag.mismatch.whatif)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

from kldiag.format.schema import TOKEN_SCHEMA
from kldiag.mismatch import corrections as CR
from kldiag.mismatch import tokenset as TS
from kldiag.mismatch import whatif as W

LN = math.log


def batch(logp, logp_old, logp_sampler, advantage, seq) -> TS.TokenSet:
    n, seq = len(logp), np.asarray(seq)
    pos = np.concatenate([np.arange(c) for c in np.unique(seq, return_counts=True)[1]])
    cols = {"step": np.zeros(n, np.int64), "seq": seq, "pos": pos, "logp": logp, "logp_old": logp_old,
            "logp_sampler": logp_sampler, "advantage": advantage}
    defaults = {"micro": 0, "iteration": 0, "rank": 0, "mask": True, "attempt": 0, "group": 0, "token_id": 1}
    arrays = [pa.array(cols[f.name], f.type) if f.name in cols else pa.array([defaults.get(f.name)] * n, f.type)
              for f in TOKEN_SCHEMA]
    return TS.from_table(pa.Table.from_arrays(arrays, schema=TOKEN_SCHEMA))


def test_dppo_tv_masks_only_the_direction_the_advantage_pushes():
    p = np.array([0.6, 0.6, 0.1, 0.1, 0.6])
    b = np.array([0.3, 0.3, 0.4, 0.4, 0.3])
    adv = np.array([1.0, -1.0, -1.0, 1.0, 0.0])
    got = CR.dppo_tv(np.log(p), np.log(b), adv, 0.2, 0.2)
    # +0.3 with A > 0: out; +0.3 with A < 0: kept (moving back); -0.3 with A < 0: out; A > 0: kept; A = 0: kept
    assert got.tolist() == [True, False, True, False, False]
    assert not CR.dppo_tv(np.log(p), np.log(b), adv, 0.35, 0.35).any()


def test_dppo_kl_uses_the_binary_kl_of_the_sampled_probability():
    p, b = np.array([0.6, 0.31]), np.array([0.3, 0.3])
    kl = CR.binary_kl(np.log(p), np.log(b))
    want = 0.3 * LN(0.3 / 0.6) + 0.7 * LN((0.7 + 1e-8) / (0.4 + 1e-8))
    assert kl[0] == pytest.approx(want, rel=1e-12) and 0 < kl[1] < 1e-3
    assert CR.dppo_kl(np.log(p), np.log(b), np.array([1.0, 1.0]), 0.05, 0.05).tolist() == [True, False]
    assert not CR.dppo_kl(np.log(p), np.log(b), np.array([-1.0, -1.0]), 0.05, 0.05).any()  # moving up, A < 0


def test_m2po_of_no_token_masks_none():
    """A run without advantages replays no token: M2PO's per-step loop has no step to walk."""
    assert CR.m2po(np.zeros(0), np.zeros(0, np.int64), 0.04).shape == (0,)


def test_m2po_drops_the_fewest_largest_squares():
    lr = np.array([0.0, 0.1, -0.1, 0.5, -0.4, 0.05])  # squares 0, .01, .01, .25, .16, .0025
    got = CR.m2po(lr, np.zeros(6, np.int64), 0.04)
    # mean of all: 0.432/6 = 0.072 > 0.04; without 0.25: 0.1825/5 = 0.0365 <= 0.04
    assert got.tolist() == [False, False, False, True, False, False]
    assert not CR.m2po(lr * 0.1, np.zeros(6, np.int64), 0.04).any()
    two = CR.m2po(np.r_[lr, lr * 0.1], np.r_[np.zeros(6), np.ones(6)].astype(np.int64), 0.04)
    assert two.tolist() == got.tolist() + [False] * 6  # per step


def test_sequence_error_and_any_token_reject_whole_sequences():
    lr = np.array([0.1, -0.1, 1.0, 1.0, -12.0, 0.0])
    sidx = np.array([0, 0, 1, 1, 2, 2])
    # mean exp|lr|: 1.105, e = 2.718, (e^12 + 1) / 2
    assert CR.seq_error(lr, sidx, 3, 2.0).tolist() == [False, True, True]
    assert CR.any_token(lr, sidx, 3, 1e-4, 100.0).tolist() == [False, False, True]  # exp(-12) < 1e-4
    assert CR.any_token(lr, sidx, 3, 1e-4, 2.0).tolist() == [False, True, True]


# two sequences of 2 tokens; pi_theta 0.3, 0.5 | 0.1, 0.5 against mu 0.1, 0.5 | 0.4, 0.5; advantages +1, -2
TS4 = batch(logp=[LN(0.3), LN(0.5), LN(0.1), LN(0.5)], logp_old=[LN(0.3), LN(0.5), LN(0.1), LN(0.5)],
            logp_sampler=[LN(0.1), LN(0.5), LN(0.4), LN(0.5)], advantage=[1.0, 1.0, -2.0, -2.0], seq=[0, 0, 1, 1])


def test_whatif_rows_of_the_new_corrections_and_their_denominators():
    r = W.replay(TS4, W.WhatIf("dppo_tv", "sampler", tv_delta=0.15)).to_pylist()[0]
    assert r["token_frac"] == 0.5 and r["seq_frac"] == 1.0  # +0.2 with A > 0, -0.3 with A < 0
    assert r["mass_removed_pos"] == pytest.approx(3.0) and r["mass_removed_neg"] == pytest.approx(0.25 * 2)
    assert r["denominator_share"] == 1.0  # verl/SkyRL keep every token in the token-mean
    full, kept = 3 + 1 + 0.5 + 2, 1 + 2
    assert r["grad_scale"] == pytest.approx(kept / full)
    s = W.replay(TS4, W.WhatIf("seq_error", "sampler", error_threshold=2.1)).to_pylist()[0]
    # mean exp|log r|: (3 + 1) / 2 = 2 (kept), (4 + 1) / 2 = 2.5 (dropped)
    assert s["token_frac"] == 0.5 and s["seq_frac"] == 0.5 and s["denominator_share"] == 0.5  # NeMo-RL: kept only
    assert s["grad_scale"] == pytest.approx(((3 + 1) / 2) / (full / 4))
    o = W.replay(TS4, W.WhatIf("any_token", "sampler", outlier_low=0.3, outlier_high=100)).to_pylist()[0]
    assert o["seq_frac"] == 0.5 and o["denominator_share"] == 1.0  # ratio 0.25 < 0.3 rejects sequence 1
    m = W.replay(TS4, W.WhatIf("m2po", "sampler", tau=0.04)).to_pylist()[0]
    assert m["token_frac"] == pytest.approx(0.5)  # (ln 3)^2 and (ln 4)^2 both go before the mean is <= 0.04
    assert set(CR.DENOMINATORS) == set(W.METHODS)


# ---- DPPO against verl 0.9.1's own loss functions (core_algos.compute_policy_loss_dppo_tv / _kl) ----------


@pytest.fixture(scope="module")
def verl_dppo():
    pytest.importorskip("torch")
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    actor = pytest.importorskip("verl.workers.config.actor")
    return core, actor


@pytest.fixture(scope="module")
def demo_tokens():
    return TS.load("sample_logs/demo_k3_is")


@pytest.mark.parametrize("form,delta", [("tv", 0.2), ("tv", 0.05), ("kl", 0.05), ("kl", 0.01)])
@pytest.mark.parametrize("convention", ["sampler", "trainer"])
def test_dppo_masks_equal_verls_on_the_demo_run(verl_dppo, demo_tokens, form, delta, convention):
    """verl's pg_clipfrac is the share of masked tokens; on tokens with A != 0 (verl reads A = 0 as A < 0, which
    has no gradient either way) the counts are equal, step by step."""
    import torch

    core, actor = verl_dppo
    cfg = actor.ActorConfig(strategy="fsdp", clip_ratio=delta, clip_ratio_low=delta, clip_ratio_high=delta,
                            ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
    loss = core.compute_policy_loss_dppo_tv if form == "tv" else core.compute_policy_loss_dppo_kl
    ts = demo_tokens
    b = ts.logp_sampler if convention == "sampler" else ts.logp_old
    checked = 0
    for step, sl in list(ts.step_slices())[::17]:
        lp, lb, adv = (np.asarray(x[sl], np.float64) for x in (ts.logp, b, ts.advantage))
        keep = ts.mask[sl] & np.isfinite(lp) & np.isfinite(lb) & np.isfinite(adv) & (adv != 0)
        lp, lb, adv = lp[keep], lb[keep], adv[keep]
        fn = CR.dppo_tv if form == "tv" else CR.dppo_kl
        mine = int(fn(lp, lb, adv, delta, delta).sum())

        def t(x):
            return torch.tensor(x[None, :], dtype=torch.float64)

        _, metrics = loss(t(lb), t(lp), t(adv), torch.ones(1, len(lp), dtype=torch.float64), "token-mean", cfg)
        assert metrics["actor/pg_clipfrac"] * (len(lp) + 1e-8) == pytest.approx(mine, abs=1e-6), step
        checked += mine
    assert checked > 0  # the thresholds mask something on this run
