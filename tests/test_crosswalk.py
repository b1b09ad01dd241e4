"""kldiag.crosswalk: the API, the CLI's JSON contract (docs/crosswalk.md), settings, nulls with reasons,
and cross-checks of slime / NeMo-RL / OpenRLHF metrics against kldiag's other implementations."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kldiag
import kldiag.crosswalk as X
from kldiag.cli import main

DEMO = "sample_logs/demo_k3"


def test_callable_from_the_package_and_one_row_per_step():
    t = kldiag.crosswalk(DEMO, "nemo-rl")
    assert t.column("step").to_pylist() == list(range(200))
    assert t.schema.field("gen_kl_error").type == "double"


def test_cli_json_contract(capsys):
    assert main(["crosswalk", DEMO, "--framework", "verl", "--set", "rollout_is=token",
                 "--set", "rollout_rs=seq_mean_k3", "--set", "rollout_rs_threshold=0.01", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 200 and rows[0]["step"] == 0
    for key in ("rollout_corr/rollout_is_eff_sample_size", "rollout_corr/rollout_rs_seq_mean_k3_masked_fraction",
                "rollout_corr/k3_kl", "training/rollout_probs_diff_mean", "actor/kl_loss"):
        assert isinstance(rows[10][key], float), key


def test_cli_text_and_user_errors(capsys):
    assert main(["crosswalk", "sample_logs/trl_grpo_tiny"]) == 0  # the run's own framework: TRL
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["step", "kl"]
    assert "sampling/sampling_logp_difference/mean: null: the run has no logp_sampler" in out
    assert main(["crosswalk", DEMO, "-f", "verl", "--set", "rollout_iss=token"]) == 2
    assert "known: kl_loss_type" in capsys.readouterr().err
    assert main(["crosswalk", DEMO]) == 2  # the demo's trainer is none of the frameworks
    assert "--framework" in capsys.readouterr().err
    assert main(["crosswalk", DEMO, "-f", "megatron"]) == 2
    assert main(["crosswalk", DEMO, "-f", "verl", "--set", "rollout_rs=token_k9", "--set",
                 "rollout_rs_threshold=1"]) == 2


def test_nulls_say_why_in_json():
    rows = X.records(X.crosswalk("sample_logs/trl_grpo_tiny", "verl"))
    assert rows[0]["rollout_corr/kl"] is None
    assert "calculate_log_probs" in rows[0]["null_reasons"]["rollout_corr/kl"]
    assert isinstance(rows[0]["actor/kl_loss"], float)  # pi_ref was recorded


def test_settings_from_the_manifest_and_coercion():
    m = kldiag.open_run("sample_logs/trl_grpo_tiny").manifest
    s = X.parse_settings("trl", ["vllm_importance_sampling_clip_max=2", "vllm_importance_sampling_clip_min=null"], m)
    assert s.use_bias_correction_kl is True and s.importance_sampling_level == "token"  # from run.json
    assert s.vllm_importance_sampling_clip_max == 2 and s.vllm_importance_sampling_clip_min is None
    assert X.parse_settings("verl", {"rollout_is_threshold": "0.5_2.0"}).rollout_is_threshold == "0.5_2.0"


def test_nemo_token_mult_prob_error_equals_the_diagnosis_scan():
    from kldiag.analysis.reducers.scan import scan_of

    ref = scan_of(kldiag.analyze(DEMO))["token_mult_prob_error"]
    mine = np.array(X.crosswalk(DEMO, "nemo-rl").column("token_mult_prob_error").to_pylist())
    np.testing.assert_allclose(mine, ref, rtol=1e-9)  # NeMo-RL's masked_mean adds 1e-8 to the token count


def test_slime_kl_loss_equals_slime_semantics_module(tmp_path):
    from kldiag.analysis.core.slime_kl import trainer_kl

    run = kldiag.open_run(DEMO)
    for unbiased in (False, True):
        cfg = {"kl_loss_type": "low_var_kl", "use_unbiased_kl": unbiased}
        ref = trainer_kl(run, cfg).column("kl").to_pylist()
        mine = X.crosswalk(DEMO, "slime", **cfg).column("kl_loss").to_pylist()
        np.testing.assert_allclose(mine, ref, rtol=1e-9)


def test_openrlhf_vllm_kl_is_verls_rollout_corr_kl():
    """Both are the masked mean of log mu - log pi_old over the step's tokens (K1 of KL(mu||pi_old))."""
    a = X.crosswalk(DEMO, "openrlhf").column("vllm_kl").to_pylist()
    b = X.crosswalk(DEMO, "verl").column("rollout_corr/kl").to_pylist()
    np.testing.assert_allclose(a, b, rtol=1e-6)
    band = X.crosswalk(DEMO, "openrlhf", is_correction_threshold="0.9 1.1")
    assert max(band.column("is_filter_ratio").to_pylist()) > 0


