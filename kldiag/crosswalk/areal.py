"""AReaL's staleness and drift metrics, recomputed from the recorded tokens.

From areal 1.0.4 (PyPI wheel). `grpo_loss_fn` (`areal/trainer/ppo/actor.py` l. 408-596) runs per micro-batch
inside the stats_tracker scope "ppo_actor/update" and logs, as token statistics (`/avg`, `/min`, `/max`
over every micro-batch of the step and every data-parallel rank, `areal/utils/stats_tracker.py`):

- `compute_logp/kl_div_{direct,taylor,dual}` = -r, r^2/2, e^r - 1 - r with r = pi_theta - old
  (l. 1045-1061), over the loss mask, or the rejection-sampling mask (`behave_mask`) when on; logged only
  when the batch has `versions` (every rollout of AReaL's workflows has them);
- `behave_imp_weight` and `behave_approx_kl` = pi_prox - old, over the behave mask, with
  `actor.rejection_sampling` only (`areal/utils/functional/functional.py` `ppo_actor_loss_fn` l. 536-558,
  `apply_rejection_sampling` l. 185-427);
- `rs_filtered_fraction`: a scalar per micro-batch, averaged over the step's micro-batches.

"old" is what the loss gets as `input_data["logprobs"]`: the engine's log-probs mu, except with
`recompute_logprob` and no `use_decoupled_loss`, where `compute_advantages` overwrites them with the recomputed
pi_old (actor.py l. 178-190); pi_prox is the recomputed pi_old with the decoupled loss, else that same "old".
kldiag's AReaL hook records pi_prox as logp_old and the engine's mu (kept before the overwrite) as logp_sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.crosswalk.batch import StepBatch

NAME = "areal"
NEEDS_ALL_ITERATIONS = True  # rs_filtered_fraction is a mean over the step's loss calls
STATS = ("avg", "min", "max")
KL_DIV = ("kl_div_direct", "kl_div_taylor", "kl_div_dual")
PREFIX = "ppo_actor/update/"
NO_SAMPLER = "the run has no logp_sampler (the engine's log-probs, AReaL's rollout `logprobs`)"
NO_PROX = ("the run has no logp_old (AReaL's proximal log-probs: with prox_logp_method=loglinear they are "
           "approximated inside the loss and not recorded)")
RS_OFF = "actor.rejection_sampling is off: AReaL logs behave_* and rs_filtered_fraction only with it"
M2 = "actor.m2_threshold: M2PO re-masks the tokens inside the loss, which kldiag does not reproduce"


@dataclass(frozen=True)
class Settings:
    """AReaL's `actor.*` keys that decide these metrics (defaults: areal/api/cli_args.py)."""

    recompute_logprob: bool = False
    use_decoupled_loss: bool = False
    rs_level: str | None = None  # actor.rejection_sampling.level token | sequence; None: off
    rs_action: str = "mask"  # mask | clamp
    rs_metric: str = "ratio"  # ratio | kl_k1 | kl_k2 | kl_k3
    rs_agg: str = "mean"  # sum | mean | max (sequence level)
    rs_upper: float = 2.0
    rs_lower: float | None = None
    m2_threshold: float | None = None

    def __post_init__(self) -> None:
        for name, value, allowed in (("rs_level", self.rs_level, (None, "token", "sequence")),
                                     ("rs_action", self.rs_action, ("mask", "clamp")),
                                     ("rs_metric", self.rs_metric, ("ratio", "kl_k1", "kl_k2", "kl_k3")),
                                     ("rs_agg", self.rs_agg, ("sum", "mean", "max"))):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}")
        if self.rs_level is not None and self.rs_action == "clamp" and self.rs_metric != "ratio":
            raise ValueError("AReaL refuses this configuration (RejectionSamplingConfig): action='clamp' only "
                             "supports metric='ratio'")


def _metric(prox: np.ndarray, old: np.ndarray, metric: str) -> np.ndarray:
    lr = prox - old
    if metric == "ratio":
        return np.exp(lr)
    return {"kl_k1": lr, "kl_k2": lr ** 2 / 2.0, "kl_k3": np.exp(-lr) - 1 + lr}[metric]


def _in_bounds(x: np.ndarray, s: Settings) -> np.ndarray:
    return (x >= s.rs_lower) & (x <= s.rs_upper) if s.rs_lower is not None else x <= s.rs_upper


