"""Parity detectors: the temperature fit on synthetic engines with a known temperature, offsets,
float noise (quiet), growth, and the demo pair (the engine samples at 1.2, the trainer scores at 1)."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest

import kldiag
from kldiag.diagnosis import parity as DP
from kldiag.format.schema import TOKEN_SCHEMA
from kldiag.mismatch import parity as P
from kldiag.mismatch import sample as SS
from kldiag.mismatch import tokenset as TS


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def engine_table(temperature=1.0, steps=6, groups=4, group_size=8, length=5, vocab=12, offset=0.0, noise=0.0,
                 growth=0.0, seed=0, with_group=True) -> pa.Table:
    """GRPO-like batches: each group shares a prompt; tokens sampled from softmax(z / T) of a random
    'model' whose logits depend on (step, group, prefix); the trainer scores softmax(z)."""
    rng = np.random.default_rng(seed)
    rows = {k: [] for k in ("step", "seq", "group", "pos", "token_id", "logp", "logp_old", "logp_sampler")}
    seq_id = 0
    for step in range(steps):
        for g in range(groups):
            for _ in range(group_size):
                prefix = ()
                for pos in range(length):
                    h = hash((step, g, prefix)) % (2**32)
                    z = np.random.default_rng(h).normal(0.0, 2.0, vocab)
                    lp_old = log_softmax(z)
                    lp_mu = log_softmax(z / temperature)
                    x = int(rng.choice(vocab, p=np.exp(lp_mu)))
                    extra = offset + growth * step + noise * rng.normal()
                    rows["step"].append(step), rows["seq"].append(seq_id), rows["pos"].append(pos)
                    rows["group"].append(step * 100 + g if with_group else None), rows["token_id"].append(x)
                    rows["logp_old"].append(lp_old[x]), rows["logp_sampler"].append(min(lp_mu[x] + extra, 0.0))
                    rows["logp"].append(lp_old[x] + 0.01 * rng.normal())
                    prefix = (*prefix, x)
                seq_id += 1
    n = len(rows["step"])
    cols = {f.name: pa.array(rows[f.name], f.type) if f.name in rows else None for f in TOKEN_SCHEMA}
    defaults = {"micro": 0, "iteration": 0, "rank": 0, "advantage": 0.0, "mask": True, "attempt": 0}
    arrays = [cols[f.name] if cols[f.name] is not None else
              pa.array([defaults.get(f.name)] * n, f.type) for f in TOKEN_SCHEMA]
    return pa.Table.from_arrays(arrays, schema=TOKEN_SCHEMA)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_fit_recovers_a_known_temperature(temperature):
    ts = TS.from_table(engine_table(temperature))
    rep = P.check(ts)
    assert rep.fit.method == "shared-context"
    assert rep.fit.implied_temperature == pytest.approx(temperature, rel=1e-6)
    assert rep.temperature and not rep.offset
    cause = DP.temperature_cause(rep, "fix")
    assert cause.to_dict()["implied_temperature"] == pytest.approx(temperature, rel=1e-6)
    assert cause.cause == "engine_temperature_mismatch"


def test_float_noise_at_temperature_one_is_quiet():
    ts = TS.from_table(engine_table(1.0, noise=1e-4))
    rep = P.check(ts)
    assert abs(rep.fit.implied_temperature - 1.0) < 1e-3
    assert not rep.temperature and not rep.offset and not rep.first_step_disagrees and not rep.growing
    assert DP.mismatch_cause(rep, None, "fix") is None
    assert DP.temperature_cause(rep, "fix") is None


def test_constant_offset_is_found_at_slope_one():
    rep = P.check(TS.from_table(engine_table(1.0, offset=-0.1)))
    assert rep.offset and not rep.temperature
    assert rep.fit.offset == pytest.approx(-0.1, abs=1e-3)
    cause = DP.mismatch_cause(rep, None, "fix")
    assert cause.cause == "engine_mismatch" and "constant offset" in cause.summary
    assert cause.onset == 0  # the first step already disagrees


def test_mismatch_growing_while_drift_does_not():
    rep = P.check(TS.from_table(engine_table(1.0, steps=12, noise=0.0, growth=-0.01, offset=-1e-4)))
    assert rep.growing, rep.growth
    assert "grows" in DP.mismatch_cause(rep, None, "fix").summary


def test_engine_noise_is_not_a_temperature(tmp_path):
    """i.i.d. engine logit noise, tokens drawn from mu: the slope falls below 1 as a temperature's would, but
    its residual is many times the slope's effect, so no temperature; a real one explains KL(mu||pi_old)."""
    from dataclasses import replace

    from kldiag.tools import truth as T

    cfg = P.ParityConfig()
    noisy = replace(T.small(T.SCENARIOS["engine_mismatch_jump"]), steps=60, mismatch_from=0)
    rep = P.check_run(T.make_run(tmp_path / "noise", noisy), cfg)
    assert rep.fit.slope < 1 - cfg.slope_tol and rep.fit.method == "shared-context"  # looks like T ~ 1.03
    assert rep.fit.explained < 0.5 and not rep.temperature and not rep.explains_mismatch
    assert DP.temperature_cause(rep, "fix") is None
    hot = replace(T.small(T.SCENARIOS["engine_temperature_0.7"]), steps=60)
    rep = P.check_run(T.make_run(tmp_path / "hot", hot), cfg)
    assert rep.temperature and rep.explains_mismatch and rep.fit.explained > 5 and rep.temperature_steps.all()
    assert rep.fit.implied_temperature == pytest.approx(0.7, rel=0.01)
    assert DP.mismatch_cause(rep, None, "fix") is None and DP.temperature_cause(rep, "fix").onset == 0