@pytest.mark.parametrize("fw", list(X.FRAMEWORKS))
def test_every_framework_on_a_run_without_sampler(fw):
    t = X.crosswalk("sample_logs/trl_grpo_tiny", fw)
    assert t.num_rows > 0
    reasons = X.null_reasons(t)
    assert reasons and all("logp_sampler" in v or "logp_ref" in v or "not computed" in v for v in reasons.values())


def test_trl_sampling_metrics_skip_a_nan_sampler_token_not_the_step():
    """TRL (grpo_trainer.py, _generate_and_score_completions) drops tokens whose vLLM log-prob is NaN from
    sampling_logp_difference and gives them a ratio of exactly 1 (nan_to_num of the difference): one NaN
    leaves the step's metrics defined, equal to those with that token's sampler log-prob at pi_old."""
    from kldiag.crosswalk import trl as TX
    from kldiag.crosswalk.batch import StepBatch

    rng = np.random.default_rng(0)
    mask = np.ones((3, 5), bool)
    old = -rng.exponential(1.0, (3, 5))
    smp = old + rng.normal(0, 0.3, (3, 5))
    nan = smp.copy()
    nan[1, 2] = np.nan
    at_old = smp.copy()
    at_old[1, 2] = old[1, 2]

    def batch(sampler):
        return StepBatch(0, np.arange(3), mask, old, old, np.full((3, 5), np.nan), sampler, np.ones(3),
                         np.zeros(3, np.int64), np.zeros(3, np.int64))

    s = TX.Settings(vllm_importance_sampling_mode="token_truncate")
    got, why = TX.step_metrics(batch(nan), s)
    want, _ = TX.step_metrics(batch(at_old), s)
    assert "sampling/importance_sampling_ratio/mean" not in why
    for k in ("sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
              "sampling/importance_sampling_ratio/max"):
        assert got[k] == pytest.approx(want[k], rel=1e-12)
    delta = np.abs(old - smp)[mask & ~np.isnan(nan)]
    assert got["sampling/sampling_logp_difference/mean"] == pytest.approx(delta.mean(), rel=1e-12)


def test_slime_tis_with_rollout_logprobs_is_null_with_its_reason_not_a_wrong_number():
    """slime@624b824a loss.py: TIS reads the trainer's recomputed log-probs (batch["log_probs"]); a run
    recorded with --use-rollout-logprobs holds the rollout as logp_old, so tis would read exp(0) = 1."""
    on = X.crosswalk(DEMO, "slime", use_rollout_logprobs=True)
    off = X.crosswalk(DEMO, "slime")
    reasons = X.null_reasons(on)
    for name in ("tis", "tis_abs", "tis_clipfrac"):
        assert set(on.column(name).to_pylist()) == {None} and "recomputed" in reasons[name]
        assert None not in off.column(name).to_pylist()
    assert None not in on.column("ois").to_pylist()
