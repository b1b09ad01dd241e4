"""kldiag.crosswalk("trl") against real TRL GRPOTrainer runs on a tiny CPU model: the `kl` TRL logs
(trainer.state.log_history) equals the crosswalk's on every step, with and without
use_bias_correction_kl and with the sequence-level importance ratio. TRL computes sampling/* only
with vLLM (not on CPU): those columns are null with a reason, and tested on the demo run's sampler."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import kldiag.crosswalk as X

trl = pytest.importorskip("trl")
pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from trl_grpo import WORDS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2_cw"), seed=0)


def reward(completions, **kwargs):
    return [float(c.split().count("cat")) - 0.1 * len(c.split()) for c in completions]


def train(model_dir, tmp, setup=None, **overrides):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    from kldiag.integrations import trl as kt

    options = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4,
               "max_completion_length": 8, "num_iterations": 2, "beta": 0.1, "learning_rate": 5e-2, "max_steps": 4,
               "logging_steps": 1, "report_to": [], "use_cpu": True, "seed": 0, "save_strategy": "no",
               "disable_tqdm": True, **overrides}
    prompts = [" ".join(WORDS[i % 20:i % 20 + 3]) for i in range(64)]
    trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=reward,
                              args=trl.GRPOConfig(output_dir=str(tmp / "out"), **options),
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir))
    if setup is not None:
        setup(trainer)
    kt.attach(trainer, tmp / "run")
    trainer.train()
    return trainer, tmp / "run"


@pytest.mark.parametrize("overrides", [
    {"use_bias_correction_kl": False},
    {"use_bias_correction_kl": True, "importance_sampling_level": "sequence"},
], ids=["k3", "k3_is_sequence"])
def test_kl_equals_what_trl_logs(model_dir, tmp_path, overrides):
    trainer, run = train(model_dir, tmp_path, **overrides)
    logged = {h["step"]: h["kl"] for h in trainer.state.log_history if "kl" in h}
    assert sorted(logged) == [1, 2, 3, 4] and max(logged.values()) > 1e-4
    table = X.crosswalk(run, "trl")
    mine = dict(zip(table.column("step").to_pylist(), table.column("kl").to_pylist(), strict=True))
    assert sorted(mine) == sorted(logged)
    rel = max(abs(mine[s] - v) / max(abs(v), 1e-12) for s, v in logged.items() if v)
    assert rel < 1e-5, rel
    rows = X.records(table)
    assert all(r["sampling/importance_sampling_ratio/mean"] is None for r in rows)
    assert "vllm_importance_sampling_correction" in rows[0]["null_reasons"]["sampling/importance_sampling_ratio/mean"]


def test_sampling_metrics_follow_the_mode_on_the_demo_sampler():
    """On demo_k3 (mu at temperature 1.2): truncation clips at clip_max, masking zeroes outside the band."""
    run = "sample_logs/demo_k3"
    trunc = X.crosswalk(run, "trl", vllm_importance_sampling_mode="token_truncate",
                        vllm_importance_sampling_clip_max=1.1)
    mask = X.crosswalk(run, "trl", vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=1.1)
    seq = X.crosswalk(run, "trl", vllm_importance_sampling_mode="sequence_mask")
    assert max(trunc.column("sampling/importance_sampling_ratio/max").to_pylist()) <= 1.1 + 1e-12
    assert min(mask.column("sampling/importance_sampling_ratio/min").to_pylist()) == 0.0
    lo, hi = (np.array(seq.column(f"sampling/importance_sampling_ratio/{k}").to_pylist()) for k in ("min", "max"))
    assert (hi <= 3.0).all() and (lo >= 0).all()
    d = np.array(trunc.column("sampling/sampling_logp_difference/mean").to_pylist())
    assert (d > 0.05).all()  # a temperature mismatch is never float noise


@pytest.mark.parametrize("kw, reason", [
    ({"vllm_importance_sampling_clip_min": 3.0, "vllm_importance_sampling_clip_max": 2.0}, "must be less than"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_min": None,
      "vllm_importance_sampling_clip_max": None}, "_truncate"),
])
def test_configurations_trl_refuses_are_refused_at_set(tmp_path, kw, reason):
    """TRL's own GRPOConfig raises on each; `--set` refuses it with the reason."""
    from trl import GRPOConfig

    with pytest.raises(ValueError):
        GRPOConfig(output_dir=str(tmp_path), vllm_importance_sampling_correction=True, **kw)
    with pytest.raises(X.CrosswalkError, match=reason):
        X.parse_settings("trl", kw)


