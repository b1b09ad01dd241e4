"""The KL penalty as slime computes and logs it (run manifest `config.kl_semantics = "slime"`).

Per token, slime/utils/ppo_utils.py `compute_approx_kl` (THUDM/slime@624b824a, l. 12-51):
with log_ratio = s - r, k1 = log_ratio, k2 = log_ratio**2 / 2, k3 and low_var_kl =
exp(-log_ratio) - 1 + log_ratio; with --use-unbiased-kl the value is multiplied by
rho = exp(log_probs - old_log_probs) (loss.py l. 1118-1121; rho not detached, applied to
every estimator); then only low_var_kl is clamped to [-10, 10], after the multiply. k3 is
never clamped.

Per step: `kl_loss = sum_of_sample_mean(kl)` per micro-batch (cp_utils.py l. 47-124: each
sample's masked sum over max(its denominator, 1)), summed over micro-batches and DP ranks and
divided by the step's global batch size (loss.py l. 1353-1386), i.e. the mean over
samples of each sample's masked mean (`kl`); with --calculate-per-token-loss the masked sum
over sum(max(mask sum, 1)) (`kl_token_mean`). kldiag's step is slime's rollout id: the two
agree when a rollout is one optimizer step (--num-steps-per-rollout 1) and every sample is
its own rollout (rollout_mask_sums = its own mask sum, slime/ray/rollout.py l. 686-700).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from kldiag.analysis.core import keyed

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
COLUMNS = ["step", "seq", "logp", "logp_old", "logp_ref", "mask"]


def approx_kl(s: np.ndarray, r: np.ndarray, kl_loss_type: str, rho: np.ndarray | None = None) -> np.ndarray:
    """slime's per-token KL value, float64 [N] (s = log_probs, r = ref_log_probs)."""
    s, r = np.asarray(s, np.float64), np.asarray(r, np.float64)
    log_ratio = s - r
    with np.errstate(over="ignore", invalid="ignore"):
        if kl_loss_type == "k1":
            kl = log_ratio
        elif kl_loss_type == "k2":
            kl = log_ratio**2 / 2.0
        elif kl_loss_type in ("k3", "low_var_kl"):
            kl = np.exp(-log_ratio) - 1 + (log_ratio)
        else:
            raise ValueError(f"kl_loss_type={kl_loss_type!r}; pass one of {', '.join(KL_TYPES)} (slime "
                             "--kl-loss-type)")
        if rho is not None:
            kl = rho * kl
    if kl_loss_type == "low_var_kl":
        kl = np.clip(kl, -10.0, 10.0)
    return kl


def unbiased_rho(s: np.ndarray, o: np.ndarray) -> np.ndarray:
    """rho = exp(log_probs - old_log_probs), float64 (1 where o is s: on-policy)."""
    with np.errstate(over="ignore"):
        return np.exp(np.asarray(s, np.float64) - np.asarray(o, np.float64))


def batch_sums(batch: pa.RecordBatch, kl_loss_type: str, unbiased: bool) -> keyed.Keyed:
    """Per (step, seq) of one batch: sum of kl * mask, mask count, rows."""
    col = {name: batch.column(name) for name in COLUMNS}
    s = col["logp"].to_numpy(zero_copy_only=False)
    r = col["logp_ref"].fill_null(np.nan).to_numpy(zero_copy_only=False)
    o = np.where(col["logp_old"].is_null().to_numpy(zero_copy_only=False), s,
                 col["logp_old"].fill_null(0.0).to_numpy(zero_copy_only=False))
    mask = col["mask"].to_numpy(zero_copy_only=False).astype(bool)
    o = np.where(mask, o, s)  # outside the loss a dump's logp_old may be a placeholder (0.0, NaN): rho = 1 there
    kl = approx_kl(s, r, kl_loss_type, unbiased_rho(s, o) if unbiased else None)
    with np.errstate(invalid="ignore"):
        contrib = np.where(mask, kl, 0.0)  # slime multiplies by the mask: 0 * inf would be NaN there too
        contrib = np.where(mask | np.isfinite(kl), contrib, np.nan)
    return keyed.reduce_by_key({"step": col["step"].to_numpy(), "seq": col["seq"].to_numpy(),
                                "sum_kl": contrib, "n_mask": mask.astype(np.int64),
                                "n_ref": (~np.isnan(r)).astype(np.int64)})


def trainer_kl(run: Any, config: dict[str, Any], batch_size: int = 1 << 20) -> pa.Table:
    """step, kl (slime's train/kl_loss), kl_token_mean (with --calculate-per-token-loss), sequences.

    Streams the run's rows (memory: one batch plus one row per sequence). A step without
    reference log-probs has null values.
    """
    kl_type = str(config.get("kl_loss_type") or "k1")  # slime's --kl-loss-type default
    unbiased = bool(config.get("use_unbiased_kl"))
    parts = [batch_sums(b, kl_type, unbiased) for b in run.iter_batches(COLUMNS, batch_size=batch_size)]
    seqs = keyed.reduce_by_key(keyed.concat([p for p in parts if p])) if any(parts) else {}
    if not seqs:
        return pa.table({"step": pa.array([], pa.int64()), "kl": pa.array([], pa.float64()),
                         "kl_token_mean": pa.array([], pa.float64()), "sequences": pa.array([], pa.int64())})
    with np.errstate(invalid="ignore", divide="ignore"):
        per_seq = seqs["sum_kl"] / np.maximum(seqs["n_mask"], 1)
    has_ref = seqs["n_ref"] > 0
    steps = keyed.reduce_by_key({"step": seqs["step"], "sum_mean": np.where(has_ref, per_seq, 0.0),
                                 "sum_kl": np.where(has_ref, seqs["sum_kl"], 0.0),
                                 "n_tokens": np.where(has_ref, np.maximum(seqs["n_mask"], 1), 0),
                                 "n_seq": has_ref.astype(np.int64)})
    with np.errstate(invalid="ignore", divide="ignore"):
        kl = np.where(steps["n_seq"] > 0, steps["sum_mean"] / np.maximum(steps["n_seq"], 1), np.nan)
        tok = np.where(steps["n_tokens"] > 0, steps["sum_kl"] / np.maximum(steps["n_tokens"], 1), np.nan)
    return pa.table({"step": pa.array(steps["step"]), "kl": pa.array(kl, mask=np.isnan(kl)),
                     "kl_token_mean": pa.array(tok, mask=np.isnan(tok)), "sequences": pa.array(steps["n_seq"])})