def rejection(prox: np.ndarray, old: np.ndarray, mask: np.ndarray, s: Settings) -> tuple[np.ndarray, np.ndarray, float]:
    """(behave_imp_weight [B, T], updated mask [B, T], filtered fraction) of apply_rejection_sampling; rows are
    sequences (the packed and padded forms agree per sequence)."""
    lr = np.where(np.isfinite(prox - old), prox - old, 0.0)
    metric = np.exp(lr) if s.rs_metric == "ratio" else _metric(prox, old, s.rs_metric)
    weight = np.exp(lr)
    low = s.rs_lower if s.rs_lower is not None else 0.0
    if s.rs_level == "sequence":
        geometric = s.rs_metric == "ratio"
        vals = np.where(mask, lr if geometric else metric, 0.0)
        count = np.maximum(mask.sum(-1, keepdims=True), 1)
        if geometric:
            weight = np.broadcast_to(np.exp(vals.sum(-1, keepdims=True) / count), lr.shape)
        if s.rs_agg == "sum":
            agg = vals.sum(-1, keepdims=True)
        elif s.rs_agg == "mean":
            agg = vals.sum(-1, keepdims=True) / count
        else:
            agg = np.where(mask, lr if geometric else metric, -np.inf).max(-1, keepdims=True)
            agg = np.where(mask.sum(-1, keepdims=True) == 0, 0.0, agg)
        ok = np.broadcast_to(_in_bounds(np.exp(agg) if geometric else agg, s), mask.shape)
        clamped = np.where(~ok, np.clip(weight, low, s.rs_upper), weight) if s.rs_action == "clamp" else weight
    else:
        ok = _in_bounds(metric, s)
        clamped = np.clip(weight, low, s.rs_upper) if s.rs_action == "clamp" else weight
    total = max(int(mask.sum()), 1)
    if s.rs_action == "mask":
        new_mask, fraction = mask & ok, int((mask & ~ok).sum()) / total
    else:
        new_mask, fraction = mask, int((mask & (clamped != weight)).sum()) / total
    return np.where(new_mask, clamped, 0.0), new_mask, fraction


def _token_stats(name: str, x: np.ndarray, mask: np.ndarray, out: dict) -> None:
    if mask.any():
        v = x[mask]
        out.update({f"{PREFIX}{name}/avg": float(v.mean()), f"{PREFIX}{name}/min": float(v.min()),
                    f"{PREFIX}{name}/max": float(v.max())})


def call_arrays(c: StepBatch, s: Settings) -> dict[str, np.ndarray | float]:
    """One loss call's arrays: r (pi_theta - old), the kl_div mask, and with rejection sampling the
    behave weight, pi_prox - old, the behave mask and the filtered fraction."""
    old = c.logp_old if s.recompute_logprob and not s.use_decoupled_loss else c.logp_sampler
    out: dict = {"r": c.logp - old, "kl_mask": c.mask}
    if s.rs_level is not None:
        weight, new_mask, fraction = rejection(c.logp_old, old, c.mask, s)
        behave = (weight > 0) & new_mask
        out.update(weight=weight, approx=c.logp_old - old, behave=behave, kl_mask=behave, fraction=fraction)
    return out


def step_metrics(b: StepBatch, s: Settings, calls: list[StepBatch] | None = None):
    """AReaL's metrics of one step from its loss calls (module doc)."""
    names = metric_names(s)
    if s.m2_threshold is not None:
        return {}, {n: M2 for n in names}
    calls = [c for c in (calls or [b]) if len(c.seq)]
    need_sampler = not (s.recompute_logprob and not s.use_decoupled_loss) or s.rs_level is not None
    if need_sampler and not all(np.isfinite(c.logp_sampler[c.mask]).all() for c in calls):
        return {}, {n: NO_SAMPLER for n in names}
    if not all(np.isfinite(c.logp_old[c.mask]).all() for c in calls):
        return {}, {n: NO_PROX for n in names}
    arrays = [call_arrays(c, s) for c in calls]
    out: dict[str, float] = {}

    def cat(key: str, mask_key: str) -> tuple[np.ndarray, np.ndarray]:
        return (np.concatenate([a[key][a[mask_key]] for a in arrays]),
                np.ones(sum(int(a[mask_key].sum()) for a in arrays), bool))

    r, m = cat("r", "kl_mask")
    for name, x in zip(KL_DIV, (-r, r ** 2 / 2.0, np.exp(r) - 1 - r)):
        _token_stats(f"compute_logp/{name}", x, m, out)
    why = {}
    if s.rs_level is None:
        why = {n: RS_OFF for n in names if "/behave_" in n or n.endswith("rs_filtered_fraction")}
    else:
        w, m = cat("weight", "behave")
        _token_stats("behave_imp_weight", w, m, out)
        k, m = cat("approx", "behave")
        _token_stats("behave_approx_kl", k, m, out)
        out[PREFIX + "rs_filtered_fraction"] = float(np.mean([a["fraction"] for a in arrays]))
    return out, why


def metric_names(s: Settings) -> list[str]:
    names = [f"{PREFIX}compute_logp/{k}/{st}" for k in KL_DIV for st in STATS]
    names += [f"{PREFIX}{k}/{st}" for k in ("behave_imp_weight", "behave_approx_kl") for st in STATS]
    return names + [PREFIX + "rs_filtered_fraction"]
