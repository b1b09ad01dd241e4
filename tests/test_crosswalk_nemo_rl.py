"""kldiag's NeMo-RL crosswalk equals NeMo-RL's own metric code at NVIDIA-NeMo/RL@7ea279ab.

NeMo-RL is not on PyPI: tests/golden/crosswalk_nemo_rl_7ea279ab.json holds the figures NeMo-RL's own
`ClippedPGLossFn.__call__` (nemo_rl/algorithms/loss/loss_functions.py, with nemo_rl/algorithms/utils.py
`calculate_kl` and `masked_mean`) gave on `fixture(seed)` below, called once per micro-batch of each global
batch with that global batch's valid-token count, each value divided by the number of global batches
(nemo_rl/models/automodel/train.py `automodel_forward_backward`) and summed over the step (grpo.py), run
outside this repository with only imports that module never calls on this path stubbed. The golden's header
names the generator.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kldiag.crosswalk as X
from kldiag.crosswalk import nemo_rl as NX
from kldiag.crosswalk.batch import StepBatch

GOLDEN = Path(__file__).resolve().parent / "golden" / "crosswalk_nemo_rl_7ea279ab.json"


def fixture(seed: int = 0, dtype=np.float32) -> dict[str, np.ndarray]:
    """One GRPO step of 8 samples as NeMo-RL's train_data holds it, response positions only, right padded:
    prev (pi_old), gen (mu) [B, T] (0 at padding), token_mask [B, T] bool, sample_mask [B]. Ragged lengths,
    a sample with sample_mask 0, a sample with no loss token, a masked hole, a far-off token."""
    rng = np.random.default_rng(seed)
    b, t = 8, 10
    lengths = np.array([4, 10, 1, 7, 9, 3, 6, 8])
    token_mask = np.arange(t)[None, :] < lengths[:, None]
    prev = np.where(token_mask, -rng.exponential(1.0, (b, t)), 0.0)
    gen = np.where(token_mask, np.minimum(prev + rng.normal(0, 0.4, (b, t)), -1e-4), 0.0)
    gen[1, 3] = prev[1, 3] - 5.0
    token_mask[4, 2:5] = False
    token_mask[5] = False
    sample_mask = np.ones(b)
    sample_mask[6] = 0.0
    return {"prev": prev.astype(dtype), "gen": gen.astype(dtype), "token_mask": token_mask,
            "sample_mask": sample_mask.astype(dtype)}


def step_batch(fx, step: int = 3) -> StepBatch:
    """The fixture as kldiag holds it: mask = token_mask * sample_mask (the NeMo-RL importer's), seq numbered
    as that importer numbers a step's samples (step * 2**32 + idx)."""
    prev, gen = fx["prev"].astype(np.float64), fx["gen"].astype(np.float64)
    mask = fx["token_mask"] & (fx["sample_mask"] != 0)[:, None]
    n = len(mask)
    return StepBatch(step, (np.int64(step) << 32) + np.arange(n), mask, prev, prev, np.full(prev.shape, np.nan),
                     np.where(mask, gen, np.nan), np.ones(n), np.zeros(n, np.int64), np.zeros(n, np.int64))


FIGURES = json.loads(GOLDEN.read_text())  # checked in: a missing file is a failure, not a skip
CASES = [(c["dtype"], c["settings"], c["metrics"]) for c in FIGURES["cases"]]


@pytest.mark.parametrize("dtype, settings, theirs", CASES)
def test_every_metric_equals_nemo_rls_own(dtype, settings, theirs):
    fx = fixture(FIGURES["seed"], np.dtype(dtype).type)
    mine, why = NX.step_metrics(step_batch(fx), NX.Settings(**settings))
    assert why == {} and set(mine) == set(theirs)
    for name, value in theirs.items():
        assert mine[name] == pytest.approx(value, rel=2e-6, abs=1e-9), name


def test_golden_covers_several_global_batches_and_dropped_samples():
    gbs = {c["settings"].get("train_global_batch_size") for c in FIGURES["cases"]}
    assert {None, 4, 2} <= gbs and any(c["settings"].get("num_prompts_per_step") for c in FIGURES["cases"])


def test_global_batches_change_the_figures():
    b = step_batch(fixture(0, np.float64))
    one, _ = NX.step_metrics(b, NX.Settings())
    two, _ = NX.step_metrics(b, NX.Settings(train_global_batch_size=4))
    assert all(abs(one[k] - two[k]) > 1e-3 * abs(one[k]) for k in one)


def test_a_step_that_is_not_whole_global_batches_is_null_with_its_reason():
    b = step_batch(fixture(0, np.float64))
    mine, why = NX.step_metrics(b, NX.Settings(train_global_batch_size=3))
    assert mine == {} and "num_prompts_per_step" in why["gen_kl_error"]
    mine, why = NX.step_metrics(b, NX.Settings(train_global_batch_size=3, num_prompts_per_step=4,
                                               num_generations_per_prompt=2))
    assert why == {} and np.isfinite(mine["gen_kl_error"])


@pytest.mark.parametrize("kw, reason", [
    ({"reference_policy_kl_type": "k4"}, "k1, k2 or k3"),
    ({"num_prompts_per_step": 4}, "set both"),
])
def test_bad_settings_are_refused_with_the_fix(kw, reason):
    with pytest.raises(X.CrosswalkError, match=reason):
        X.parse_settings("nemo-rl", kw)


def test_a_nan_generation_token_is_a_null_with_its_reason_not_a_number():
    fx = fixture(0, np.float64)
    fx["gen"][1, 2] = np.nan
    mine, why = NX.step_metrics(step_batch(fx), NX.Settings(train_global_batch_size=4))
    assert mine == {} and "NaN" in why["gen_kl_error"]
