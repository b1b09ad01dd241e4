"""verl's KL / importance-sampling / mismatch metrics, recomputed from the recorded tokens.

Ported to float64 numpy from verl 0.9.1 (PyPI wheel):
- `rollout_corr/*`: verl/trainer/ppo/rollout_corr_helper.py `compute_rollout_correction_and_rejection_mask`
  (IS weights `compute_rollout_correction_weights` + `compute_is_metrics`, rejection
  `compute_rollout_rejection_mask` + `compute_rs_metrics`, `compute_offpolicy_metrics`), with
  old_log_prob = pi_old (logp_old) and rollout_log_prob = mu (logp_sampler), as
  `compute_rollout_correction_and_add_to_batch` passes them (batch "old_log_probs", "rollout_log_probs").
- `training/rollout_probs_diff_*`, `training/rollout_actor_probs_pearson_corr`: verl/utils/debug/metrics.py
  `calculate_debug_metrics` (probability space: |exp(old) - exp(rollout)|).
- `actor/kl_loss`: verl/workers/utils/losses.py `ppo_loss` -> core_algos.py `kl_penalty` + `agg_loss` on
  pi_theta and pi_ref over the step's batch (verl logs the mean over its mini-batches; equal when a step
  is one mini-batch); on a run the verl hook recorded, exactly verl's reduction (`run_overrides`).
Settings are verl's `algorithm.rollout_correction.*` and `actor_rollout_ref.actor.*` keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kldiag.analysis.core.verl_kl import kl_loss_by_step
from kldiag.crosswalk.batch import StepBatch, masked_sum
from kldiag.crosswalk.batch import masked_mean as _mean
from kldiag.frameworks import family
from kldiag.frameworks.verl import agg_loss, kl_penalty

NAME = "verl"
SAFETY_BOUND = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
NO_SAMPLER = ("the run has no logp_sampler (the rollout engine's log-probs): record them "
              "(verl: actor_rollout_ref.rollout.calculate_log_probs=True)")
NO_REF = "the run has no logp_ref (reference log-probs): verl computes actor/kl_loss only with use_kl_loss"


@dataclass(frozen=True)
class Settings:
    """verl's config keys (defaults: verl/trainer/config/algorithm/rollout_correction.yaml, actor.yaml)."""

    rollout_is: str | None = None  # "token" | "sequence" | None
    rollout_is_threshold: str | float = 2.0  # "lower_upper" string: IcePop band
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # comma-separated RS_OPTIONS
    rollout_rs_threshold: str | float | None = None
    kl_loss_type: str = "low_var_kl"
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm; None: the batch's padded length

    def __post_init__(self) -> None:
        why = refusal(self)
        if why:
            raise ValueError(f"verl refuses this configuration (rollout_corr_helper.py): {why}")


def refusal(s: Settings) -> str | None:
    """Why verl 0.9.1 would raise on these settings (`compute_rollout_correction_weights`,
    `_parse_rollout_is_threshold`, `compute_rollout_rejection_mask`, `_parse_rollout_rs_thresholds`), or None."""
    if s.rollout_is is not None:
        if s.rollout_is not in ("token", "sequence"):
            return f"rollout_is={s.rollout_is!r}: use token, sequence or null"
        try:
            upper, lower = parse_is_threshold(s.rollout_is_threshold)
        except ValueError:
            return f"rollout_is_threshold={s.rollout_is_threshold!r}: write UPPER or LOWER_UPPER, e.g. 2.0 or 0.5_2.0"
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            return f"rollout_is_threshold={s.rollout_is_threshold!r}: bounds must be positive with lower <= upper"
    if s.rollout_rs is None:
        return None
    opts = list(dict.fromkeys(o.strip() for o in str(s.rollout_rs).split(",") if o.strip()))
    bad = [o for o in opts if o not in RS_OPTIONS]
    if bad or not opts:
        return f"rollout_rs={s.rollout_rs!r}: each option must be one of {', '.join(RS_OPTIONS)}"
    if s.rollout_rs_threshold is None:
        return "rollout_rs needs rollout_rs_threshold (set e.g. rollout_rs_threshold=0.01)"
    specs = [str(s.rollout_rs_threshold)] if isinstance(s.rollout_rs_threshold, (int, float)) else [
        p.strip() for p in str(s.rollout_rs_threshold).split(",") if p.strip()]
    if any("_" in spec for o, spec in zip(opts, specs * len(opts), strict=False) if not o.endswith("k1")):
        return "rollout_rs_threshold: only k1 options take LOWER_UPPER; give the others one upper bound"
    try:
        bounds = parse_rs_thresholds(opts, s.rollout_rs_threshold)
    except (ValueError, ZeroDivisionError) as e:
        return f"rollout_rs_threshold={s.rollout_rs_threshold!r}: {e}"
    if any(hi <= 0 or (lo is not None and not 0 < lo <= hi) for lo, hi in bounds.values()):
        return f"rollout_rs_threshold={s.rollout_rs_threshold!r}: bounds must be positive with lower <= upper"
    return None


