"""Root causes of a trainer/engine mismatch, each on a run of a real tiny torch model (kldiag/tools/mismatch_runs.py):
the engine is the same model with one defect, the run is recorded with kldiag.Recorder, analysed and diagnosed, and
the diagnosis must name exactly that defect's cause (the healthy run none) with its evidence."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.diagnosis import CAUSE_NAMES, diagnose
from kldiag.diagnosis.core import reducers
from kldiag.frameworks import plain
from kldiag.mismatch import signatures as S
from kldiag.mismatch import tokenset as TS
from kldiag.tools import mismatch_runs as M

ROOTS = ("engine_raw_logprobs", "engine_wrong_token", "engine_precision", "engine_stale_weights", "engine_async_lag")


def _diagnosed(tmp_path_factory, run: M.MismatchRun):
    path = M.make_run(tmp_path_factory.mktemp(run.name) / "run", run)
    analysis = analyze(path, AnalysisConfig(), reducers())
    return analysis, diagnose(analysis)


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory):
    cache: dict = {}

    def get(name: str, **changes):
        key = (name, tuple(sorted(changes.items())))
        if key not in cache:
            cache[key] = _diagnosed(tmp_path_factory, replace(M.RUNS[name], **changes))
        return cache[key]
    return get


def _only(dg, name: str):
    named = [c.cause for c in dg.causes]
    assert named == [name], f"expected exactly {name}, got {named}"
    cause = dg.causes[0]
    json.dumps(cause.to_dict())  # the JSON contract holds
    assert cause.fix and cause.summary
    return cause


def test_root_causes_are_public_names_with_a_fix_for_every_trainer():
    assert set(ROOTS) <= set(CAUSE_NAMES)
    assert set(ROOTS) <= set(plain.FIXES)


def test_healthy_run_stays_quiet(diagnosed):
    analysis, dg = diagnosed("healthy")
    assert dg.verdict == "healthy" and dg.causes == []
    sig = S.report_for(analysis)
    assert sig.root is None and sig.precision["mismatch_abs_mean"] < 1e-6
    assert sig.lag["identified"] and set(sig.lag["per_step"][1:]) == {0}  # log mu(t) = log pi_old(t): no lag


def test_processed_temperature_stays_a_temperature(diagnosed):
    analysis, dg = diagnosed("temperature")
    cause = _only(dg, "engine_temperature_mismatch")
    assert cause.extra["implied_temperature"] == pytest.approx(1.25, rel=1e-5) and cause.onset == 0
    cal = S.report_for(analysis).calibration  # tokens follow the mu the engine reports
    assert cal["mean_log_mu_over_old"] > 5 * cal["se"] and cal["mean_old_over_mu"] == pytest.approx(1, abs=0.01)


def test_raw_logprobs_are_told_from_a_temperature(diagnosed):
    _, dg = diagnosed("raw_logprobs")
    cause = _only(dg, "engine_raw_logprobs")
    assert cause.extra["sampling_temperature"] == pytest.approx(1.25, rel=1e-5) and cause.onset == 0
    assert cause.severity == "warning" and dg.verdict == "warning"
    cal = cause.evidence["calibration"]  # tokens follow pi_old: the ratio mu/pi_old averages 1, pi_old/mu does not
    assert cal["mean_log_mu_over_old"] < -5 * cal["se"]
    assert cal["mean_mu_over_old"] == pytest.approx(1, abs=0.01) and cal["mean_old_over_mu"] > 1.03
    assert "explained_mismatch" in cause.evidence


def test_shifted_gather_is_a_wrong_token(diagnosed):
    _, dg = diagnosed("shifted_gather")
    cause = _only(dg, "engine_wrong_token")
    sh = cause.evidence["shift"]
    assert cause.extra["shift"] == 1 and sh["ratio"] < 1e-3 and sh["aligned_abs"] > 0.5 and cause.onset == 0
    _, dg = diagnosed("shifted_gather", shift=-1)
    assert _only(dg, "engine_wrong_token").extra["shift"] == -1


def test_bf16_engine_is_precision(diagnosed):
    _, dg = diagnosed("bf16")
    cause = _only(dg, "engine_precision")
    pr, al = cause.evidence["precision"], cause.evidence["alignment"]
    assert all(pr["checks"].values()) and pr["mismatch_abs_mean"] < 0.15
    assert 0.5 <= pr["quarter_ratio"] <= 2  # flat over the steps
    assert pr["gap_slope_in_1_minus_p"] > 0 and abs(pr["gap_at_p1"]) < 0.25 * pr["mismatch_abs_mean"]  # ~ (1 - p)
    assert abs(al["corr_with_drift"]) < 0.3  # not along the policy's drift
    assert cause.onset == 0 and cause.severity == "info"  # below the KL rule: a note, the verdict stays healthy
    assert dg.verdict == "healthy"


def test_bf16_below_the_mismatch_rules_names_nothing(diagnosed):
    """With smaller logits bf16 rounds less (mean |gap| ~0.04 nats at an offset of 24): the signature is there, but
    neither the KL rule nor NeMo-RL's token_mult_prob_error > 1.05 fires, so there is no mismatch to explain."""
    analysis, dg = diagnosed("bf16", logit_offset=24.0)
    sig = S.report_for(analysis)
    assert dg.causes == [] and dg.verdict == "healthy"
    assert sig.root == "engine_precision" and sig.precision["mismatch_abs_mean"] < 0.05