def engine_logps(trainer, seed: int = 0):
    """Make `trainer` run TRL's vLLM importance-sampling path on CPU: its own `_generate` produces the
    completions (transformers generation), and the engine's per-token log-probs it would return are
    stand-ins: pi_old-like values, a few far off, one None (vLLM's NaN) in the first batch. Everything
    downstream (the ratio, its truncation or masking, the sampling/* metrics) is TRL's code."""
    rng = np.random.default_rng(seed)
    generate = trainer._generate
    calls = {"n": 0}

    def _generate(prompts):
        trainer.use_vllm = False  # TRL's transformers generation, not a vLLM server
        try:
            out = list(generate(prompts))
        finally:
            trainer.use_vllm = True
        logps = [list(-rng.exponential(1.5, len(ids)) - rng.exponential(0.5) * (rng.random() < 0.3))
                 for ids in out[1]]
        if calls["n"] == 0 and len(logps[0]) > 1:
            logps[0][1] = None
        calls["n"] += 1
        out[4] = logps
        return tuple(out)

    trainer._generate = _generate
    trainer.use_vllm = True
    trainer.vllm_importance_sampling_correction = True


SAMPLING = ["sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
            "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
            "sampling/importance_sampling_ratio/max"]


@pytest.mark.parametrize("mode, clip_min, clip_max", [("token_truncate", 0.5, 2.0), ("token_mask", 0.5, 2.0),
                                                      ("sequence_truncate", None, 3.0), ("sequence_mask", None, 3.0)])
def test_sampling_metrics_equal_what_trl_logs(model_dir, tmp_path, mode, clip_min, clip_max):
    """One generation batch a step (num_iterations 1): TRL's logged sampling/* per step against kldiag's."""
    overrides = {"num_iterations": 1, "max_steps": 3, "beta": 0.0, "vllm_importance_sampling_mode": mode,
                 "vllm_importance_sampling_clip_min": clip_min, "vllm_importance_sampling_clip_max": clip_max}
    trainer, run = train(model_dir, tmp_path, setup=engine_logps, **overrides)
    logged = {h["step"]: h for h in trainer.state.log_history if SAMPLING[0] in h}
    assert sorted(logged) == [1, 2, 3]
    table = X.crosswalk(run, "trl", vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                        vllm_importance_sampling_clip_max=clip_max)
    rows = {r["step"]: r for r in table.to_pylist()}  # the hook numbers steps as TRL logs them
    for step, h in logged.items():
        for name in SAMPLING:
            assert rows[step][name] == pytest.approx(h[name], rel=2e-6, abs=1e-7), (step, name)


def test_several_generation_calls_per_step_are_null_with_the_reason():
    """gradient_accumulation_steps > steps_per_generation x num_iterations: TRL logs the mean of several
    generation calls' sampling/* values (grpo_trainer.py _prepare_inputs' generate_every); null, with why."""
    from kldiag.crosswalk import trl as TX
    from kldiag.crosswalk.batch import StepBatch

    one = TX.Settings(gradient_accumulation_steps=4, steps_per_generation=4, num_iterations=1)
    two = TX.Settings(gradient_accumulation_steps=4, steps_per_generation=2, num_iterations=1)
    partial = TX.Settings(gradient_accumulation_steps=3, steps_per_generation=1, num_iterations=2)
    rare = TX.Settings(gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=4)
    assert [TX.generation_calls(x) for x in (TX.Settings(), one, two, partial, rare)] == [1, 1, 2, 2, 1]
    rng = np.random.default_rng(0)
    lp = -rng.exponential(1.0, (3, 5))
    b = StepBatch(1, np.arange(3), np.ones((3, 5), bool), lp, lp - 0.01, np.full((3, 5), np.nan), lp + 0.02,
                  np.ones(3), np.zeros(3, np.int64), np.zeros(3, np.int64))
    got, why = TX.step_metrics(b, two)
    assert not any(k.startswith("sampling/") for k in got)
    assert "steps_per_generation = gradient_accumulation_steps" in why["sampling/importance_sampling_ratio/mean"]
    got, why = TX.step_metrics(b, one)
    assert "sampling/importance_sampling_ratio/mean" in got and list(why) == ["kl"]  # no logp_ref here
