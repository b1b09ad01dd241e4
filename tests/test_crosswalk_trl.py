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


def train(model_dir, tmp, **overrides):
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
