"""engine_truncated_sampling on tiny-model runs sampled with top-k / top-p (kldiag/tools/sampling_runs.py):
named at step 0 with the direction (log mu above log pi_old, growing with the entropy) and the trainer's fix;
quiet when the trainer replays the engine's mask, and on a temperature mismatch (the truth suite's)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.diagnosis import diagnose
from kldiag.diagnosis import parity as DP
from kldiag.diagnosis import truncation as TR
from kldiag.diagnosis.core import reducers
from kldiag.tools import sampling_runs as SR
from kldiag.tools import truth as T

STEPS = 20  # half the tool's default: the tests stay fast


@pytest.fixture(scope="module")
def diagnosed(tmp_path_factory):
    """name -> (run dir, Diagnosis) for the runs the tests judge."""
    runs = {"top_k8_verl": replace(SR.RUNS["top_k8"], trainer="verl"),
            "top_p0.9_trl": replace(SR.RUNS["top_p0.9"], trainer="trl"),
            "top_k8_replayed": SR.RUNS["top_k8_replayed"], "top_p0.9_replayed": SR.RUNS["top_p0.9_replayed"],
            "top_k8_pooled": replace(SR.RUNS["top_k8"], group_ids=False)}
    out = {}
    for name, run in runs.items():
        path = SR.make_run(tmp_path_factory.mktemp(name) / "run", replace(run, steps=STEPS))
        out[name] = (path, diagnose(analyze(path, AnalysisConfig(), reducers())))
    return out


def _only_truncation(dg):
    causes = {c.cause: c for c in dg.causes}
    assert set(causes) == {TR.CAUSE}, sorted(causes)
    return causes[TR.CAUSE]


def test_keep_mask_follows_vllm_semantics():
    torch = pytest.importorskip("torch")
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert SR.keep_mask(z, top_k=2).tolist() == [[True, True, False, False]]
    assert SR.keep_mask(z, top_p=0.8).tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    assert SR.keep_mask(z, top_p=0.81).tolist() == [[True, True, True, False]]
    assert SR.keep_mask(z, top_k=3, top_p=0.6).tolist() == [[True, True, False, False]]  # top-p after top-k
    assert SR.keep_mask(z, min_p=0.2).tolist() == [[True, True, True, False]]  # p >= 0.2 * 0.5


def test_top_k_run_is_named_with_direction_and_verl_fix(diagnosed):
    c = _only_truncation(diagnosed["top_k8_verl"][1])
    ev = c.evidence
    assert c.onset == 0 and c.severity == "warning" and diagnosed["top_k8_verl"][1].verdict == "warning"
    assert ev["offset_mean"] > 0.1 and ev["share_positive"] > 0.95  # log mu above log pi_old
    assert ev["kept_mass_mean"] < 0.9 and ev["kept_mass_mean"] + 5 * ev["kept_mass_se"] < 1.0
    assert ev["x"] == "entropy" and ev["slope"] > 0 and ev["corr"] > 0.5
    offsets = [b["offset"] for b in ev["by_x"]]
    assert offsets == sorted(offsets) and offsets[0] < 0.1 * offsets[-1]  # grows with the entropy from ~0
    assert ev["manifest_sampling"]["top_k"] == 8 and ev["manifest_sampling"]["not_replayed"] == ["top_k"]
    assert "actor_rollout_ref.rollout.top_k=-1" in c.fix
    assert c.extra["kept_mass"] == pytest.approx(ev["kept_mass_mean"])


def test_top_p_run_is_named_within_its_bound_and_trl_fix(diagnosed):
    c = _only_truncation(diagnosed["top_p0.9_trl"][1])
    ev = c.evidence
    assert c.onset == 0 and ev["offset_mean"] > 0.01 and ev["corr"] > 0.5
    # top-p keeps at least p of the mass: 0 <= log mu - log pi_old <= -log p on every token
    assert all(0.0 <= b["offset"] <= -math.log(0.9) + 1e-3 for b in ev["by_x"])
    assert ev["kept_mass_mean"] >= 0.9 - 1e-3
    assert "GRPOConfig(top_k=0, top_p=1.0, min_p=None)" in c.fix
    assert ev["manifest_sampling"]["source"]["top_p"] == "GRPOConfig.top_p"


def test_replayed_mask_runs_are_healthy(diagnosed):
    for name in ("top_k8_replayed", "top_p0.9_replayed"):
        dg = diagnosed[name][1]
        assert dg.verdict == "healthy" and not dg.causes, (name, [c.cause for c in dg.causes])


def test_pooled_temperature_is_absorbed(diagnosed):
    """Without group ids no context is shared: the pooled slope reads the entropy-dependent offset as a
    temperature > 1 (the misdiagnosis truncation replaces)."""
    path, dg = diagnosed["top_k8_pooled"]
    c = _only_truncation(dg)
    assert c.onset == 0
    alone = {d["cause"]: d for d in DP.parity_causes(path)}  # the parity causes, no truncation detector
    assert "engine_temperature_mismatch" in alone and alone["engine_temperature_mismatch"]["implied_temperature"] > 1


def test_truth_temperature_mismatch_stays_a_temperature(tmp_path):
    sc = T.small(T.SCENARIOS["engine_temperature_0.7"])
    dg = T.run_and_diagnose(sc, tmp_path / "run")
    names = [c.cause for c in dg.causes]
    assert "engine_temperature_mismatch" in names and TR.CAUSE not in names, names


def test_check_on_exact_truncated_tokens():
    """check() on hand-made tokens: every context keeps Z of pi_old's mass, Z falling with the entropy."""
    rng = np.random.default_rng(0)
    n, steps = 4000, 10
    ent = rng.uniform(0.0, 3.0, n)
    kept = np.exp(-0.15 * ent)  # -log Z = 0.15 * entropy
    logp_old = -rng.uniform(0.5, 3.0, n)  # log mu = log pi_old - log Z stays below 0
    from kldiag.mismatch.tokenset import TokenSet

    i64 = np.arange(n)
    ts = TokenSet(step=np.sort(i64 % steps), seq=i64 // 8, group=np.full(n, -1), pos=i64 % 8, token_id=i64 % 64,
                  iteration=np.zeros(n, np.int64), micro=np.zeros(n, np.int64), rank=np.zeros(n, np.int64),
                  logp=logp_old, logp_old=logp_old, logp_ref=np.full(n, np.nan), logp_sampler=logp_old - np.log(kept),
                  advantage=np.zeros(n), mask=np.ones(n, bool), entropy=ent, has_old=np.ones(n, bool))
    rep = TR.check(ts)
    assert rep.fires and rep.onset == 0
    assert rep.slope == pytest.approx(0.15, rel=1e-6) and rep.intercept == pytest.approx(0.0, abs=1e-9)
    assert rep.kept_mass == pytest.approx(kept.mean(), rel=1e-9)
    healthy = TR.check(TokenSet(**{**ts.__dict__, "logp_sampler": logp_old}))
    assert not healthy.fires and not healthy.step_fire.any()
    masked = TR.check(TokenSet(**{**ts.__dict__, "mask": np.zeros(n, bool)}))
    assert masked is None  # tokens outside the loss mask never enter


