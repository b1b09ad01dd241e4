"""The TRL hook's `policy_version` on a real GRPOTrainer whose generations serve several steps.

With steps_per_generation=4, num_iterations=2 and gradient_accumulation_steps=2, TRL 1.16 generates
once every 8 loss calls (grpo_trainer.py `_prepare_inputs`), i.e. every 4 optimizer steps, and the
batch then serves those 4 steps: staleness (step - policy_version) is 0, 1, 2, 3, 0, 1, 2, 3.
The tiny model is the one tests/test_integrations_trl.py builds (examples/trl_grpo.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import trl

import kldiag
from kldiag.analysis.reducers import staleness as S
from kldiag.integrations import trl as kt

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from trl_grpo import WORDS, build_tiny_model  # noqa: E402


def _reward(completions, **kwargs):
    return [float(c.split().count("cat")) - 0.1 * len(c.split()) for c in completions]


def _train(model_dir: Path, tmp: Path, **recorder_options):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    args = trl.GRPOConfig(output_dir=str(tmp / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
                          steps_per_generation=4, num_iterations=2, num_generations=4, max_completion_length=6,
                          beta=0.0, learning_rate=5e-2, max_steps=8, logging_steps=4, report_to=[], use_cpu=True,
                          seed=0, save_strategy="no", disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=str(model_dir), reward_funcs=_reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": [" ".join(WORDS[i % 20:i % 20 + 3])
                                                                          for i in range(64)]}),
                              processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir))
    generated_at = []  # TRL's own calls: the global step at each generation
    original = trainer._generate_and_score_completions

    def spy(*a, **kw):
        generated_at.append(int(trainer.state.global_step))
        return original(*a, **kw)

    trainer._generate_and_score_completions = spy  # under the hook: attach wraps this attribute
    kt.attach(trainer, tmp / "run", **recorder_options)
    trainer.train()
    return tmp / "run", generated_at


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


@pytest.mark.parametrize("options", [{}, {"backpressure": "drop"}], ids=["writer_thread", "training_thread"])
def test_policy_version_is_the_generating_step(model_dir, tmp_path, options):
    run, generated_at = _train(model_dir, tmp_path, **options)
    assert generated_at == [0, 4]  # TRL generated twice: before steps 1 and 5
    t = kldiag.open_run(run).read(columns=["step", "micro", "seq", "policy_version"]).to_pandas()
    assert t["policy_version"].notna().all()
    per_seq = t.groupby(["step", "seq"])["policy_version"].nunique()
    assert (per_seq == 1).all()  # one version per sequence
    stale = (t["step"] - t["policy_version"]).groupby(t["step"]).unique()
    assert {int(s): list(v) for s, v in stale.items()} == {s: [(s - 1) % 4] for s in range(1, 9)}
    versions = sorted(t["policy_version"].unique())
    assert versions == [g + 1 for g in generated_at]


def test_staleness_histogram_of_the_run(model_dir, tmp_path):
    run, _ = _train(model_dir, tmp_path)
    analysis = kldiag.analyze(run, kldiag.AnalysisConfig(), [S.StalenessReducer()])
    out = S.summary(analysis.reduced["staleness"])
    assert out["versions"] is True
    # 2 loss calls of 4 completions a step: 8 sequences a step, each staleness on 2 of the 8 steps
    assert out["histogram"] == {"0": 16, "1": 16, "2": 16, "3": 16}
    assert [s["staleness_max"] for s in out["steps"]] == [0, 1, 2, 3, 0, 1, 2, 3]
    fresh = next(b for b in out["by_staleness"] if b["staleness"] == "0")
    assert fresh["rho_max"] == pytest.approx(1.0) or fresh["drift_abs_mean"] < 1e-6  # on-policy at staleness 0
    assert np.isfinite([b["drift_abs_mean"] for b in out["by_staleness"]]).all()
    print("staleness histogram:", out["histogram"], "by staleness:",
          [(b["staleness"], round(b["drift_abs_mean"], 4), round(b["rho_clip_frac"], 4)) for b in out["by_staleness"]])