def test_pooled_fallback_without_groups_says_so():
    rep = P.check(TS.from_table(engine_table(1.3, with_group=False)))
    assert rep.fit.method == "pooled" and rep.fit.contexts == 0
    assert rep.temperature  # approximate, but the direction is right
    assert rep.fit.implied_temperature > 1.05
    assert "pooled" in DP.temperature_cause(rep, "fix").summary


def test_prefix_hash_separates_prefixes():
    seq = np.array([0, 0, 0, 1, 1, 1])
    pos = np.array([0, 1, 2, 0, 1, 2])
    tok = np.array([5, 6, 7, 5, 6, 8])
    h = P.prefix_hash(seq, pos, tok)
    assert h[0] == h[3] and h[1] == h[4] and h[2] == h[5]  # same prefixes (the token itself excluded)
    tok2 = np.array([5, 6, 7, 5, 9, 8])
    h2 = P.prefix_hash(seq, pos, tok2)
    assert h2[2] != h2[5]


def test_demo_pair_implied_temperature_is_the_engines():
    """sample_logs/demo_k3: the engine samples at 1.2 (run.json config.sampler_temperature), the trainer at 1."""
    from kldiag.diagnosis import diagnose

    run = "sample_logs/demo_k3"
    truth = kldiag.open_run(run).manifest.config["sampler_temperature"]
    out = diagnose(kldiag.analyze(run)).to_dict()
    temp = [c for c in out["causes"] if c["cause"] == "engine_temperature_mismatch"]
    assert len(temp) == 1
    assert isinstance(temp[0]["implied_temperature"], float)
    assert temp[0]["implied_temperature"] == pytest.approx(truth, abs=1e-4)
    # the temperature explains the KL(mu||pi_old) the built-in rule sees: its evidence, not a second cause
    assert [c["cause"] for c in out["causes"]].count("engine_mismatch") == 0
    assert temp[0]["evidence"]["explained_mismatch"]["mismatch_kl_mean"] > 0.01


def test_parity_causes_dicts_and_runs_without_sampler():
    found = {c["cause"]: c for c in DP.parity_causes("sample_logs/demo_k3_is")}
    assert math.isclose(found["engine_temperature_mismatch"]["implied_temperature"], 1.2, rel_tol=1e-4)
    assert DP.parity_causes("sample_logs/trl_grpo_tiny") == []  # no logp_sampler recorded: nothing to compare


@pytest.mark.parametrize("shuffled", [False, True])
def test_sample_thinned_equals_thin_of_its_tokens(shuffled):
    """Sample.thinned builds from the kept steps' rows only what thin(tokens()) gives: the same rows (first
    iterations among the whole sample's), order, values and stride."""
    rng = np.random.default_rng(4)
    n = 6000
    cols = {c: rng.integers(0, 50, n) for c in TS.INT_COLUMNS}
    cols["step"] = np.sort(rng.integers(0, 40, n))
    cols["seq"], cols["pos"] = rng.integers(0, 30, n), np.arange(n)
    cols["iteration"] = rng.integers(0, 3, n)  # reuse iterations: only each sequence's first is kept
    cols.update({c: rng.normal(-1.0, 1.0, n).astype(np.float32) for c in TS.FLOAT_COLUMNS})
    cols["mask"], cols["old_valid"] = rng.random(n) < 0.9, rng.random(n) < 0.8
    if shuffled:
        order = rng.permutation(n)
        cols = {c: v[order] for c, v in cols.items()}
    for all_iterations in (False, True):
        for max_tokens in (n * 2, 1500, 300):
            got = SS.Sample(cols, 2, {"run": "x"}).thinned(max_tokens, all_iterations)
            want = TS.thin(SS.Sample(cols, 2, {"run": "x"}).tokens(all_iterations), max_tokens)
            assert got.step_stride == want.step_stride and got.meta == want.meta and len(got) == len(want)
            for f in ("step", "seq", "pos", "iteration", "logp", "logp_old", "logp_sampler", "mask", "has_old"):
                np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)


@pytest.mark.parametrize("stride", [1, 3, 4, 64])
def test_sample_reducer_keeps_every_stride_th_step(stride):
    """The shared sample keeps exactly the rows of steps step % stride == 0 (a bit test for a power of two)."""
    n = 500
    step = np.repeat(np.arange(-5, 45), 10)
    batch = TS._fill(pa.record_batch({"step": pa.array(step), "seq": pa.array(np.arange(n)),
                                      "logp": pa.array(np.linspace(-3, 0, n, dtype=np.float32))}))
    red, state = SS.SampleReducer(stride=stride), []
    red.add(state, batch)
    got = red.finish(state, 0)
    keep = step % stride == 0
    np.testing.assert_array_equal(got["step"], step[keep])
    np.testing.assert_array_equal(got["logp"], np.linspace(-3, 0, n, dtype=np.float32)[keep])
    red.add(state := [], batch.filter(pa.array(step % 64 == 1)))  # no kept row: nothing added
    assert stride == 1 or state == []


def test_demean_of_sparse_context_ids_warns_nothing():
    """Context ids used as bincount indices leave unused ids with a count of 0: their 0/0 is never read,
    and no "invalid value encountered in divide" reaches the user (the demo printed one)."""
    from kldiag.mismatch import parity

    ids = np.array([7, 7, 40, 40, 40, 3])
    x = np.array([1.0, 3.0, 2.0, 4.0, 6.0, 5.0])
    with np.errstate(all="raise"):
        (got,) = parity._demean(ids, x)
    np.testing.assert_allclose(got, [-1.0, 1.0, -2.0, 0.0, 2.0, 0.0])