def mm(x, mask, axis=None):
    """verl_F.masked_mean: sum(x*mask) / (mask.sum() + 1e-8)."""
    return _mean(x, mask, axis, eps=1e-8)


def masked_max(x, mask) -> float:
    return float(np.max(np.where(mask, x, -np.inf)))


def masked_min(x, mask) -> float:
    return float(np.min(np.where(mask, x, np.inf)))


def _std(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1)) if x.size > 1 else 0.0


def parse_is_threshold(spec) -> tuple[float, float | None]:
    """(upper, lower or None) as `_parse_rollout_is_threshold`: "0.5_2.0" gives an IcePop band."""
    if isinstance(spec, str) and "_" in spec:
        lo, hi = spec.split("_", 1)
        return float(hi), float(lo)
    return float(spec), None


def parse_rs_thresholds(options: list[str], spec) -> dict[str, tuple[float | None, float]]:
    """{option: (lower or None, upper)} as `_parse_rollout_rs_thresholds` (k1: ratio bounds, lower 1/upper)."""
    raw = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(raw) == 1:
        raw = raw * len(options)
    if len(raw) != len(options):
        raise ValueError("rollout_rs_threshold: give one threshold, or one per rollout_rs option")
    out = {}
    for opt, s in zip(options, raw, strict=True):
        if opt.endswith("k1"):
            lo, hi = s.split("_", 1) if "_" in s else (str(1.0 / float(s)), s)
            out[opt] = (float(lo), float(hi))
        else:
            out[opt] = (None, float(s))
    return out


def is_metrics(log_ratio: np.ndarray, mask: np.ndarray, s: Settings) -> dict[str, float]:
    """`compute_rollout_correction_weights` + `compute_is_metrics` (log_ratio = old - rollout, [B, T])."""
    upper, lower = parse_is_threshold(s.rollout_is_threshold)
    mf = mask.astype(np.float64)
    if s.rollout_is == "token":
        lr_metrics = log_ratio
        raw = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    elif s.rollout_is == "sequence":
        lr_metrics = masked_sum(log_ratio, mask, axis=-1)[:, None]
        raw = np.broadcast_to(np.exp(np.clip(lr_metrics, -SAFETY_BOUND, SAFETY_BOUND)), log_ratio.shape)
    else:
        raise ValueError(f"rollout_is={s.rollout_is!r}: use token, sequence or null (verl rollout_corr_helper)")
    raw = raw * mf
    w = np.minimum(raw, upper) if lower is None else np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    lo = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {}
    if s.rollout_is == "sequence":
        m["rollout_is_max"] = math.exp(min(float(lr_metrics.max()), SAFETY_BOUND))
        m["rollout_is_min"] = math.exp(float(lr_metrics.min()))
        m["rollout_is_mean"] = float(mm(w, mask))
        m["rollout_is_ratio_fraction_high"] = float(np.mean(lr_metrics > math.log(upper)))
        m["rollout_is_ratio_fraction_low"] = float(np.mean(lr_metrics < math.log(lo)))
    else:
        m["rollout_is_mean"] = float(mm(w, mask))
        m["rollout_is_ratio_fraction_high"] = float(mm((raw > upper).astype(float), mask))
        m["rollout_is_ratio_fraction_low"] = float(mm((raw < lo).astype(float), mask))
        m["rollout_is_max"], m["rollout_is_min"] = masked_max(w, mask), masked_min(w, mask)
    wc = np.clip(w, 0.0, upper)
    if mask.sum() > 1:
        m["rollout_is_std"] = math.sqrt(max(float(mm(wc**2, mask) - mm(wc, mask) ** 2), 0.0))
    else:
        m["rollout_is_std"] = 0.0
    m["rollout_is_eff_sample_size"] = float(1.0 / mm((wc / (mm(wc, mask) + 1e-8)) ** 2, mask))
    seq_w = mm(w, mask, axis=-1)
    m.update({"rollout_is_seq_mean": float(seq_w.mean()), "rollout_is_seq_std": _std(seq_w),
              "rollout_is_seq_max": float(seq_w.max()), "rollout_is_seq_min": float(seq_w.min()),
              "rollout_is_seq_max_deviation": float(np.abs(seq_w - 1.0).max())})
    raw_seq = mm(raw, mask, axis=-1)
    m["rollout_is_seq_fraction_high"] = float(np.mean(raw_seq > upper))
    m["rollout_is_seq_fraction_low"] = float(np.mean(raw_seq < lo))
    if lower is not None:
        m["rollout_is_oob_ratio"] = float(mm(((raw < lower) | (raw > upper)).astype(float), mask))
    if s.rollout_is_batch_normalize:
        if s.rollout_is == "token":
            wm = float(mm(w, mask))
        else:
            seq_valid = (mask.sum(-1) > 0).astype(float)
            wm = float((mm(w, mask, axis=-1) * seq_valid).sum() / max(seq_valid.sum(), 1e-8))
        m["rollout_is_batch_norm_factor"] = wm if wm > 1e-8 else 1.0
    return m


