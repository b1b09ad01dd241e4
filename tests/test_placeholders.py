"""Placeholders: tokens the engine never generated (mask false: tool output) never enter a mismatch,
IS or fault figure, whatever the dump stored as their sampler log-prob (0.0 or NaN).

The run: a healthy multi-turn rollout [turn 0 | tool | turn 1 | tool | turn 2] built from exact
per-position categorical distributions (the trainer's logits are the engine's plus N(0, 0.02) noise),
recorded with kldiag.Recorder three times: tool tokens' logp_sampler 0.0, NaN, or the trainer's own
log-prob (the reference). All three must read the same; the placeholders are counted."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest

import kldiag
from kldiag.analysis import AnalysisConfig, analyze
from kldiag.cli.analyze import summary
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers as diagnosis_reducers
from kldiag.importers import import_dumps
from kldiag.live.guard import step_sums
from kldiag.mismatch import parity as P
from kldiag.record.recorder import Recorder

STEPS, SEQS, V, TURN, TOOL, TURNS = 24, 16, 64, 8, 4, 3
T = TURNS * TURN + (TURNS - 1) * TOOL
GENERATED = (np.arange(T) % (TURN + TOOL)) < TURN  # [T]: the engine's tokens; the rest is tool output
FIGURES = ("tokens", "k3_mean", "weight_k3_abs_max", "rho_mean", "rho_max", "drift_abs_mean", "mismatch_kl",
           "opsm_masked_frac", "nonfinite_count", "invalid_count", "flagged_frac")


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def multi_turn(seed: int = 0) -> dict[str, np.ndarray]:
    """[STEPS * SEQS, T] log-probs of the tokens of a healthy multi-turn run; logp_sampler NaN on tool tokens."""
    rng = np.random.default_rng(seed)
    n = STEPS * SEQS
    z_ref = 2.6 * rng.standard_normal((n, T, V))
    z_theta = z_ref + 0.1 * rng.standard_normal((n, T, V))
    z_old = z_theta - 0.05 * rng.standard_normal((n, T, V))  # one update behind
    z_mu = z_old + 0.02 * rng.standard_normal((n, T, V))  # the engine: the trainer's logits + noise 0.02
    lp = {name: log_softmax(z) for name, z in (("logp", z_theta), ("logp_old", z_old), ("logp_ref", z_ref),
                                                ("logp_sampler", z_mu))}
    cdf = np.cumsum(np.exp(lp["logp_sampler"]), -1)
    sampled = np.minimum((cdf < rng.random((n, T, 1))).sum(-1), V - 1)
    tool = rng.integers(0, V, (n, T))  # tool output: not drawn from any model
    x = np.where(GENERATED, sampled, tool)
    out = {name: np.take_along_axis(v, x[..., None], -1)[..., 0].astype(np.float32) for name, v in lp.items()}
    out["logp_sampler"][:, ~GENERATED] = np.nan
    reward = rng.random(n) < 0.5
    g = reward.reshape(-1, 4).astype(np.float64)
    adv = ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-4)).reshape(-1).astype(np.float32)
    return {**out, "token_ids": x, "mask": np.broadcast_to(GENERATED, (n, T)).copy(), "advantages": adv,
            "group_ids": np.arange(n) // 4}


@pytest.fixture(scope="module")
def data() -> dict[str, np.ndarray]:
    return multi_turn()


def record(run: Path, data: dict[str, np.ndarray], tool_sampler: str) -> Recorder:
    """The run with tool tokens' logp_sampler "0.0", "nan", or "trainer" (logp_old there: the reference)."""
    smp = data["logp_sampler"].copy()
    tool = ~data["mask"]
    smp[tool] = {"0.0": 0.0, "nan": np.nan, "trainer": 0.0}[tool_sampler]
    if tool_sampler == "trainer":
        smp[tool] = data["logp_old"][tool]
    with Recorder(run, beta=0.04, estimator="k3", clip_range=(0.2, 0.28), trainer="trl",
                  rotate_seconds=None) as rec:
        for s in range(STEPS):
            r = slice(s * SEQS, (s + 1) * SEQS)
            rec.record(step=s, logp=data["logp"][r], logp_old=data["logp_old"][r], logp_ref=data["logp_ref"][r],
                       logp_sampler=smp[r], mask=data["mask"][r], completion_mask=np.ones((SEQS, T), bool),
                       token_ids=data["token_ids"][r], advantages=data["advantages"][r],
                       group_ids=data["group_ids"][r], turn=np.broadcast_to(np.arange(T) // (TURN + TOOL), (SEQS, T)))
    return rec


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data) -> dict[str, tuple]:
    """{placeholder kind: (run, recorder, warnings, analysis, diagnosis)}."""
    out = {}
    for kind in ("0.0", "nan", "trainer"):
        run = tmp_path_factory.mktemp(f"placeholders-{kind}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rec = record(run, data, kind)
        a = analyze(run, AnalysisConfig(use_cache=False), diagnosis_reducers())
        out[kind] = (run, rec, [str(w.message) for w in caught], a, diagnose(a))
    return out


def same(x: object, y: object) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (math.isnan(x) and math.isnan(y))
    return x == y


@pytest.mark.parametrize("kind", ["0.0", "nan"])
def test_placeholders_leave_a_healthy_run_healthy(runs, kind: str) -> None:
    _, _, _, a, d = runs[kind]
    assert [c.cause for c in d.causes] == [] and d.verdict == "healthy", d.to_dict()
    assert runs["trainer"][4].verdict == "healthy" and runs["trainer"][4].causes == []
    assert a.steps.column("nonfinite_count").to_pylist() == [0] * STEPS


@pytest.mark.parametrize("kind", ["0.0", "nan"])
def test_mismatch_figures_equal_the_run_without_placeholders(runs, kind: str) -> None:
    a, ref = runs[kind][3], runs["trainer"][3]
    for col in FIGURES:
        got, want = a.steps.column(col).to_pylist(), ref.steps.column(col).to_pylist()
        assert all(same(x, y) for x, y in zip(got, want, strict=True)), col
    assert max(a.steps.column("mismatch_kl").to_pylist()) < 1e-3  # the engine's noise only
    fit, fit_ref = P.report_for(a).fit.to_dict(), P.report_for(ref).fit.to_dict()
    assert fit == fit_ref and abs(fit["offset"]) < 0.01  # the sampled tokens only: no +0.5-nat offset
    assert fit["tokens"] == int(np.count_nonzero(GENERATED)) * STEPS * SEQS


@pytest.mark.parametrize("kind", ["0.0", "nan"])
def test_placeholders_are_counted_and_reported(runs, kind: str) -> None:
    run, rec, caught, a, d = runs[kind]
    n = int(np.count_nonzero(~GENERATED)) * STEPS * SEQS
    assert rec.stats["placeholders"] == n and a.info["placeholders"] == n
    assert kldiag.open_run(run).manifest.writer["placeholders"] == n
    assert rec.stats["nonfinite"] == 0  # the recorder counts as the analysis does
    assert sum("placeholder logp_sampler/logp_old" in w for w in caught) == 1  # said once
    assert summary(a, d)["placeholders"] == n
    assert runs["trainer"][3].info["placeholders"] == 0 and runs["trainer"][1].stats["placeholders"] == 0


@pytest.mark.filterwarnings("ignore:kldiag.*placeholder:RuntimeWarning")
def test_a_nan_logp_in_the_loss_is_still_a_numerical_fault(tmp_path: Path, data) -> None:
    bad = {**data, "logp": data["logp"].copy()}
    bad["logp"][5 * SEQS + 3, 1] = np.nan  # a generated token (position 1 of turn 0), step 5
    record(tmp_path, bad, "nan")
    d = diagnose(analyze(tmp_path, AnalysisConfig(use_cache=False), diagnosis_reducers()))
    fault = [c for c in d.causes if c.cause == "numerical_fault"]
    assert fault and fault[0].onset == 5 and fault[0].evidence["nonfinite_tokens"] == 1


def test_the_guard_ignores_placeholders(data) -> None:
    r = slice(0, SEQS)
    args = {k: data[k][r].astype(np.float64) for k in ("logp", "logp_ref", "logp_old")}
    smp = data["logp_sampler"][r].astype(np.float64)
    mask = data["mask"][r]
    ref = step_sums(**args, logp_sampler=np.where(mask, smp, args["logp_old"]), mask=mask)
    got = step_sums(**args, logp_sampler=smp, mask=mask)  # NaN on tool tokens
    assert got["nonfinite"] == 0 and got["placeholders"] == np.count_nonzero(~mask)
    assert {k: v for k, v in got.items() if k != "placeholders"} == {k: v for k, v in ref.items()
                                                                       if k != "placeholders"}


def nemo_rl_multi_turn(log_dir: Path, placeholder: float | None) -> int:
    """A NeMo-RL train_data_step1.jsonl of multi-turn samples [prompt | turn | tool | turn], as
    nemo_rl/algorithms/grpo.py (NVIDIA-NeMo/RL@7ea279ab) logs them: token_loss_mask 0 on the tool
    reply, generation_logprobs `placeholder` there (None: JSON null). Returns the tool tokens."""
    rng = np.random.default_rng(1)
    p, turn, tool, n = 3, 5, 4, 6
    length = p + 2 * turn + tool
    loss = np.r_[np.zeros(p), np.ones(turn), np.zeros(tool), np.ones(turn)].astype(int)
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / "train_data_step1.jsonl", "w") as f:
        for i in range(n):
            prev = np.r_[np.zeros(p), rng.normal(-1.0, 0.5, length - p).clip(max=-1e-3)]
            gen = np.where(loss == 1, (prev + rng.normal(0, 0.02, length)).clip(max=-1e-3), 0.0).tolist()
            gen = [placeholder if (loss[j] == 0 and j >= p) else g for j, g in enumerate(gen)]
            row = {"content": [f"sample {i}"], "rewards": [float(i % 2)], "input_lengths": [length],
                   "token_ids": [rng.integers(1, 500, length).tolist()], "token_loss_mask": [loss.tolist()],
                   "sample_loss_mask": [1.0], "advantages": [[float(i % 2) - 0.5] * length],
                   "generation_logprobs": [gen], "prev_logprobs": [prev.tolist()], "idx": i}
            f.write(json.dumps(row) + "\n")
    return n * tool


@pytest.mark.parametrize("placeholder", [0.0, None])
def test_an_importer_says_how_many_placeholders_it_ignored(tmp_path: Path, placeholder: float | None) -> None:
    tool_tokens = nemo_rl_multi_turn(tmp_path / "logs", placeholder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = import_dumps("nemo-rl", tmp_path / "logs", tmp_path / "run", group_size=2)
    assert res.placeholders == tool_tokens
    assert any(f"ignored {tool_tokens:,} placeholder log-probs" in line for line in res.lines())
    assert any("placeholder logp_sampler/logp_old" in str(w.message) for w in caught)
    assert kldiag.open_run(tmp_path / "run").manifest.writer["placeholders"] == tool_tokens
    a = analyze(tmp_path / "run", AnalysisConfig(use_cache=False), diagnosis_reducers())
    assert a.info["placeholders"] == tool_tokens
    assert a.steps.column("nonfinite_count").to_pylist() == [0]
    assert a.steps.column("mismatch_kl").to_pylist()[0] < 1e-3  # the loss tokens' 0.02-nat noise only
    assert "numerical_fault" not in [c.cause for c in diagnose(a).causes]


@pytest.mark.filterwarnings("ignore:kldiag.*placeholder:RuntimeWarning")
def test_a_null_sampler_log_prob_is_no_placeholder(tmp_path: Path, data) -> None:
    """Steps without logp_sampler (null, not NaN) next to steps with NaN placeholders in one part:
    only the placeholders count, and the nulls stay absences."""
    smp = np.where(data["mask"], data["logp_sampler"], np.nan).astype(np.float32)
    with Recorder(tmp_path, rotate_seconds=None) as rec:
        for s in range(STEPS):
            r = slice(s * SEQS, (s + 1) * SEQS)
            rec.record(step=s, logp=data["logp"][r], logp_old=data["logp_old"][r], logp_ref=data["logp_ref"][r],
                       logp_sampler=smp[r] if s % 2 else None, mask=data["mask"][r],
                       completion_mask=np.ones((SEQS, T), bool))
    a = analyze(tmp_path, AnalysisConfig(use_cache=False))
    per_step = int(np.count_nonzero(~GENERATED)) * SEQS
    assert a.info["placeholders"] == per_step * (STEPS // 2) == rec.stats["placeholders"]
    assert a.steps.column("nonfinite_count").to_pylist() == [0] * STEPS
