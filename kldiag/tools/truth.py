"""Runs with a known truth (issue 24): a known cause, a known onset, built from real distributions.

    from kldiag.tools.truth import SCENARIOS, make_run
    sc = SCENARIOS["k3_blowup"]
    make_run("runs/k3_blowup", sc)          # written with kldiag.Recorder, one record() per micro-batch
    # diagnose(kldiag.analyze("runs/k3_blowup")) should name sc.expect, and nothing else

Every position of every completion is a real categorical distribution over `vocab` tokens given
by logits. Tokens that share a context (same step, prompt group and prefix) share their logits,
as in a real model. Per context, with z0 the shared logits (the reference):

    pi_ref   = softmax(z0)                    z0 ~ logit_scale * N(0, 1), + ref_bonus on the FILLER ids
    pi_theta = softmax(b(t) * (z0 + gap(t) * g - (shift(t) + hard(t)) * FILLER))   g ~ N(0, 1): training's moves
    pi_old   = pi_theta of step t - stale, minus stale * update * u      u ~ N(0, 1): the updates since
    mu       = softmax((bf16(logits of pi_old) + noise(t) * e) / T(t))  e ~ N(0, 1): the engine's kernels

The sampled token is drawn from mu (from pi_old without an engine); the log-probs written are the
exact log-softmax entries of that token, the entropy the exact entropy of pi_theta there. Only the
runs are written with kldiag.Recorder and judged with analyze and diagnose, as a user would.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers as diagnosis_reducers
from kldiag.record.recorder import Recorder


@dataclass(frozen=True)
class Expect:
    """One cause the diagnosis must name, at `onset` +/- `tol` steps."""

    cause: str
    onset: int
    tol: int = 5


@dataclass(frozen=True)
class Scenario:
    """One run with a known truth. The defaults are a healthy GRPO run, 2 updates off-policy, sampled
    by a bf16 engine (TRL-like manifest); a scenario changes what it needs and says what to expect."""

    name: str = "healthy_offpolicy_bf16"
    manifest: str = "trl"  # a key of MANIFESTS: trainer, version, beta, estimator, clip range, config
    steps: int = 300
    seqs: int = 16  # sequences per step
    group: int = 8  # completions per prompt (a GRPO group shares its first token's context)
    min_len: int = 64  # completion lengths are uniform in [min_len, max_len]
    max_len: int = 256
    vocab: int = 64
    micro_batches: int = 2  # record() calls per step
    seed: int = 0
    logit_scale: float = 2.6  # std of z0: pi_ref's mean entropy is about 2.0 nats at vocab 64
    filler: int = 4  # ids 0..filler-1 are "filler" tokens the reference likes ...
    ref_bonus: float = 2.0  # ... by this many nats of logit (about 22% of pi_ref's mass)
    ref_gap: tuple[float, float] = (0.05, 0.35)  # std of g's weight: pi_theta vs pi_ref, first -> last step
    stale: int = 2  # pi_old is pi_theta `stale` updates back (0 and no engine: on-policy, logp_old null)
    update: float = 0.05  # std of one update, in logit space
    engine: bool = True  # an inference engine samples (logp_sampler recorded)
    engine_noise: float = 0.02  # std of the engine's logit noise, on top of rounding the logits to bf16
    hard_frac: float = 0.0  # share of steps with a harder batch: prompts on which training already
    hard_shift: float = 3.0  # pushed the filler ids down by this many nats (pi_theta and pi_old alike)
    collapse_from: int | None = None  # from this step pi_theta pushes the filler ids down ...
    collapse_shift: float = 7.0  # ... by this many nats (pi_old follows `stale` steps later) ...
    collapse_ramp: int = 0  # ... reached linearly over this many steps (0: at once; a ramp gives a blow-up a lead-up)
    drift_from: int | None = None  # from this step pi_old is `drift_stale` updates behind
    drift_stale: int = 32
    stale_max: int | None = None  # asynchronous: each sequence is 0..stale_max updates stale (uniform), not `stale`
    versions: bool = False  # record policy_version = step - the sequence's staleness (format v1.3)
    mismatch_from: int | None = None  # from this step the engine's noise is mismatch_noise ...
    mismatch_noise: float = 0.4
    mismatch_ramp: int = 0  # ... reached linearly over this many steps (0: at once)
    temperature: float = 1.0  # the engine samples softmax(z / temperature), the trainer scores at 1 ...
    temperature_from: int = 0  # ... from this step
    nan_from: int | None = None  # from this step nan_per_step logp values per step are NaN
    nan_per_step: int = 2
    entropy_from: int | None = None  # from this step pi_theta's mean entropy falls geometrically ...
    entropy_end: float = 0.05  # ... to this many nats ...
    entropy_steps: int = 100  # ... over this many steps
    # rollouts across a weight update, an engine serving the wrong weights, low-precision rollouts
    mixed_frac: float = 0.0  # share of prompt groups whose completions straddle a weight update (at a uniform position)
    mixed_noise: float = 0.0  # engine logit noise added after the update (the new weights over the old KV cache)
    wrong_from: int | None = None  # from this step the engine serves pi_ref's weights (a resume that loaded the base)
    quant: tuple[float, float] | None = None  # engine logit noise of each weight version, first -> last step ...
    quant_jitter: float = 0.0  # ... times a lognormal factor of this sigma drawn per version (one sync a step)
    rollout_dtype: str = ""  # written as the manifest's config["rollout_dtype"] when set
    # parity contracts and the learning signal (drawn after every other draw: see _contracts)
    true_on_policy: bool = False  # the manifest declares it, and the engine's mu is pi_old bit for bit ...
    parity_off_frac: float = 0.0  # ... except this share of the loss tokens from parity_from: log mu = log pi_old
    parity_off: float = 1e-3  # ... minus this many nats
    parity_from: int = 0
    batch_noise: float = 0.0  # from batch_from, log pi_theta = log pi_old + this * N(0, 1) (batch variance)
    batch_from: int = 0
    dead_share: float = 0.0  # from dead_from, this share of the prompt groups get all-equal rewards
    dead_from: int = 0
    verdict: str = "healthy"  # the verdict diagnose must give
    expect: tuple[Expect, ...] = ()  # the causes it must name; any other cause is a false positive


VERL_ACTOR = {"use_kl_loss": True, "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.001, "loss_agg_mode": "token-mean",
              "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "entropy_coeff": 0.0, "ppo_epochs": 1,
              "ppo_mini_batch_size": 16, "ppo_micro_batch_size_per_gpu": 8, "policy_loss.loss_mode": "vanilla"}
TRL_CONFIG = {"loss_type": "dapo", "num_iterations": 1, "steps_per_generation": 2, "importance_sampling_level": "token",
              "use_bias_correction_kl": False, "epsilon": 0.2, "epsilon_high": 0.28, "temperature": 1.0,
              "use_vllm": True, "vllm_importance_sampling_correction": False}
MANIFESTS: dict[str, dict[str, Any]] = {
    # TRL GRPOTrainer with a reference (beta > 0) and vLLM, as kldiag.integrations.trl writes it
    "trl": {"trainer": "trl", "trainer_version": "1.16.0", "beta": 0.04, "estimator": "k3", "clip_range": (0.2, 0.28),
            "config": TRL_CONFIG},
    # TRL's default beta = 0: no reference model, so no logp_ref
    "trl_beta0": {"trainer": "trl", "trainer_version": "1.16.0", "beta": 0.0, "estimator": "k3",
                  "clip_range": (0.2, 0.28), "config": TRL_CONFIG},
    # a verl run recorded by hand: the K3 loss named "k3", the trainer (verl clamps K3 at 10) named "verl"
    "verl_k3": {"trainer": "verl", "trainer_version": "0.9.1", "beta": 0.001, "estimator": "k3",
                "clip_range": (0.2, 0.28), "config": VERL_ACTOR},
    # a verl run as kldiag's verl hook records low_var_kl: estimator "k3_clamped", verl's actor settings
    "verl_hook": {"trainer": "verl", "trainer_version": "0.9.1", "beta": 0.001, "estimator": "k3_clamped",
                  "clip_range": (0.2, 0.28),
                  "config": {**VERL_ACTOR, "kl_semantics": "verl", "verl_micro_slots": 1024, "verl_version": "0.9.1"}},
}

HEALTHY = Scenario()
LONG = dict(steps=2000, seqs=4, group=4, min_len=16, max_len=64, micro_batches=1)
ENTROPY = dict(manifest="trl_beta0", stale=0, engine=False, entropy_from=100)
CLAMP = dict(manifest="verl_k3", stale=1, collapse_shift=3.5, collapse_from=150)
# asynchronous RL: each prompt group 0-4 updates stale, the policy moving fast (0.25 nats of logit per update):
# |log pi_theta - log pi_old| ~0.3 nats a token, ~40% of tokens outside the clip range, rho from ~0.02 to ~20
ASYNC = dict(stale_max=4, update=0.25)


def _s(name: str, verdict: str = "healthy", expect: tuple[Expect, ...] = (), **kw: Any) -> Scenario:
    return replace(HEALTHY, name=name, verdict=verdict, expect=expect, **kw)


# rollouts across a weight update (versions per token): 30% of the prompt groups change version mid-completion, the
# new weights over the old KV cache adding logit noise; the twin's tokens after the change move by the one update
# only (0.05 nats of logit), under the cause's 3x
MIXED = dict(versions=True, mixed_frac=0.3)
FP8 = dict(versions=True, rollout_dtype="fp8")  # one weight sync a step (policy_version = step - 2)
ROLLOUT_FAULTS: tuple[Scenario, ...] = (
    _s("mixed_version_rollout", "warning", (Expect("mixed_version_rollout", 0),), mixed_noise=0.3, **MIXED),
    _s("mixed_version_twin", **MIXED),
    # the same runs without versions: the jump of |log mu - log pi_old| inside the sequences is the evidence
    _s("mixed_version_unstamped", "warning", (Expect("mixed_version_rollout", 0),), mixed_noise=0.3,
       **{**MIXED, "versions": False}),
    _s("mixed_version_unstamped_twin", **{**MIXED, "versions": False}),
    # from step 150 the engine serves pi_ref's weights (slime #1695); the twin's pi_ref starts at pi_theta and
    # stays within 0.05 nats of logit of it, so the engine agrees with both
    _s("engine_wrong_weights", "unstable", (Expect("engine_wrong_weights", 150),), wrong_from=150),
    _s("wrong_weights_twin", ref_gap=(0.0, 0.05)),
    # FP8 rollouts: each version's logit error 0.03 -> 0.1 nats times a lognormal factor (sigma 0.6) drawn per
    # sync; the twin is a flat FP8 error (MXFP8 in verl #7519)
    _s("engine_low_precision", "warning", (Expect("engine_low_precision", 0),), quant=(0.03, 0.1), quant_jitter=0.6,
       **FP8),
    _s("low_precision_twin", quant=(0.03, 0.03), **FP8),
)


SCENARIO_LIST: tuple[Scenario, ...] = (
    # healthy controls
    _s("healthy_onpolicy", stale=0, engine=False),
    HEALTHY,
    _s("healthy_long", **LONG),
    _s("healthy_long_hard", manifest="verl_k3", hard_frac=0.01, **LONG),
    # one scenario per cause
    _s("k3_blowup", "unstable", (Expect("k3_weight_blowup", 150),), collapse_from=150),
    _s("clamp_dead_zone_k3", "warning", (Expect("clamp_dead_zone", 150),), **CLAMP),
    _s("clamp_dead_zone_k3_clamped", "warning", (Expect("clamp_dead_zone", 150),),
       **{**CLAMP, "manifest": "verl_hook"}),
    _s("offpolicy_drift", "warning", (Expect("offpolicy_drift", 150),), drift_from=150),
    _s("engine_mismatch_jump", "warning", (Expect("engine_mismatch", 150),), mismatch_from=150),
    _s("engine_mismatch_ramp", "warning", (Expect("engine_mismatch", 100, 10),), mismatch_from=100, mismatch_ramp=20),
    # the temperature is there from step 0: named within 2 steps of it (the fit set keeps every step)
    _s("engine_temperature_0.7", "warning", (Expect("engine_temperature_mismatch", 0, 2),), temperature=0.7),
    _s("engine_temperature_1.2", "warning", (Expect("engine_temperature_mismatch", 0, 2),), temperature=1.2),
    _s("numerical_fault", "unstable", (Expect("numerical_fault", 150),), nan_from=150),
    _s("entropy_collapse", "warning", (Expect("entropy_collapse", 100, 25),), **ENTROPY),
    # two causes at once
    _s("temperature_1.2+blowup", "unstable",
       (Expect("engine_temperature_mismatch", 0), Expect("k3_weight_blowup", 150)), temperature=1.2, collapse_from=150),
    _s("drift+numerical_fault", "unstable", (Expect("offpolicy_drift", 100), Expect("numerical_fault", 200)),
       drift_from=100, nan_from=200),
    _s("mismatch+entropy_collapse", "warning", (Expect("engine_mismatch", 60), Expect("entropy_collapse", 150, 25)),
       **{**ENTROPY, "engine": True, "entropy_from": 150}, mismatch_from=60),
    _s("mismatch+clamp_dead_zone", "warning", (Expect("engine_mismatch", 60), Expect("clamp_dead_zone", 180)),
       **{**CLAMP, "collapse_from": 180}, mismatch_from=60),
    # asynchronous staleness (format v1.3's policy_version): measured with versions, an absolute drift level without
    _s("async_staleness", "warning", (Expect("async_staleness", 0),), versions=True, **ASYNC),
    _s("async_stale_unversioned", "warning", (Expect("offpolicy_drift", 0),), **ASYNC),
    _s("async_within_bound", stale_max=2, versions=True),  # 0-2 updates stale on a slowly moving policy: healthy
    # a scenario per rollout cause, each with a healthy twin (ROLLOUT_FAULTS)
    *ROLLOUT_FAULTS,
    # parity contracts and the learning signal, each with a healthy twin
    _s("parity_broken", "unstable", (Expect("parity_broken", 40, 0),), stale=0, true_on_policy=True,
       parity_off_frac=0.02, parity_from=40),
    _s("true_on_policy_exact", stale=0, true_on_policy=True),
    _s("batch_variance", "warning", (Expect("batch_variance", 30, 0),), stale=0, versions=True, batch_noise=1e-3,
       batch_from=30),
    _s("onpolicy_versions_exact", stale=0, versions=True),
    _s("kl_dominated_signal", "warning", (Expect("kl_dominated_signal", 100),), dead_share=0.8, dead_from=100),
    _s("dead_groups_few", dead_share=0.15, dead_from=100),
)
SCENARIOS: dict[str, Scenario] = {s.name: s for s in SCENARIO_LIST}
# Blow-ups with a lead-up, for the early-warning lead times (bench/early_warning.py); not in the suite above. The
# filler ids sink by 0 -> collapse_shift nats over collapse_ramp steps from step 100, so K3's weight on them climbs
# for a while before it passes the blow-up limit; the cause must be named inside the ramp.
RAMP_LIST: tuple[Scenario, ...] = (
    _s("k3_blowup_ramp30", "unstable", (Expect("k3_weight_blowup", 115, 15),), collapse_from=100, collapse_ramp=30),
    _s("k3_blowup_ramp100", "unstable", (Expect("k3_weight_blowup", 150, 50),), collapse_from=100, collapse_ramp=100),
    _s("temperature_1.2+blowup_ramp60", "unstable",
       (Expect("engine_temperature_mismatch", 0), Expect("k3_weight_blowup", 130, 30)), temperature=1.2,
       collapse_from=100, collapse_ramp=60),
)
RAMP_SCENARIOS: dict[str, Scenario] = {s.name: s for s in RAMP_LIST}
TEST_SIZE = dict(seqs=8, group=4, min_len=24, max_len=48)  # what tests/test_truth_suite.py shrinks runs to


# ---- per-step schedules --------------------------------------------------------------------------


def _entropy(z: np.ndarray) -> np.ndarray:
    lp = _log_softmax(z)
    return -(np.exp(lp) * lp).sum(-1)


def _sharpness(sc: Scenario, rng: np.random.Generator) -> np.ndarray:
    """b(t): the logit multiplier that makes pi_theta's mean entropy fall geometrically from its
    start to entropy_end over entropy_steps steps from entropy_from (1 elsewhere)."""
    b = np.ones(sc.steps)
    if sc.entropy_from is None:
        return b
    z = sc.logit_scale * rng.standard_normal((2048, sc.vocab)) + sc.ref_gap[1] * rng.standard_normal((2048, sc.vocab))
    z[:, :sc.filler] += sc.ref_bonus
    grid = np.geomspace(1.0, 1000.0, 240)
    h = np.array([_entropy(z * x).mean() for x in grid])  # decreasing in x
    t = np.clip((np.arange(sc.steps) - sc.entropy_from) / sc.entropy_steps, 0.0, 1.0)
    target = h[0] * (sc.entropy_end / h[0]) ** t
    return np.interp(-target, -h, grid)


def _ramp(t: np.ndarray, start: int | None, steps: int) -> np.ndarray:
    """0 before `start`, then up linearly to 1 over `steps` steps (1 from `start` on when steps <= 1)."""
    return np.clip((t - (start or 0) + 1) / max(steps, 1), 0.0, 1.0)


def schedule(sc: Scenario, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Per-step arrays [steps]: gap, hard, stale, shift, sharp, noise, temp, nan (the truth of the run)."""
    t = np.arange(sc.steps)

    def after(k: int | None) -> np.ndarray:
        return t >= k if k is not None else np.zeros(sc.steps, bool)

    gap = np.interp(t, [0, sc.steps - 1], sc.ref_gap)
    hard = rng.random(sc.steps) < sc.hard_frac
    noise = np.full(sc.steps, sc.engine_noise)
    if sc.mismatch_from is not None:
        ramp = np.clip((t - sc.mismatch_from + 1) / max(sc.mismatch_ramp, 1), 0.0, 1.0)
        noise = np.where(after(sc.mismatch_from), sc.engine_noise + ramp * (sc.mismatch_noise - sc.engine_noise), noise)
    if sc.quant is not None:  # its own stream: the other scenarios' draws stay as they were
        jitter = np.random.default_rng(sc.seed + 46).lognormal(0.0, sc.quant_jitter, sc.steps)
        noise = np.interp(t, [0, sc.steps - 1], sc.quant) * jitter
    return {"gap": gap, "hard": np.where(hard, sc.hard_shift, 0.0),
            "stale": np.where(after(sc.drift_from), sc.drift_stale, sc.stale).astype(np.int64),
            "shift": np.where(after(sc.collapse_from), sc.collapse_shift * _ramp(t, sc.collapse_from, sc.collapse_ramp),
                              0.0),
            "sharp": _sharpness(sc, rng), "noise": noise,
            "temp": np.where(t >= sc.temperature_from, sc.temperature, 1.0),
            "nan": np.where(after(sc.nan_from), sc.nan_per_step, 0)}


