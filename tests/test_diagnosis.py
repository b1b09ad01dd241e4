"""Episodes, causes, fixes and the verdict on synthetic runs with known truth."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings

import numpy as np
import pytest

import kldiag
from kldiag.analysis.rules import episodes as EP
from kldiag.cli import main
from kldiag.diagnosis import CAUSE_NAMES, Cause, diagnose
from kldiag.diagnosis import causes as C
from kldiag.diagnosis.detectors import BUILTIN
from kldiag.format import Manifest, open_run, write_manifest
from kldiag.frameworks import family, fix_for
from kldiag.frameworks import plain as plain_fw
from kldiag.frameworks import trl as trl_fw
from kldiag.tools.synth import SynthConfig, make_run

SMALL = {"seqs_per_step": 8, "seq_len": (8, 24), "vocab_size": 32}


def _analyze(path):
    return kldiag.analyze(path, kldiag.AnalysisConfig(use_cache=False))


def _set_trainer(path, name: str) -> None:
    m = open_run(path).manifest
    write_manifest(path, dataclasses.replace(m, trainer={"name": name}))


def test_healthy_run_is_quiet(tmp_path):
    make_run(tmp_path, SynthConfig(steps=40, **SMALL))
    dg = diagnose(_analyze(tmp_path))
    assert dg.verdict == "healthy" and dg.causes == [] and dg.episodes == []


def test_long_blowup_is_one_episode_with_its_onset(tmp_path):
    make_run(tmp_path, SynthConfig(steps=200, blowup_step=120, blowup_frac=0.02, **SMALL))
    a = _analyze(tmp_path)
    dg = diagnose(a)
    share = a.steps.column("blame_share").to_numpy()
    assert (np.nan_to_num(share) > 0.5).sum() > 50  # the old per-step alerts: one row per step
    kinds = [e.kind for e in dg.episodes]
    assert kinds.count("blowup") == 1 and kinds.count("blame_share") == 1 and len(dg.episodes) <= 4
    blow = next(e for e in dg.episodes if e.kind == "blowup")
    assert (blow.start, blow.end) == (120, None) and blow.severity == "critical" and blow.peak_value > 100
    assert blow.evidence["tokens"] and all(t["step"] >= 120 for t in blow.evidence["tokens"])
    assert a.alerts.num_rows == len(dg.episodes)
    assert dg.verdict == "unstable" and dg.causes[0].cause == "k3_weight_blowup" and dg.causes[0].onset == 120
    assert dg.causes[0].evidence["peak"] > 100 and dg.causes[0].evidence["weight_k3_is_abs_max_at_peak"] < 100


def test_recovery_and_relapse_are_two_episodes(tmp_path):
    healthy, blown = SynthConfig(steps=60, **SMALL), SynthConfig(steps=60, blowup_step=0, blowup_frac=0.1, **SMALL)
    make_run(tmp_path, healthy, steps=range(0, 10))
    for cfg, steps in ((blown, range(10, 15)), (healthy, range(15, 20)), (blown, range(20, 22)),
                       (healthy, range(22, 40)), (blown, range(40, 45)), (healthy, range(45, 60))):
        make_run(tmp_path, cfg, steps=steps, manifest=False)
    dg = diagnose(_analyze(tmp_path))
    blow = [(e.start, e.end, e.steps) for e in dg.episodes if e.kind == "blowup"]
    assert blow == [(10, 21, 7), (40, 44, 5)]  # a 5-step pause is not a recovery; 18 quiet steps are
    assert dg.causes[0].cause == "k3_weight_blowup" and dg.causes[0].onset == 10


def test_persistence_rule():
    one = np.zeros(2000, bool)
    one[700] = True
    assert not EP.sustained(one).any()  # an isolated outlier
    burst = one.copy()
    burst[[701, 703]] = True  # 3 of 5 consecutive steps
    assert EP.sustained(burst)[[700, 701, 703]].all()
    sparse = np.zeros(300, bool)
    sparse[[150, 151, 165, 180, 197, 201]] = True  # a rare event that keeps coming back: 6 of 100 steps
    assert EP.sustained(sparse)[150] and not EP.sustained(sparse[:166])[150]  # 3 in 16 steps of 166: 2%
    assert EP.sustained(np.array([True, True])).all() and not EP.sustained(np.array([False, True])).any()


def test_an_isolated_outlier_step_is_a_note(tmp_path):
    healthy = SynthConfig(steps=60, **SMALL)
    blown = SynthConfig(steps=60, blowup_step=0, blowup_frac=0.1, **SMALL)
    make_run(tmp_path, healthy, steps=range(0, 30))
    make_run(tmp_path, blown, steps=range(30, 31), manifest=False)  # one step: weights far past 100
    make_run(tmp_path, healthy, steps=range(31, 60), manifest=False)
    dg = diagnose(_analyze(tmp_path))
    (blow,) = [e for e in dg.episodes if e.kind == "blowup"]
    assert (blow.start, blow.end, blow.severity) == (30, 30, "info") and "isolated" in blow.message
    assert blow.peak_value > 100 and blow.evidence["tokens"]  # the note keeps its evidence
    assert dg.verdict == "healthy" and dg.causes == []
    assert all(e.severity == "info" for e in dg.episodes)
    make_run(tmp_path, blown, steps=range(40, 43), manifest=False)  # three steps in a row: sustained
    dg = diagnose(_analyze(tmp_path))
    blow = [(e.start, e.end, e.severity) for e in dg.episodes if e.kind == "blowup"]
    assert dg.verdict == "unstable" and blow == [(30, 42, "critical")]  # a 9-step pause is no recovery
    # 4 blow-up steps of this 60-step run recur (over 5% of its steps): step 30 is no longer isolated
    assert [(c.cause, c.onset) for c in dg.causes] == [("k3_weight_blowup", 30)]


def test_numerical_fault_names_where(tmp_path):
    make_run(tmp_path, SynthConfig(steps=20, nonfinite=((5, "logp_ref"),), positive=(9,), **SMALL))
    dg = diagnose(_analyze(tmp_path))
    kinds = {(e.kind, e.start, e.end) for e in dg.episodes}
    assert ("nonfinite", 5, 5) in kinds and ("invalid", 9, 9) in kinds
    (fault,) = [c for c in dg.causes if c.cause == "numerical_fault"]
    assert fault.onset == 5 and fault.severity == "critical" and dg.verdict == "unstable"
    assert fault.evidence["nonfinite_tokens"] == 1 and fault.evidence["invalid_tokens"] == 1
    assert "logp_ref" in fault.summary and fault.evidence["first"]["step"] == 5


def test_engine_mismatch_and_trl_fix(tmp_path):
    make_run(tmp_path, SynthConfig(steps=20, mismatch_scale=0.5, **SMALL))
    _set_trainer(tmp_path, "trl")
    dg = diagnose(_analyze(tmp_path))
    (m,) = [c for c in dg.causes if c.cause == "engine_mismatch"]
    assert m.onset == 0 and m.evidence["token_mult_prob_error_max"] > 1.05 and dg.verdict == "warning"
    assert m.severity == "warning" and m.evidence["dominates_drift"]
    assert "vllm_importance_sampling_correction" in m.fix


def test_offpolicy_drift_on_a_k3_is_run(tmp_path):
    make_run(tmp_path, SynthConfig(steps=20, drift_scale=2.0, estimator="k3_is", **SMALL))
    dg = diagnose(_analyze(tmp_path))
    (d,) = [c for c in dg.causes if c.cause == "offpolicy_drift"]
    assert d.onset == 0 and d.evidence["rho_ess_min"] < 0.3
    assert not [c for c in dg.causes if c.cause == "k3_weight_blowup"]  # the loss is k3_is


def test_clamp_dead_zone_only_for_clamping_trainers(tmp_path):
    make_run(tmp_path, SynthConfig(steps=20, blowup_step=5, blowup_frac=0.05, **SMALL))
    assert "clamp_dead_zone" not in {c.cause for c in diagnose(_analyze(tmp_path)).causes}
    _set_trainer(tmp_path, "verl")
    dg = diagnose(_analyze(tmp_path))
    (cz,) = [c for c in dg.causes if c.cause == "clamp_dead_zone"]
    assert cz.onset == 5 and "kl_loss_type=k3+" in cz.fix
    assert "kl_loss_type=k3+" in next(c for c in dg.causes if c.cause == "k3_weight_blowup").fix


def test_entropy_collapse(tmp_path):
    rng = np.random.default_rng(0)
    with kldiag.Recorder(tmp_path, beta=0.04, estimator="k3", rotate_seconds=None) as rec:
        for step in range(30):
            scale = 0.8 if step < 15 else 0.001
            logp = -rng.exponential(scale, (8, 16)).astype(np.float32)
            rec.record(step=step, logp=logp, logp_ref=logp, entropy=np.full_like(logp, 2.0 if step < 15 else 0.01))
    dg = diagnose(_analyze(tmp_path))
    (e,) = [c for c in dg.causes if c.cause == "entropy_collapse"]
    assert e.onset == 15 and e.evidence["confident_share_last"] > 0.9


def test_fixes_name_real_grpoconfig_fields():
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    named = set()
    assert set(plain_fw.FIXES) == set(CAUSE_NAMES)  # every cause has a fix for a plain torch loop
    for cause, text in trl_fw.FIXES.items():
        assert cause in CAUSE_NAMES
        named |= set(re.findall(r"`(?:GRPOConfig\()?([a-z_]+)(?:=[^`]*)?\)?`", text))
    assert named and named <= fields, named - fields
    assert family(Manifest(trainer={"name": "NeMo-RL"})) == "nemo_rl" and family(Manifest()) == "plain"
    assert fix_for("k3_weight_blowup", Manifest(trainer={"name": "slime"})).startswith("Add `--use-unbiased-kl`")


def test_registered_detectors_replace_and_fail_safely(tmp_path):
    make_run(tmp_path, SynthConfig(steps=10, mismatch_scale=0.5, **SMALL))
    a = _analyze(tmp_path)

    def parity(analysis):  # as kldiag/mismatch/parity.py would: one argument
        return [Cause("engine_mismatch", 3, "warning", {"source": "parity"}, "fix it",
                      extra={"implied_temperature": 0.7})]

    def broken(analysis, ctx):
        raise RuntimeError("boom")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        builtins = [d for d in BUILTIN if d.__module__ == C.__name__]  # parity.py's left out
        dg = diagnose(a, detectors=[*builtins, parity, broken])
    (m,) = [c for c in dg.causes if c.cause == "engine_mismatch"]
    assert m.evidence == {"source": "parity"} and m.to_dict()["implied_temperature"] == 0.7
    assert any("broken" in str(w.message) for w in caught)


def test_rule_names_and_spans():
    assert EP.parse_kinds("blowup,nonfinite") == ("blowup", "nonfinite", "invalid")
    assert EP.parse_kinds("all") == EP.KINDS
    with pytest.raises(ValueError, match="choose from"):
        EP.parse_kinds("blowupp")
    fire = np.array([0, 1, 1, 0, 1, 0, 0, 0, 1, 1], bool)
    assert EP.spans(fire, 2) == [(1, 4), (8, 9)]


def test_analyze_json_contract(tmp_path, capsys):
    make_run(tmp_path, SynthConfig(steps=30, blowup_step=20, blowup_frac=0.02, **SMALL))
    assert main(["analyze", str(tmp_path), "--json", "--no-cache"]) == 0
    out = json.loads(capsys.readouterr().out)
    dg = out["diagnosis"]
    assert dg["verdict"] == "unstable"
    for c in dg["causes"]:
        assert {"cause", "onset", "severity", "evidence", "fix"} <= set(c) and c["cause"] in CAUSE_NAMES
    for e in out["alerts"]:
        assert {"kind", "start", "end", "peak_step", "peak_value", "severity", "message"} <= set(e)
    assert main(["analyze", str(tmp_path), "--no-cache"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[1].startswith("verdict: UNSTABLE: k3_weight_blowup from step 20")
    assert "fix: " in text


def test_side_scan_rides_along_is_incremental_and_cached(tmp_path, monkeypatch):
    """The scan is a reducer: read in the analysis's pass, only new parts later, none once cached."""
    from kldiag.analysis.reducers import scan as S
    from kldiag.analysis.runtime import runner

    red = [S.ScanReducer()]
    make_run(tmp_path, SynthConfig(steps=6, **SMALL), steps=range(0, 3))
    opened = runner.opened_parts
    first = kldiag.analyze(tmp_path, kldiag.AnalysisConfig(), red)
    assert runner.opened_parts - opened == 1 and "scan" in first.reduced
    make_run(tmp_path, SynthConfig(steps=6, **SMALL), steps=range(3, 6), manifest=False)
    calls = []
    real = S.batch_sums
    monkeypatch.setattr(S, "batch_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    grown = kldiag.analyze(tmp_path, kldiag.AnalysisConfig(), red)
    assert grown.files_new == 1 and len(calls) == 1  # only the new part is read
    again = kldiag.analyze(tmp_path, kldiag.AnalysisConfig(), red)
    assert again.files_new == 0 and len(calls) == 1  # the run's cache answers: no part is read
    fresh = kldiag.analyze(tmp_path, kldiag.AnalysisConfig(use_cache=False), red)
    t, u = S.table(again.reduced["scan"]), S.table(fresh.reduced["scan"])
    assert list(t["step"]) == list(range(6)) and np.allclose(t["confident_share"], u["confident_share"])
    assert np.allclose(t["entropy_mean"], u["entropy_mean"])
    assert S.scan_of(first)["step"].tolist() == list(range(3))  # from the analysis, no read


def test_scan_kernel_equals_the_numpy_formula():
    """The side scan's compiled pass equals its definition in numpy (NaN, nulls, masks, split steps)."""
    import math

    import pyarrow as pa

    from kldiag.analysis.reducers import scan as S

    rng = np.random.default_rng(3)
    n = 5000
    step = np.sort(rng.integers(0, 7, n))
    step[100:120] = 2  # a step split in two runs
    cols = {name: -rng.exponential(1.0, n).astype(np.float32) for name in ("logp", "logp_old", "logp_sampler")}
    cols["entropy"] = rng.exponential(1.0, n).astype(np.float32)
    for name, frac in (("logp_old", 0.1), ("logp_sampler", 0.2), ("entropy", 0.05)):
        cols[name][rng.random(n) < frac] = np.nan
    cols["logp"][:50] = -1e-4  # confident tokens
    nulls = rng.random(n) < 0.1
    batch = pa.record_batch({"step": pa.array(step), "mask": pa.array(rng.random(n) < 0.8, mask=nulls),
                             **{k: pa.array(v, mask=rng.random(n) < 0.05) for k, v in cols.items()}})
    got = S.batch_sums(batch, 0.99)

    def f64(name):
        return batch.column(name).to_numpy(zero_copy_only=False).astype(np.float64)

    keep = batch.column("mask").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    logp, old, smp, ent = f64("logp"), f64("logp_old"), f64("logp_sampler"), f64("entropy")
    old = np.where(np.isnan(old), logp, old)
    with np.errstate(invalid="ignore", over="ignore"):
        tmpe = np.exp(np.abs(old - smp))
    has_ent, has_smp = keep & np.isfinite(ent), keep & np.isfinite(tmpe)
    uniq, inv = np.unique(step, return_inverse=True)  # the previous implementation, in numpy
    want = np.stack([np.bincount(inv, weights=w, minlength=len(uniq)) for w in (
        keep, has_ent, np.where(has_ent, ent, 0.0), keep & (logp > math.log(0.99)), has_smp,
        np.where(has_smp, tmpe, 0.0))], axis=1)
    assert sorted(got) == uniq.tolist()
    for k, s in enumerate(uniq.tolist()):
        np.testing.assert_allclose(got[s], want[k], rtol=1e-12)


def test_k3_summary_never_says_below_the_limit_above_it():
    """Issue 47 edge 5: a max of 254 read "below the blow-up limit 100 so far" when it passed the limit on steps
    too few in a row to be sustained."""
    import numpy as np

    from kldiag.diagnosis.causes import _k3_summary
    from kldiag.diagnosis.types import DiagnosisConfig

    cfg, ev = DiagnosisConfig(), {"blame_share_max": 0.74, "weight_k3_is_abs_max_at_peak": 1.5}
    no_fire = np.zeros(3, bool)
    text = _k3_summary({"step": np.arange(3)}, cfg, no_fire, 1, 254.0, 2, ev)
    assert "below" not in text and "above the blow-up limit 100 on isolated steps" in text
    assert "below the blow-up limit 100 so far" in _k3_summary({"step": np.arange(3)}, cfg, no_fire, 1, 50.0, 2, ev)