def _seq_stat(kind: str, token_stat: np.ndarray, mask: np.ndarray) -> np.ndarray:
    if kind == "sum":
        return masked_sum(token_stat, mask, axis=-1)
    if kind == "mean":
        return mm(token_stat, mask, axis=-1)
    mx = np.max(np.where(mask, token_stat, -np.inf), axis=-1)
    return np.where(mx == -np.inf, 0.0, mx)


def rs_option_metrics(opt: str, stat: np.ndarray, seq_values: np.ndarray | None, mask: np.ndarray,
                      thr: float, thr_lo: float, apply_lo: bool) -> dict[str, float]:
    """`compute_rs_metrics` for one option (stat [B, T]; seq_values [B] for sequence-level options)."""
    p = f"rollout_rs_{opt}"
    seq_valid = mask.sum(-1) > 0
    level_seq = seq_values is not None
    sv = (seq_values if level_seq else mm(stat, mask, axis=-1))[seq_valid]
    m = {f"{p}_mean": float(mm(stat, mask))}
    if level_seq and sv.size:
        m[f"{p}_max"], m[f"{p}_min"] = float(sv.max()), float(sv.min())
        m[f"{p}_fraction_high"] = float(np.mean(sv > thr))
        m[f"{p}_fraction_low"] = float(np.mean(sv < thr_lo)) if apply_lo else 0.0
    else:
        m[f"{p}_max"], m[f"{p}_min"] = masked_max(stat, mask), masked_min(stat, mask)
        m[f"{p}_fraction_high"] = float(mm((stat > thr).astype(float), mask))
        m[f"{p}_fraction_low"] = float(mm((stat < thr_lo).astype(float), mask)) if apply_lo else 0.0
    if mask.sum() > 1:
        c = np.clip(stat, thr_lo if apply_lo else 0.0, thr)
        m[f"{p}_std"] = math.sqrt(max(float(mm(c**2, mask) - mm(c, mask) ** 2), 0.0))
    else:
        m[f"{p}_std"] = 0.0
    if sv.size:
        m.update({f"{p}_seq_mean": float(sv.mean()), f"{p}_seq_std": _std(sv), f"{p}_seq_max": float(sv.max()),
                  f"{p}_seq_min": float(sv.min()), f"{p}_seq_max_deviation": float(np.abs(sv).max()),
                  f"{p}_seq_fraction_high": float(np.mean(sv > thr))})
        if apply_lo:
            m[f"{p}_seq_fraction_low"] = float(np.mean(sv < thr_lo))
    else:
        m.update({f"{p}_{k}": 0.0 for k in ("seq_mean", "seq_std", "seq_max", "seq_min", "seq_max_deviation",
                                           "seq_fraction_high", "seq_fraction_low")})
    return m


