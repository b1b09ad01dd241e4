"""kldiag's OpenRLHF crosswalk equals OpenRLHF's own `PolicyLoss` (openrlhf 0.11.2, the PyPI wheel that
`make setup` downloads to .venv/wheels), run unmodified on the same tokens: `openrlhf/models/loss.py` and
`openrlhf/models/utils.py` are loaded from the wheel as they are; only `deepspeed`, which a CPU machine
lacks and `PolicyLoss` never calls, is stubbed."""

from __future__ import annotations

import importlib.util
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kldiag.crosswalk import openrlhf as OX  # noqa: E402
from kldiag.crosswalk.batch import StepBatch  # noqa: E402

WHEELS = Path(__file__).resolve().parent.parent / ".venv" / "wheels"


@pytest.fixture(scope="module")
def policy_loss(tmp_path_factory):
    wheels = sorted(WHEELS.glob("openrlhf-0.11.2-*.whl"))
    if not wheels:
        pytest.skip("no openrlhf 0.11.2 wheel: run make setup (pip download openrlhf==0.11.2 --no-deps)")
    root = tmp_path_factory.mktemp("openrlhf")
    with zipfile.ZipFile(wheels[0]) as z:
        for name in ("openrlhf/models/loss.py", "openrlhf/models/utils.py"):
            member = next(n for n in z.namelist() if n.endswith(name))
            (root / Path(name).name).write_bytes(z.read(member))
    saved = {k: sys.modules.get(k) for k in ("deepspeed", "openrlhf", "openrlhf.models")}
    sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    for pkg in ("openrlhf", "openrlhf.models"):
        sys.modules[pkg] = types.ModuleType(pkg)
        sys.modules[pkg].__path__ = [str(root)]
    mods = {}
    for name in ("utils", "loss"):
        spec = importlib.util.spec_from_file_location(f"openrlhf.models.{name}", root / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mods[name]
        spec.loader.exec_module(mods[name])
    yield mods["loss"].PolicyLoss
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v
    for k in ("openrlhf.models.utils", "openrlhf.models.loss"):
        sys.modules.pop(k, None)


def tokens(dtype, seed: int = 0):
    """[B, T] log-probs with right padding, one sequence with no token in the loss, ratios on both
    sides of the bands (some extreme)."""
    rng = np.random.default_rng(seed)
    b, t = 7, 9
    mask = np.arange(t)[None, :] < rng.integers(2, t + 1, b)[:, None]
    mask[3] = False  # a sequence with no trained token: its sequence statistic is NaN
    old = -rng.exponential(1.0, (b, t))
    rollout = old + rng.normal(0, 0.6, (b, t))
    rollout[0, 1] = old[0, 1] - 6.0
    rollout[:, :] = np.minimum(rollout, -1e-6)
    old, rollout = np.where(mask, old, 0.0), np.where(mask, rollout, 0.0)
    return [np.asarray(x).astype(dtype) for x in (old, rollout)] + [mask]


CONFIGS = [(level, mode, gating, thr) for level in ("token", "seq") for mode, gating, thr in (
    ("mask", "ratio", (0.5, 5.0)), ("mask", "ratio", (0.8, 1.25)), ("clip", "ratio", (0.8, 1.25)),
    ("mask", "binary_kl", (0.0, 0.01)), ("mask", "tv", (0.0, 0.05))) if not (mode == "clip" and level == "seq")]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("level, mode, gating, threshold", CONFIGS)
def test_is_filter_ratio_and_vllm_kl_equal_openrlhfs(policy_loss, level, mode, gating, threshold, dtype):
    old, rollout, mask = tokens(dtype)
    loss = policy_loss(is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
                       is_correction_threshold=list(threshold))
    t = {k: torch.from_numpy(v) for k, v in (("old", old), ("rollout", rollout))}
    m = torch.from_numpy(mask).to(t["old"].dtype)
    _, _, _, vllm_kl, ratio = loss(t["old"], t["old"], torch.ones_like(t["old"]), m, rollout_log_probs=t["rollout"])
    n = len(mask)
    b = StepBatch(0, np.arange(n), mask, old.astype(float), old.astype(float), np.full(old.shape, np.nan),
                  rollout.astype(float), np.ones(n), np.zeros(n, np.int64), np.zeros(n, np.int64))
    mine, why = OX.step_metrics(b, OX.Settings(level, mode, gating, threshold))
    tol = 1e-12 if dtype == np.float64 else 2e-6
    assert mine["vllm_kl"] == pytest.approx(float(vllm_kl), rel=tol, abs=tol)
    # OpenRLHF takes the filtered share with .float(): float32 whatever the inputs
    assert mine["is_filter_ratio"] == pytest.approx(float(ratio), rel=2e-7, abs=1e-12)
    assert why == {}


@pytest.mark.parametrize("kw, reason", [
    ({"is_correction_gating": "tv"}, "upper bound only"),  # tv with the default band (0.5, 5.0)
    ({"is_correction_mode": "clip", "is_correction_level": "seq"}, "requires is_correction_level=token"),
    ({"is_correction_level": "tokens"}, "off/token/seq"),
])
def test_configurations_openrlhf_refuses_are_refused_with_its_reason(policy_loss, kw, reason):
    with pytest.raises(ValueError, match=reason):
        policy_loss(**{"is_correction_level": "token", **kw})
    with pytest.raises(ValueError, match=reason):
        OX.Settings(**kw)


def test_threshold_takes_high_alone_or_low_high():
    assert OX.Settings(is_correction_gating="tv", is_correction_threshold="0.05").is_correction_threshold == (0.0, 0.05)
    assert OX.Settings(is_correction_threshold="0.5 2").is_correction_threshold == (0.5, 2.0)
    assert OX.Settings(is_correction_threshold=[0.9, 1.1]).is_correction_threshold == (0.9, 1.1)
