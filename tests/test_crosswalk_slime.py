"""kldiag's slime crosswalk equals slime's own metric code at THUDM/slime@624b824a.

slime is not on PyPI: tests/golden/crosswalk_slime_624b824a.json holds the figures slime's own
`loss_function` -> `policy_loss_function` (slime/backends/megatron_utils/loss.py) and
`reduce_train_step_metrics` (slime/observability/train_metric_utils.py) gave on the fixture `fixture(seed)`
below, one call per micro-batch as Megatron makes them, run outside this repository with only megatron's
`mpu` (context/data parallel size 1), `torch.distributed.all_reduce` (one rank) and `torch.compile` stubbed
and the model forward replaced by the fixture's log-probs. The golden's header names the generator.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kldiag.crosswalk as X
from kldiag.crosswalk import slime as SX
from kldiag.crosswalk.batch import StepBatch

GOLDEN = Path(__file__).resolve().parent / "golden" / "crosswalk_slime_624b824a.json"


def fixture(seed: int = 0, dtype=np.float32) -> dict[str, list[np.ndarray] | np.ndarray]:
    """One slime train step: per sample (response order) 1-D arrays logp (pi_theta), logp_old (the trainer's
    recompute), logp_sampler (SGLang), logp_ref and mask (bool), plus micro [B] (the micro-batch of each
    sample). Ragged lengths, a sample with no loss token, a sample with a masked hole, ratios on both sides
    of the TIS bands and a reference far enough for low_var_kl's +-10 clamp."""
    rng = np.random.default_rng(seed)
    lengths = [5, 12, 1, 7, 9, 3, 11, 6, 8]
    out: dict[str, list] = {k: [] for k in ("logp", "logp_old", "logp_sampler", "logp_ref", "mask")}
    for i, n in enumerate(lengths):
        old = -rng.exponential(1.0, n)
        mask = np.ones(n, bool)
        if i == 3:
            mask[:] = False
        if i == 4:
            mask[2:5] = False
        sampler = np.minimum(old + rng.normal(0, 0.5, n), -1e-4)
        logp = np.minimum(old + rng.normal(0, 0.3, n), -1e-4)
        ref = logp + rng.normal(0, 1.0, n)
        if i == 1:
            sampler[0], sampler[1], ref[2] = old[0] - 3.0, old[1] + 4.0, logp[2] + 14.0
        if i == 6:
            sampler = old.copy()  # tis exactly 1.0: on the edge of a band at 1
        for k, v in zip(out, (logp, old, sampler, ref, mask), strict=True):
            out[k].append(v if k == "mask" else v.astype(dtype))
    out["micro"] = np.repeat(np.arange(3), 3)
    return out


def step_batch(fx) -> StepBatch:
    """The fixture as kldiag pads a step (right padding, log-probs 0 there)."""
    b, t = len(fx["mask"]), max(len(m) for m in fx["mask"])

    def grid(key, fill=0.0):
        g = np.full((b, t), fill, np.float64)
        for i, v in enumerate(fx[key]):
            g[i, :len(v)] = v
        return g

    return StepBatch(0, np.arange(b), grid("mask", False).astype(bool), grid("logp"), grid("logp_old"),
                     grid("logp_ref", np.nan), grid("logp_sampler", np.nan), np.ones(b), fx["micro"].astype(np.int64),
                     np.zeros(b, np.int64))


FIGURES = json.loads(GOLDEN.read_text())  # checked in: a missing file is a failure, not a skip
CASES = [(c["dtype"], c["settings"], c["metrics"]) for c in FIGURES["cases"]]


@pytest.mark.parametrize("dtype, settings, theirs", CASES)
def test_every_metric_equals_slimes_own(dtype, settings, theirs):
    fx = fixture(FIGURES["seed"], np.dtype(dtype).type)
    s = SX.Settings(**settings)
    if s.use_rollout_logprobs:  # the run holds the rollout's log-probs as logp_old in this mode
        fx = {**fx, "logp_old": fx["logp_sampler"]}
    mine, why = SX.step_metrics(step_batch(fx), s)
    compared = 0
    for name, value in theirs.items():
        if name in why:
            assert name in SX.TIS_NAMES and s.use_rollout_logprobs and "recomputed" in why[name]
            continue
        # slime computes in float32 (rollout log-probs and compute_approx_kl are float32)
        assert mine[name] == pytest.approx(value, rel=2e-6, abs=1e-7), name
        compared += 1
    assert compared >= 3


def test_golden_covers_the_configurations_slime_reduces_differently():
    seen = {(c["settings"].get("calculate_per_token_loss", False), c["settings"].get("advantage_estimator", "grpo"))
            for c in FIGURES["cases"]}
    assert seen >= {(False, "grpo"), (True, "grpo"), (False, "gspo"), (True, "gspo")}


def test_per_token_loss_and_gspo_change_the_figures():
    """Each reduction is a different number on ragged samples: a crosswalk ignoring them would be wrong."""
    b = step_batch(fixture(0, np.float64))
    base, _ = SX.step_metrics(b, SX.Settings())
    tok, _ = SX.step_metrics(b, SX.Settings(calculate_per_token_loss=True))
    gspo, _ = SX.step_metrics(b, SX.Settings(advantage_estimator="gspo"))
    assert all(abs(tok[k] - base[k]) > 1e-3 * abs(base[k]) for k in base)
    assert abs(gspo["ois"] - base["ois"]) > 1e-3 and gspo["tis"] == base["tis"]


def test_a_nan_sampler_token_is_a_null_with_its_reason_not_a_number():
    fx = fixture(0, np.float64)
    fx["logp_sampler"][0] = fx["logp_sampler"][0].copy()
    fx["logp_sampler"][0][1] = np.nan
    mine, why = SX.step_metrics(step_batch(fx), SX.Settings())
    assert "tis" not in mine and "NaN" in why["tis"] and np.isfinite(mine["kl_loss"])


@pytest.mark.parametrize("kw, reason", [
    ({"use_rollout_logprobs": True, "use_tis": True}, "cannot be set at the same time"),
    ({"advantage_estimator": "gpro"}, "advantage_estimator must be one of"),
    ({"kl_loss_type": "k4"}, "kl_loss_type must be one of"),
])
def test_configurations_slime_refuses_are_refused_with_its_reason(kw, reason):
    with pytest.raises(X.CrosswalkError, match=reason):
        X.parse_settings("slime", kw)


def test_per_token_loss_from_the_manifest_config():
    class Manifest:
        config = {"calculate_per_token_loss": True, "advantage_estimator": "gspo"}

    s = X.parse_settings("slime", {}, Manifest())
    assert s.calculate_per_token_loss is True and s.advantage_estimator == "gspo"