# ---- the maths -----------------------------------------------------------------------------------


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (nearest even), as an engine holding bf16 logits does."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def _mix(h: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Fold x into the hashes h (splitmix64 round, wrapping): the context key of a prefix."""
    with np.errstate(over="ignore"):
        z = (h ^ x.astype(np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
        return z ^ (z >> np.uint64(29))


def generate(sc: Scenario) -> dict[str, Any]:
    """Every token of the run as [steps * seqs, max_len] arrays (NaN/0 beyond each completion)."""
    rng = np.random.default_rng(sc.seed)
    sch = schedule(sc, rng)
    n, T, V, F = sc.steps * sc.seqs, sc.max_len, sc.vocab, sc.filler
    step = np.repeat(np.arange(sc.steps), sc.seqs)
    group = step * (sc.seqs // sc.group) + (np.arange(n) % sc.seqs) // sc.group
    length = rng.integers(sc.min_len, sc.max_len + 1, n)
    out = {k: np.full((n, T), np.nan, np.float32) for k in ("logp", "logp_old", "logp_ref", "logp_sampler", "entropy")}
    tok = np.zeros((n, T), np.int64)
    h = _mix(np.full(n, sc.seed + 1, np.uint64), group)
    stale = sch["stale"][step]
    if sc.stale_max is not None:  # drawn only here: the other scenarios' random streams stay as they were
        stale = rng.integers(0, sc.stale_max + 1, n // sc.group)[group]  # a group is generated at once
    old_step = np.maximum(step - stale, 0)
    rx = np.random.default_rng(sc.seed + 4646)  # mixed-version draws: the other scenarios' streams stay as they were
    change = np.where(rx.random(n // sc.group)[group - group.min()] < sc.mixed_frac,
                      rx.integers(1, np.maximum(length, 2)), T + 1) if sc.mixed_frac else np.full(n, T + 1)
    for pos in range(T):
        rows = np.flatnonzero(pos < length)
        keys, inv = np.unique(h[rows], return_inverse=True)
        inv = inv.reshape(-1)
        draw = {k: rng.standard_normal((len(keys), V))[inv] for k in ("z0", "g", "u", "e")}
        s, so = step[rows], old_step[rows]
        z0 = sc.logit_scale * draw["z0"]
        z0[:, :F] += sc.ref_bonus
        base = z0 + sch["gap"][s, None] * draw["g"]  # the batch's prompts decide how far training moved them
        base[:, :F] -= sch["hard"][s, None]
        theta = base.copy()
        theta[:, :F] -= sch["shift"][s, None]
        theta *= sch["sharp"][s, None]
        old = base.copy()
        old[:, :F] -= sch["shift"][so, None]
        old = old * sch["sharp"][so, None] - (stale[rows] * sc.update)[:, None] * draw["u"]
        lp_theta, lp_old, lp_ref = _log_softmax(theta), _log_softmax(old), _log_softmax(z0)
        served = old if sc.wrong_from is None else np.where((s >= sc.wrong_from)[:, None], z0, old)
        noise = sch["noise"][s, None] * draw["e"]
        moved = pos >= change[rows]
        if moved.any():  # the engine's weights moved one update on mid-rollout; the KV cache is the old weights'
            served = served + np.where(moved[:, None], sc.update * rx.standard_normal((len(keys), V))[inv], 0.0)
            noise = noise + np.where(moved[:, None], sc.mixed_noise * rx.standard_normal((len(keys), V))[inv], 0.0)
        lp_mu = _log_softmax((bf16(served) + noise) / sch["temp"][s, None])
        sampler = lp_mu if sc.engine else lp_old
        cdf = np.cumsum(np.exp(sampler), axis=1)
        x = np.minimum((cdf < rng.random(len(rows))[:, None] * cdf[:, -1:]).sum(1), V - 1)
        at = (np.arange(len(rows)), x)
        for name, lp in (("logp", lp_theta), ("logp_old", lp_old), ("logp_ref", lp_ref), ("logp_sampler", lp_mu)):
            out[name][rows, pos] = lp[at]
        out["entropy"][rows, pos] = -(np.exp(lp_theta) * lp_theta).sum(1)
        tok[rows, pos] = x
        h[rows] = _mix(_mix(h[rows], x.astype(np.uint64) + np.uint64(1)), np.full(len(rows), pos, np.uint64))
    mask = np.arange(T)[None, :] < length[:, None]
    for s_ in np.flatnonzero(sch["nan"]):  # a numerical fault: NaN in the trainer's log-prob of a few tokens
        r, p = np.nonzero(mask[s_ * sc.seqs:(s_ + 1) * sc.seqs])
        pick_ = rng.choice(len(r), min(int(sch["nan"][s_]), len(r)), replace=False)
        out["logp"][s_ * sc.seqs + r[pick_], p[pick_]] = np.nan
    reward = rng.random(n) < 0.5
    _contracts(sc, out, mask, step, reward, rng)
    g_r = reward.reshape(-1, sc.group).astype(np.float64)
    adv = ((g_r - g_r.mean(1, keepdims=True)) / (g_r.std(1, keepdims=True) + 1e-4)).reshape(-1)
    version = step - stale
    if sc.mixed_frac:  # per token: one version up from the change on
        version = version[:, None] + (np.arange(T)[None, :] >= change[:, None])
    return {**out, "token_ids": tok, "mask": mask, "group_ids": group, "advantages": adv.astype(np.float32),
            "step": step, "schedule": sch, "policy_version": version, "version_change": change}


def _contracts(sc: Scenario, out: dict, mask: np.ndarray, step: np.ndarray, reward: np.ndarray,
               rng: np.random.Generator) -> None:
    """The issue-46 pathologies, in place, each drawing only when set (the other scenarios' streams stay): a
    true on-policy engine (mu = pi_old, a share of tokens off), batch variance (pi_theta != pi_old on-policy),
    dead groups (all-equal rewards in a share of the groups)."""
    if sc.true_on_policy:
        out["logp_sampler"][:] = out["logp_old"]
        off = mask & (step[:, None] >= sc.parity_from) & (rng.random(mask.shape) < sc.parity_off_frac)
        out["logp_sampler"][off] -= np.float32(sc.parity_off)
    if sc.batch_noise:
        on = mask & (step[:, None] >= sc.batch_from)
        noisy = out["logp_old"] + np.float32(sc.batch_noise) * rng.standard_normal(mask.shape).astype(np.float32)
        out["logp"][on] = np.minimum(noisy, 0.0)[on]
    if sc.dead_share:
        groups = reward.reshape(-1, sc.group)
        dead = (rng.random(len(groups)) < sc.dead_share) & (step[::sc.group] >= sc.dead_from)
        groups[dead] = groups[dead, :1]  # every completion gets the first one's reward


def make_run(run_dir: str | Path, sc: Scenario) -> Path:
    """Write the scenario's run with kldiag.Recorder (one record() per micro-batch); returns run_dir."""
    m = MANIFESTS[sc.manifest]
    data = generate(sc)
    has_ref = bool(m["beta"])
    has_old = sc.engine or sc.stale > 0 or sc.drift_from is not None or bool(sc.stale_max)
    per = -(-sc.seqs // sc.micro_batches)
    with Recorder(run_dir, beta=m["beta"], estimator=m["estimator"], clip_range=m["clip_range"],
                         trainer=m["trainer"], trainer_version=m["trainer_version"],
                         config={**m["config"], "truth_scenario": sc.name,
                                 **({"rollout_dtype": sc.rollout_dtype} if sc.rollout_dtype else {}),
                                 **({"true_on_policy": True} if sc.true_on_policy else {})},
                         tags=["kldiag.tools.truth"]) as rec:
        for s in range(sc.steps):
            for k in range(sc.micro_batches):
                r = slice(s * sc.seqs + k * per, min((s + 1) * sc.seqs, s * sc.seqs + (k + 1) * per))
                rec.record(step=s, micro=k, logp=data["logp"][r], logp_old=data["logp_old"][r] if has_old else None,
                           logp_ref=data["logp_ref"][r] if has_ref else None,
                           logp_sampler=data["logp_sampler"][r] if sc.engine else None,
                           advantages=data["advantages"][r], mask=data["mask"][r], token_ids=data["token_ids"][r],
                           group_ids=data["group_ids"][r], entropy=data["entropy"][r],
                           policy_version=data["policy_version"][r] if sc.versions else None)
    return Path(run_dir)


def small(sc: Scenario, **size: Any) -> Scenario:
    """The scenario with fewer tokens per step (TEST_SIZE unless given); long runs keep their size."""
    return sc if sc.steps > 1000 else replace(sc, **(size or TEST_SIZE))


def _cause_onsets(diagnosis) -> dict[str, int | None]:
    return {c.cause: c.onset for c in diagnosis.causes}


def check(sc: Scenario, diagnosis) -> list[str]:
    """What is wrong with `diagnosis` for `sc` (empty: verdict, causes and onsets as expected)."""
    found, wrong = _cause_onsets(diagnosis), []
    if diagnosis.verdict != sc.verdict:
        wrong.append(f"verdict {diagnosis.verdict}, expected {sc.verdict}")
    for e in sc.expect:
        if e.cause not in found:
            wrong.append(f"no {e.cause} (expected onset {e.onset})")
        elif found[e.cause] is None or abs(found[e.cause] - e.onset) > e.tol:
            wrong.append(f"{e.cause} onset {found[e.cause]}, expected {e.onset} +/- {e.tol}")
    extra = sorted(set(found) - {e.cause for e in sc.expect})
    wrong += [f"extra cause {c} (onset {found[c]})" for c in extra]
    return wrong


def run_and_diagnose(sc: Scenario, run_dir: str | Path):
    """make_run, analyze (with the diagnosis's reducers), diagnose: returns the Diagnosis."""
    make_run(run_dir, sc)
    return diagnose(analyze(run_dir, AnalysisConfig(), diagnosis_reducers()))