def test_stale_weights_give_the_sync_period(diagnosed):
    _, dg = diagnosed("stale_sync")
    cause = _only(dg, "engine_stale_weights")
    sy = cause.evidence["sync"]
    assert cause.extra["sync_period"] == 5 and sy["method"] == "lag resets" and cause.onset == 1
    assert sy["sync_steps"][:4] == [5, 10, 15, 20] and sy["mismatch_at_sync"] < 1e-6 < sy["mismatch_between"]
    assert cause.evidence["lag_per_step"][1:11] == [1, 2, 3, 4, 0, 1, 2, 3, 4, 0]  # k steps old, then synced


def test_stale_weights_without_prompt_ids_from_the_drops(diagnosed):
    _, dg = diagnosed("stale_sync_no_prompt_ids")
    cause = _only(dg, "engine_stale_weights")
    sy = cause.evidence["sync"]
    assert cause.extra["sync_period"] == 5 and sy["method"] == "mismatch drops" and sy["rise_corr"] > 0.8


def test_async_lag_is_measured(diagnosed):
    _, dg = diagnosed("async_lag")
    cause = _only(dg, "engine_async_lag")
    lag = cause.evidence["lag"]
    assert cause.extra["lag"] == 3 and lag["lag_share"] >= 0.9 and cause.onset == 1
    assert lag["matched_abs"] < 1e-5 < 0.1 < lag["aligned_abs"]  # log mu(t) = log pi_old(t - 3) exactly
    assert cause.evidence["lag_per_step"][:6] == [None, 1, 2, 3, 3, 3]  # the first steps sample the initial policy


def test_async_lag_without_prompt_ids_says_it_cannot_measure_it(diagnosed):
    _, dg = diagnosed("async_lag_no_prompt_ids")
    cause = _only(dg, "engine_async_lag")
    assert cause.extra["lag"] is None and "cannot be identified" in cause.summary
    assert cause.evidence["alignment"]["corr_with_drift"] > 0.3 and cause.evidence["first_step_mismatch_abs"] < 1e-6


def test_calibration_and_shift_on_known_arrays():
    """The two statistics on hand-made tokens: the sign says which distribution the tokens were drawn from, the shift
    which neighbour the sampler's log-prob belongs to."""
    rng = np.random.default_rng(0)
    z = rng.normal(0, 2, (4000, 12))
    hot = z / 1.3 - np.log(np.exp(z / 1.3).sum(1, keepdims=True))
    cold = z - np.log(np.exp(z).sum(1, keepdims=True))
    x = np.array([rng.choice(12, p=np.exp(r)) for r in hot])
    n = len(x)
    base = dict(step=np.zeros(n, int), seq=np.arange(n) // 8, group=np.zeros(n, int), pos=np.arange(n) % 8,
                token_id=x, iteration=np.zeros(n, int), micro=np.zeros(n, int), rank=np.zeros(n, int),
                logp=cold[np.arange(n), x], logp_ref=np.full(n, np.nan), advantage=np.zeros(n),
                mask=np.ones(n, bool), entropy=np.full(n, np.nan), has_old=np.ones(n, bool))
    at = np.arange(n), x
    processed = TS.TokenSet(**base, logp_old=cold[at], logp_sampler=hot[at])  # sampled from the reported mu
    raw = TS.TokenSet(**base, logp_old=hot[at], logp_sampler=cold[at])  # sampled from pi_old, mu reported raw
    assert S.calibration(processed)["mean_log_mu_over_old"] > 0 > S.calibration(raw)["mean_log_mu_over_old"]
    lp = hot[at]
    shifted = np.where(base["pos"] < 7, np.roll(lp, -1), lp)
    ts = TS.TokenSet(**base, logp_old=lp, logp_sampler=shifted)
    out = S.shift_scan(ts, np.array([0]), S.SignatureConfig())
    assert out["shift"] == 1 and out["ratio"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_every_run_with_other_seeds(diagnosed, seed):
    for name, run in M.RUNS.items():
        _, dg = diagnosed(name, seed=seed)
        assert [c.cause for c in dg.causes] == ([run.expect] if run.expect else []), (name, seed)


@pytest.mark.slow
@pytest.mark.parametrize("name, changes, key, value", [
    ("stale_sync", {"sync_every": 3}, "sync_period", 3), ("stale_sync", {"sync_every": 8}, "sync_period", 8),
    ("stale_sync_no_prompt_ids", {"sync_every": 8}, "sync_period", 8), ("async_lag", {"lag": 1}, "lag", 1),
    ("async_lag", {"lag": 6}, "lag", 6), ("raw_logprobs", {"temperature": 0.8}, "sampling_temperature", 0.8)])
def test_other_periods_lags_and_temperatures(diagnosed, name, changes, key, value):
    _, dg = diagnosed(name, **changes)
    assert _only(dg, M.RUNS[name].expect).extra[key] == pytest.approx(value, rel=1e-5)