def rs_metrics(log_ratio: np.ndarray, mask: np.ndarray, s: Settings) -> tuple[dict[str, float], np.ndarray]:
    """`compute_rollout_rejection_mask`: metrics and the keep mask [B, T] (float 0/1)."""
    opts = list(dict.fromkeys(o.strip() for o in str(s.rollout_rs).split(",") if o.strip()))
    bad = [o for o in opts if o not in RS_OPTIONS]
    if bad or not opts:
        raise ValueError(f"rollout_rs={s.rollout_rs!r}: each option must be one of {', '.join(RS_OPTIONS)}")
    if s.rollout_rs_threshold is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold (verl raises the same)")
    bounds = parse_rs_thresholds(opts, s.rollout_rs_threshold)
    lr = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    token = {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1.0 - lr}
    seq_valid = mask.sum(-1) > 0
    combined = np.ones_like(log_ratio)
    m: dict[str, float] = {}
    for opt in opts:
        lo, hi = bounds[opt]
        k1 = opt.endswith("k1")
        lo_t, hi_t = (math.log(lo), math.log(hi)) if k1 else (None, hi)
        est = token[opt[-2:]]
        if opt.startswith("token"):
            stat, seqv = est, None
            keep = ((stat >= lo_t) & (stat <= hi_t)) if k1 else (stat <= hi_t)
        else:
            seqv = _seq_stat(opt.split("_")[1], est, mask)
            keep_seq = ((seqv >= lo_t) & (seqv <= hi_t)) if k1 else (seqv <= hi_t)
            keep = np.broadcast_to(keep_seq[:, None], mask.shape)
            stat = np.broadcast_to(seqv[:, None], mask.shape)
        m.update(rs_option_metrics(opt, stat, seqv, mask, hi_t, lo_t if k1 else 0.0, k1))
        keep_f = keep.astype(np.float64)
        combined = combined * keep_f
        seq_keep = ~((~keep) & mask).any(-1)
        m[f"rollout_rs_{opt}_masked_fraction"] = float(mm(1 - keep_f, mask))
        m[f"rollout_rs_{opt}_seq_masked_fraction"] = (
            float(((~seq_keep) & seq_valid).sum() / seq_valid.sum()) if seq_valid.any() else 0.0)
    m["rollout_rs_masked_fraction"] = float(mm(1 - combined, mask))
    m["rollout_rs_seq_masked_fraction"] = float((~((combined > 0.5) & mask) & mask).any(-1).mean())
    return m, combined