def test_without_entropies_the_surprisal_stands_in(diagnosed):
    from kldiag.mismatch import tokenset as TS

    for name, fires in (("top_k8_verl", True), ("top_k8_replayed", False)):
        ts = TS.load(diagnosed[name][0])
        rep = TR.check(TS.TokenSet(**{**ts.__dict__, "entropy": np.full(len(ts), np.nan)}))
        assert rep.x_name == "-logp_old" and rep.fires is fires, name
        assert (rep.onset == 0) if fires else rep.onset is None


def test_cli_json_and_fail_on(diagnosed, tmp_path, capsys):
    import json

    from kldiag.cli import main

    path = str(diagnosed["top_k8_verl"][0])
    assert main(["analyze", path, "--json"]) == 0
    causes = json.loads(capsys.readouterr().out)["diagnosis"]["causes"]
    assert [(c["cause"], c["onset"]) for c in causes] == [(TR.CAUSE, 0)] and causes[0]["kept_mass"] < 1
    assert main(["report", path, "-o", str(tmp_path / "r.html"), "--fail-on", TR.CAUSE]) == 1
    ok = str(diagnosed["top_k8_replayed"][0])
    assert main(["report", ok, "-o", str(tmp_path / "ok.html"), "--fail-on", TR.CAUSE]) == 0
