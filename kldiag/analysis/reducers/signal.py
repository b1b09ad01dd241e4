"""The learning signal: GRPO groups whose rewards are all equal, and how much of the update the KL term carries.

GRPO's advantage of a completion is its reward normalised within its prompt group (Shao et al. 2024,
DeepSeekMath, eq. 3: A_i = (r_i - mean(r)) / std(r); TRL 1.16 grpo_trainer.py
`_generate_and_score_completions`), so a group whose rewards are all equal (zero variance) gives every
completion A = 0. The GRPO objective per token is

    J = min(rho A, clip(rho, 1 - eps, 1 + eps) A) - beta * K(pi_theta || pi_ref),   rho = pi_theta / pi_old

and its gradient with respect to log pi_theta(x_t) has the weights rho A (policy gradient; clipped tokens 0)
and beta * w_K (the KL estimator's gradient weight, kldiag.estimators.weight: 1 - pi_ref/pi_theta for K3).
On a dead group's tokens only the KL term is left: the update pulls them back toward pi_ref and nothing else.

`SignalReducer` (the reducer protocol, reduce.py) folds every loss token into one row per (step, group,
seq) with: tokens; tokens with |A| <= SPREAD_TOL (moved by the KL term alone); the max and min advantage
(a group is dead when its spread max - min is <= SPREAD_TOL over two or more sequences, as
kldiag.views.groups judges it); sum |A rho| (the policy-gradient weight mass, rho = 1 where logp_old is
null); and sum |w_K| for every estimator of kldiag.estimators (the run's beta and estimator are applied
when read: `per_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa

from kldiag import estimators as E
from kldiag.analysis.core import keyed
from kldiag.analysis.kernels import signal as SK
from kldiag.analysis.kernels.ride import SignalRide
from kldiag.analysis.reducers.base import ListReducer, all_valid, column, readonly

SPREAD_TOL = 1e-6  # rewards (advantages) closer than this count as equal
KEYS = ("step", "group", "seq")
NO_GROUP = -1


def _wsum(name: str) -> str:
    return f"sum_w_{name}"


def weights_abs(logp: np.ndarray, ref: np.ndarray, old: np.ndarray) -> dict[str, np.ndarray]:
    """|gradient weight| [n] of every estimator of kldiag.estimators (`E.weight(name, ...)`, equal to it:
    tests/test_diagnosis_signal.py), from one log-ratio and one exp shared between them: the formulas the compiled
    pass (signal_kernel.signal_rows) applies per token."""
    d = logp - ref  # log pi_theta / pi_ref
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        e = np.exp(-d)  # pi_ref / pi_theta
        k3 = np.abs(-np.expm1(-d))
        k3_value = e + d - 1.0  # k3 = exp(r) - r - 1 at r = -d
        out = {"k1": np.where(np.isnan(ref), np.nan, 1.0), "k2": np.abs(d), "k3": k3,
               "k3_is": np.abs(np.exp(logp - old) * d), "k3_clamped": np.where(k3_value > E.CLAMP, 0.0, k3),
               "kl_rev": np.abs(d * e)}
    return {name: out[name] for name in E.ESTIMATORS}


def batch_partial(batch: pa.RecordBatch) -> dict[str, np.ndarray] | None:
    """One row per run of (step, group, seq) of the batch's loss tokens (module docstring; one compiled loop,
    signal_kernel.signal_rows); None when the batch has no loss token with an advantage."""
    i = batch.schema.get_field_index("advantage")
    if i < 0 or batch.column(i).null_count == batch.num_rows:  # no advantage: no row, and no pass to find none
        return None
    cols = [column(batch, name, fill, dt, copy=False) for name, fill, dt in (
        ("step", 0, np.int64), ("group", NO_GROUP, np.int64), ("seq", 0, np.int64), ("mask", False, bool),
        ("advantage", np.nan, np.float32), ("logp", np.nan, np.float32), ("logp_old", np.nan, np.float32),
        ("logp_ref", np.nan, np.float32))]
    (step, _), (group, _), (seq, _), (mask, _), (adv, ok_a), (logp, ok_s), (old, ok_o), (ref, ok_r) = cols
    keys, cnt, val = SK.signal_rows(step, group, seq, mask, adv, ok_a, logp, ok_s, old, ok_o, ref, ok_r,
                                    SPREAD_TOL, E.CLAMP)
    return rows_partial(keys[:, 0], keys[:, 1], keys[:, 2], cnt, val)


def rows_partial(step: np.ndarray, group: np.ndarray, seq: np.ndarray, cnt: np.ndarray,
                 val: np.ndarray) -> dict[str, np.ndarray] | None:
    """The partial of signal_kernel.signal_rows' rows (keys [r], counts [r, 3], values [r, 9]); None for no row."""
    if not len(step):
        return None
    out = {"step": step, "group": group, "seq": seq, "n_tokens": cnt[:, 0],
           "n_kl_alone": cnt[:, 1], "n_ref": cnt[:, 2], "max_adv": val[:, 0], "min_adv": val[:, 1],
           "sum_pg": val[:, 2]}
    out.update({_wsum(name): val[:, 3 + j] for j, name in enumerate(SK.ESTIMATOR_ORDER)})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def ride_inputs(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """(group int64 [n], nulls as NO_GROUP; an all-true bool [n]), both read-only whatever the column held (numba
    compiles the ridden pass once per writeable flag): fused_ride.SignalRide.inputs."""
    group = column(batch, "group", NO_GROUP, np.int64, copy=False)[0]
    return readonly(np.ascontiguousarray(group)), all_valid(batch.num_rows)


def ridden_partial(b, starts: np.ndarray, group: np.ndarray, cnt: np.ndarray,
                   val: np.ndarray) -> dict[str, np.ndarray] | None:
    """batch_partial's rows from the ridden pass's per-sequence rows (fused_ride.SignalRide.take: one sequence of
    kernel.Batch b per entry of starts[:-1], one group in each), those with a loss token."""
    keep = cnt[:, 0] > 0
    at = starts[:-1][keep]
    return rows_partial(b.step[at].astype(np.int64), group[at], b.seq[at].astype(np.int64), cnt[keep], val[keep])


def empty() -> dict[str, np.ndarray]:
    out = {k: np.zeros(0, np.int64) for k in (*KEYS, "n_tokens", "n_kl_alone", "n_ref")}
    out.update({k: np.zeros(0) for k in ("max_adv", "min_adv", "sum_pg", *(_wsum(n) for n in E.ESTIMATORS))})
    return out


def merge_partials(partials) -> dict[str, np.ndarray]:
    partials = [p for p in partials if p is not None and len(p.get("step", ()))]
    return keyed.reduce_by_key(keyed.concat(partials)) if partials else empty()


@dataclass(frozen=True)
class SignalReducer(ListReducer):
    """The learning-signal rows (module docstring)."""

    name: str = "signal"
    rides: ClassVar[str] = "analysis"  # with the Estimators page's reducer, its tokens summed in that pass
    version: int = 5  # 3: the compiled pass (kernels/signal.py); 4: its runs summed by a vectorised loop; 5: riding
    columns: tuple[str, ...] = ("step", "seq", "group", "mask", "logp", "logp_old", "logp_ref", "advantage")

    def settings(self) -> dict:
        return {"spread_tol": SPREAD_TOL, "estimators": list(E.ESTIMATORS)}

    def partial(self, batch: pa.RecordBatch) -> dict[str, np.ndarray] | None:
        return batch_partial(batch)

    def ride(self, state: list) -> SignalRide:
        """Its per-token work in the analysis's compiled pass when the Estimators page's rides there too
        (K.PartFold, stats.batch_partials): each batch's partial from that pass (`ridden_partial`), equal to
        batch_partial's, its sums to rounding (tests/test_fused_ride.py)."""
        def take(b, starts, group, cnt, val) -> None:
            p = ridden_partial(b, starts, group, cnt, val)
            if p is not None:
                state.append(p)
        return SignalRide(SPREAD_TOL, E.CLAMP, ride_inputs, take, lambda batch: self.add(state, batch))

    def merge(self, partials) -> dict[str, np.ndarray]:
        return merge_partials(partials)


# ---- what faces read --------------------------------------------------------------------------


def groups(m: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One row per (step, group) with a known group id: sequences, tokens, spread, dead (zero spread over two
    or more sequences)."""
    known = m["group"] != NO_GROUP
    g = keyed.reduce_by_key({"step": m["step"][known], "group": m["group"][known],
                             "n_seqs": np.ones(int(known.sum()), np.int64), "n_tokens": m["n_tokens"][known],
                             "max_adv": m["max_adv"][known], "min_adv": m["min_adv"][known]})
    spread = g["max_adv"] - g["min_adv"]
    return {**g, "spread": spread, "dead": (g["n_seqs"] > 1) & (np.abs(spread) <= SPREAD_TOL)}


def _share(a: np.ndarray, n: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, a / np.where(n > 0, n, 1), np.nan)


def _aligned(keys: np.ndarray, values: np.ndarray, on: np.ndarray) -> np.ndarray:
    """values (keyed by the sorted `keys`) at each of `on`, 0 where a key is absent."""
    if not len(keys):
        return np.zeros(len(on), values.dtype)
    at = np.minimum(np.searchsorted(keys, on), len(keys) - 1)
    return np.where(keys[at] == on, values[at], 0)


def per_step(m: dict[str, np.ndarray], beta: float, estimator: str) -> dict[str, np.ndarray]:
    """Per step: groups judged (two or more sequences), dead groups and their share; loss tokens, those moved by
    the KL term alone (|A| <= SPREAD_TOL) and their share; the policy-gradient weight mass sum |A rho|, the KL
    term's beta * sum |w_K| and its share of the two (NaN where the run records no pi_ref or beta is 0)."""
    g = groups(m)
    judged = g["n_seqs"] > 1
    gs = keyed.reduce_by_key({"step": g["step"], "n_groups": judged.astype(np.int64),
                              "n_dead": g["dead"].astype(np.int64)})
    s = keyed.reduce_by_key({"step": m["step"], "n_tokens": m["n_tokens"], "n_kl_alone": m["n_kl_alone"],
                             "n_ref": m["n_ref"], "sum_pg": m["sum_pg"], "sum_w": m[_wsum(estimator)]})
    steps = s["step"]
    n_groups, n_dead = (_aligned(gs["step"], gs[k], steps) for k in ("n_groups", "n_dead"))
    kl = np.where((s["n_ref"] > 0) & (beta > 0), beta * s["sum_w"], np.nan)
    return {"step": steps, "groups": n_groups, "dead_groups": n_dead,
            "dead_group_share": _share(n_dead.astype(np.float64), n_groups.astype(np.float64)),
            "tokens": s["n_tokens"], "kl_alone_tokens": s["n_kl_alone"],
            "kl_alone_share": _share(s["n_kl_alone"].astype(np.float64), s["n_tokens"].astype(np.float64)),
            "pg_mass": s["sum_pg"], "kl_mass": kl, "kl_mass_share": _share(kl, kl + s["sum_pg"])}


def dead_groups_at(m: dict[str, np.ndarray], step: int, k: int = 8) -> list[int]:
    """The ids of up to k dead groups of `step`."""
    g = groups(m)
    return [int(x) for x in g["group"][(g["step"] == step) & g["dead"]][:k]]


def _num(v: Any) -> float | None:
    return float(v) if v is not None and np.isfinite(v) else None


def summary(m: dict[str, np.ndarray], beta: float, estimator: str) -> dict[str, Any]:
    """The learning-signal figures as JSON-ready rows (`kldiag analyze --json` "signal"; docs/metrics.md)."""
    ps = per_step(m, beta, estimator)
    rows = [{"step": int(s), "groups": int(ps["groups"][i]), "dead_groups": int(ps["dead_groups"][i]),
             **{k: _num(ps[k][i]) for k in ("dead_group_share", "kl_alone_share", "kl_mass_share")}}
            for i, s in enumerate(ps["step"])]
    return {"groups": bool(np.sum(ps["groups"])), "beta": beta, "estimator": estimator,
            "dead_group_share_mean": _num(np.nanmean(ps["dead_group_share"])) if np.isfinite(
                ps["dead_group_share"]).any() else None,
            "kl_mass_share_mean": _num(np.nanmean(ps["kl_mass_share"])) if np.isfinite(
                ps["kl_mass_share"]).any() else None, "steps": rows}