def offpolicy_metrics(old: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """`compute_offpolicy_metrics` (old = pi_old, rollout = mu; [B, T])."""
    m_train = mm(old, mask, axis=-1)
    m = {"training_ppl": float(np.exp(-m_train).mean()), "training_log_ppl": float((-m_train).mean())}
    lr = old - rollout
    m["kl"] = float(mm(rollout - old, mask))
    with np.errstate(over="ignore"):
        m["k3_kl"] = float(mm(np.exp(lr) - lr - 1, mask))
    m_roll = mm(rollout, mask, axis=-1)
    diff = m_roll - m_train
    m.update({"rollout_ppl": float(np.exp(-m_roll).mean()), "rollout_log_ppl": float((-m_roll).mean()),
              "log_ppl_diff": float(diff.mean()), "log_ppl_abs_diff": float(np.abs(diff).mean()),
              "log_ppl_diff_max": float(diff.max()), "log_ppl_diff_min": float(diff.min()),
              "ppl_ratio": float(np.exp(diff).mean())})
    safe = np.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_token"] = float(mm(np.exp(safe) ** 2, mask) - 1.0)
    seq_sum = np.clip(masked_sum(lr, mask, axis=-1), -SAFETY_BOUND, SAFETY_BOUND)
    m["chi2_seq"] = float(np.exp(2.0 * seq_sum).mean() - 1.0)
    return m


def debug_metrics(old: np.ndarray, rollout: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """verl/utils/debug/metrics.py `calculate_debug_metrics` (probabilities, not log-probs)."""
    p_actor, p_roll = np.exp(old[mask]), np.exp(rollout[mask])
    if not mask.any():
        return {"training/rollout_probs_diff_valid": 0, **{f"training/rollout_probs_diff_{k}": math.nan
                for k in ("max", "mean", "std")}, "training/rollout_actor_probs_pearson_corr": math.nan}
    d = np.abs(p_actor - p_roll)
    with np.errstate(invalid="ignore", divide="ignore"):
        corr = float(np.corrcoef(np.stack([p_actor, p_roll]))[0, 1])
    return {"training/rollout_probs_diff_valid": 1, "training/rollout_probs_diff_max": float(d.max()),
            "training/rollout_probs_diff_mean": float(d.mean()), "training/rollout_probs_diff_std": _std(d),
            "training/rollout_actor_probs_pearson_corr": corr}


def step_metrics(b: StepBatch, s: Settings) -> tuple[dict[str, float | None], dict[str, str]]:
    """(metrics under verl's names, {name: why it is null}) for one step."""
    out: dict[str, float | None] = {}
    why: dict[str, str] = {}
    names = metric_names(s)
    if b.has_sampler:
        rollout = np.where(b.mask, b.logp_sampler, 0.0)
        lr = b.logp_old - rollout
        corr: dict[str, float] = {}
        if s.rollout_is is not None:
            corr.update(is_metrics(lr, b.mask, s))
        if s.rollout_rs is not None:
            corr.update(rs_metrics(lr, b.mask, s)[0])
        corr.update(offpolicy_metrics(b.logp_old, rollout, b.mask))
        out.update({f"rollout_corr/{k}": v for k, v in corr.items()})
        out.update(debug_metrics(b.logp_old, rollout, b.mask))
    else:
        why.update({n: NO_SAMPLER for n in names if not n.startswith("actor/")})
    if b.has_ref:
        out["actor/kl_loss"] = agg_loss(kl_penalty(b.logp, np.where(b.mask, b.logp_ref, 0.0), s.kl_loss_type),
                                        b.mask, s.loss_agg_mode, loss_scale_factor=s.loss_scale_factor)
    else:
        why["actor/kl_loss"] = NO_REF
    return out, why


def run_overrides(run, s: Settings) -> dict[str, dict[int, float]]:
    """For a run the verl hook recorded (trainer "verl": micro = mini-batch * MICRO_SLOTS + micro-batch),
    actor/kl_loss exactly as verl reduces it over micro-batches, DP ranks, mini-batches and epochs
    (kldiag.analysis.core.verl_kl); {} for other runs (the whole-step figure stands)."""
    if family(run.manifest) != "verl":
        return {}
    by_step = kl_loss_by_step(run, s.kl_loss_type, s.loss_agg_mode, s.loss_scale_factor)
    return {"actor/kl_loss": {k: v for k, v in by_step.items() if math.isfinite(v)}}


def metric_names(s: Settings) -> list[str]:
    """The names verl logs for these settings, in its order (for columns that stay null)."""
    names = []
    if s.rollout_is is not None:
        upper, lower = parse_is_threshold(s.rollout_is_threshold)
        names += [f"rollout_is_{k}" for k in ("mean", "ratio_fraction_high", "ratio_fraction_low", "max", "min",
                                              "std", "eff_sample_size", "seq_mean", "seq_std", "seq_max", "seq_min",
                                              "seq_max_deviation", "seq_fraction_high", "seq_fraction_low")]
        names += ["rollout_is_oob_ratio"] if lower is not None else []
        names += ["rollout_is_batch_norm_factor"] if s.rollout_is_batch_normalize else []
    names += ["training_ppl", "training_log_ppl", "kl", "k3_kl", "rollout_ppl", "rollout_log_ppl", "log_ppl_diff",
              "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "chi2_token", "chi2_seq"]
    out = [f"rollout_corr/{n}" for n in names]
    out += [f"training/rollout_probs_diff_{k}" for k in ("valid", "max", "mean", "std")]
    return out + ["training/rollout_actor_probs_pearson_corr", "actor/kl_loss"]
