"""MoE routing agreement between the inference engine and the trainer, and the mismatch it carries.

Reads the format v1.3 route columns (kldiag.record.routes: per token, the MoE layers whose expert sets
differ between engine and trainer, those the engine left unrouted, the mean set overlap). Over tokens in
the loss, with o = logp_old (logp where null: on-policy) and m = logp_sampler (the engine's log mu):

    routed     the trainer routed the token on at least one layer (route_layers > 0)
    compared   routed, and the engine's routes were recorded beside the trainer's (route_differ not null):
               a run that recorded one side only compares nothing, and its shares below are null
    disagree   its expert set differs on at least one layer (route_differ > 0); agree: routed, none differs
    missing    the engine has no route on a layer the trainer routed (route_missing > 0)
    mismatch   |m - o| = |log mu - log pi_old|, where both are finite
    k3         the mismatch KL(mu || pi_old) per token, K3 on tokens drawn from mu: r - log r - 1, r = pi_old/mu
    is         the importance ratio r = pi_old / mu (its mean and max)
    kl share   sum of k3 over disagreeing tokens / over routed tokens: the share of the mismatch KL they carry

And over every token in the loss with finite logp and m, D = log pi_train - log mu (logp - m), the two
figures of AReaL's open PR #1207 (areal-project/AReaL, `rollout_train_k3_kl`, `rollout_train_extreme_frac_tau2`):
mean(exp(D) - 1 - D) and the share of tokens with |D| > ln 2.

`RoutingReducer` (the reducer protocol, reduce.py) keeps per step the sums of these figures and per
(step, layer) the tokens whose expert sets differ / are missing; merging adds them, so a cached or
parallel pass equals a serial one exactly. `summary()` turns them into JSON-ready figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag import format as F
from kldiag.analysis.reducers.base import column as _col
from kldiag.analysis.reducers.base import num as _num
from kldiag.analysis.reducers.base import ratio
from kldiag.analysis.runtime.runner import reduced

LN2 = float(np.log(2.0))
SIDES = ("agree", "disagree")
SUMS = ("tokens", "routed", "compared", "disagree", "missing", "overlap_sum", "overlap_n", "areal_n", "areal_k3",
        "areal_extreme", *(f"{s}_{k}" for s in SIDES for k in ("n", "abs", "k3", "is")))
# layers_max: the most MoE layers a token had
MAXES = (*(f"{s}_{k}" for s in SIDES for k in ("abs_max", "is_max")), "layers_max")
OVERLAP_BINS = ("0", "(0, 0.5)", "[0.5, 1)", "1")  # a token's mean set overlap over its compared layers
LAYER_SETS = ("differ", "missing")  # per (step, layer): tokens whose set differs / whose engine route is missing



def _layer_hits(batch: pa.RecordBatch, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row index, layer) of every layer listed in list column `name` at the rows where `rows` is True."""
    i = batch.schema.get_field_index(name)
    if i < 0 or not rows.any():
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    col = batch.column(i)
    lengths = pc.fill_null(pc.list_value_length(col), 0).to_numpy(zero_copy_only=False).astype(np.int64)
    lengths = np.where(rows, lengths, 0)
    flat = pc.list_flatten(col.filter(pa.array(rows))).to_numpy(zero_copy_only=False).astype(np.int64)
    return np.repeat(np.arange(len(rows)), lengths), flat


def batch_partial(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    """The sums of one record batch, per step (module docstring)."""
    step, _ = _col(batch, "step", 0, np.int64)
    mask, _ = _col(batch, "mask", False, bool)
    logp, ok_p = _col(batch, "logp", 0.0, np.float64)
    old, ok_o = _col(batch, "logp_old", 0.0, np.float64)
    mu, ok_m = _col(batch, "logp_sampler", 0.0, np.float64)
    layers, _ = _col(batch, F.ROUTE_LAYERS, 0, np.int64)
    differ, ok_d = _col(batch, F.ROUTE_DIFFER, 0, np.int64)
    missing, _ = _col(batch, F.ROUTE_MISSING, 0, np.int64)
    overlap, ok_v = _col(batch, F.ROUTE_OVERLAP, np.nan, np.float64)
    old = np.where(ok_o, old, logp)
    steps, idx = np.unique(step[mask], return_inverse=True)
    s = len(steps)

    def add(sel: np.ndarray, x: Any = 1.0) -> np.ndarray:
        return np.bincount(idx, weights=np.broadcast_to(np.where(sel, x, 0.0), sel.shape).astype(float), minlength=s)

    def mx(sel: np.ndarray, x: np.ndarray) -> np.ndarray:
        out = np.full(s, -np.inf)
        np.maximum.at(out, idx[sel], x[sel])
        return out

    with np.errstate(over="ignore", invalid="ignore"):
        lm, lo, lp = mu[mask], old[mask], logp[mask]
        finite = ok_m[mask] & np.isfinite(lm) & np.isfinite(lo)
        log_r = np.where(finite, lo - lm, 0.0)
        r = np.exp(log_r)
        k3 = np.where(finite, r - log_r - 1.0, 0.0)
        routed = layers[mask] > 0
        compared = routed & ok_d[mask]  # both sides recorded
        dis = compared & (differ[mask] > 0)
        d = np.where(ok_m[mask] & np.isfinite(lm) & np.isfinite(lp), lp - lm, np.nan)
        out = {"step": steps, "tokens": add(np.ones(len(idx), bool)), "routed": add(routed), "compared": add(compared),
               "disagree": add(dis), "missing": add(compared & (missing[mask] > 0)),
               "layers_max": mx(routed, layers[mask].astype(np.float64))}
        ov = overlap[mask]
        has_ov = routed & ok_v[mask] & np.isfinite(ov)
        out.update(overlap_sum=add(has_ov, np.where(has_ov, ov, 0.0)), overlap_n=add(has_ov))
        bins = np.digitize(ov, [1e-9, 0.5, 1.0 - 1e-9])
        out["overlap_hist"] = np.stack([add(has_ov & (bins == b)) for b in range(len(OVERLAP_BINS))], 1)
        ad = np.isfinite(d)
        out.update(areal_n=add(ad), areal_k3=add(ad, np.where(ad, np.expm1(d) - d, 0.0)),
                   areal_extreme=add(ad & (np.abs(np.where(ad, d, 0.0)) > LN2)))
        for side, sel in (("agree", compared & ~dis & finite), ("disagree", dis & finite)):
            out.update({f"{side}_n": add(sel), f"{side}_abs": add(sel, np.abs(log_r)), f"{side}_k3": add(sel, k3),
                        f"{side}_is": add(sel, r), f"{side}_abs_max": mx(sel, np.abs(log_r)),
                        f"{side}_is_max": mx(sel, r)})
    sel_rows = np.zeros(batch.num_rows, bool)
    for name in LAYER_SETS:
        sel_rows[:] = mask & (layers > 0)
        row, layer = _layer_hits(batch, dict(zip(LAYER_SETS, F.ROUTE_LAYER_SETS, strict=True))[name], sel_rows)
        width = int(layer.max()) + 1 if len(layer) else 0
        grid = np.zeros((s, width))
        if len(layer):
            step_of_row = np.full(batch.num_rows, -1)
            step_of_row[mask] = idx
            np.add.at(grid, (step_of_row[row], layer), 1.0)
        out[f"layer_{name}"] = grid
    return out


def _widen(a: np.ndarray, width: int) -> np.ndarray:
    return np.pad(a, ((0, 0), (0, width - a.shape[1]))) if a.shape[1] < width else a


def merge_partials(partials) -> dict[str, np.ndarray]:
    """Sum per step (max for the maxima), union the steps, widen the layer grids to the widest."""
    partials = [p for p in partials if len(p["step"])]
    if not partials:
        return batch_partial(pa.RecordBatch.from_pydict({"step": pa.array([], pa.int64())}))
    uniq, inv = np.unique(np.concatenate([p["step"] for p in partials]), return_inverse=True)
    out: dict[str, np.ndarray] = {"step": uniq}
    for k in (*SUMS, "overlap_hist"):
        acc = np.zeros((len(uniq), *partials[0][k].shape[1:]))
        np.add.at(acc, inv, np.concatenate([p[k] for p in partials]))
        out[k] = acc
    for k in MAXES:
        acc = np.full(len(uniq), -np.inf)
        np.maximum.at(acc, inv, np.concatenate([p[k] for p in partials]))
        out[k] = acc
    for name in LAYER_SETS:
        width = max(p[f"layer_{name}"].shape[1] for p in partials)
        acc = np.zeros((len(uniq), width))
        np.add.at(acc, inv, np.concatenate([_widen(p[f"layer_{name}"], width) for p in partials]))
        out[f"layer_{name}"] = acc
    return out


@dataclass(frozen=True)
class RoutingReducer:
    """Per-step routing agreement and the mismatch on agreeing vs disagreeing tokens (module docstring)."""

    name: str = "routing"
    version: int = 3  # 2: batches without routes leave no partial; 3: compared tokens, layers_max
    columns: tuple[str, ...] = ("step", "mask", "logp", "logp_old", "logp_sampler", *F.ROUTE_SUMMARY,
                                *F.ROUTE_LAYER_SETS)

    def settings(self) -> dict:
        return {"ln2": LN2, "overlap_bins": list(OVERLAP_BINS)}

    def start(self, part) -> list:
        return []

    def add(self, state: list, batch: pa.RecordBatch) -> None:
        # a batch without routes (every run before format v1.3, every dense model) costs no per-token work
        names = batch.schema.names
        if batch.num_rows and F.ROUTE_LAYERS in names and batch.column(F.ROUTE_LAYERS).null_count < batch.num_rows:
            state.append(batch_partial(batch))

    def finish(self, state: list, dropped: int) -> dict[str, np.ndarray]:
        return self.merge(state)

    def merge(self, partials) -> dict[str, np.ndarray]:
        return merge_partials(partials)


# ---- what faces read --------------------------------------------------------------------------




def _side(m: dict[str, np.ndarray], side: str, sl: Any = slice(None)) -> dict[str, Any]:
    """The mismatch figures of agreeing or disagreeing tokens over the steps `sl`."""
    n = m[f"{side}_n"][sl].sum()
    return {"tokens": int(n), "mismatch_abs_mean": _num(ratio(m[f"{side}_abs"][sl].sum(), n)),
            "mismatch_abs_max": _num(np.max(m[f"{side}_abs_max"][sl], initial=-np.inf)),
            "k3_mean": _num(ratio(m[f"{side}_k3"][sl].sum(), n)), "is_mean": _num(ratio(m[f"{side}_is"][sl].sum(), n)),
            "is_max": _num(np.max(m[f"{side}_is_max"][sl], initial=-np.inf))}


def _share(m: dict[str, np.ndarray], sl: Any = slice(None)) -> float | None:
    """The share of the mismatch KL (sum of k3) carried by tokens routed differently."""
    dis, agree = m["disagree_k3"][sl].sum(), m["agree_k3"][sl].sum()
    return _num(ratio(dis, dis + agree))


def _step_row(m: dict[str, np.ndarray], i: int, width: int) -> dict[str, Any]:
    compared = m["compared"][i]  # the shares are of the tokens both sides routed: none when one side is missing
    a, d = _side(m, "agree", slice(i, i + 1)), _side(m, "disagree", slice(i, i + 1))
    return {"step": int(m["step"][i]), "tokens": int(m["tokens"][i]), "routed": int(m["routed"][i]),
            "compared": int(compared), "differ_share": _num(ratio(m["disagree"][i], compared)),
            "missing_share": _num(ratio(m["missing"][i], compared)),
            "overlap_mean": _num(ratio(m["overlap_sum"][i], m["overlap_n"][i])),
            "agree_mismatch_abs_mean": a["mismatch_abs_mean"], "disagree_mismatch_abs_mean": d["mismatch_abs_mean"],
            "agree_k3_mean": a["k3_mean"], "disagree_k3_mean": d["k3_mean"],
            "kl_share_disagree": _share(m, slice(i, i + 1)),
            "areal_k3_mean": _num(ratio(m["areal_k3"][i], m["areal_n"][i])),
            "areal_extreme_frac": _num(ratio(m["areal_extreme"][i], m["areal_n"][i])),
            "differ_share_by_layer": [_num(v) for v in ratio(_widen(m["layer_differ"], width)[i], compared)],
            "missing_share_by_layer": [_num(v) for v in ratio(_widen(m["layer_missing"], width)[i], compared)]}


ENGINE_MISSING = ("only the trainer's routes were recorded: the engine's were not, so nothing was compared and "
                  "routing agreement is not measured. Record the engine's routes too (experts_sampler= in "
                  "Recorder.record, from the engine's returned routed experts: vLLM and SGLang return them when "
                  "routing replay is on)")


def layer_count(m: dict[str, np.ndarray]) -> int:
    """The layer axis: the widest layer list seen, and at least as many layers as a token was routed on (a
    layer where no token differs appears in no list but is still routed)."""
    most = np.max(m["layers_max"], initial=0.0) if len(m["layers_max"]) else 0.0
    return max(m["layer_differ"].shape[1], m["layer_missing"].shape[1], int(most) if np.isfinite(most) else 0)


def summary(m: dict[str, np.ndarray]) -> dict[str, Any]:
    """The routing figures as JSON-ready values (`kldiag analyze --json` "routing"; docs/metrics.md).

    `routed` is False for a run without routes (dense, or recorded without them): the per-step AReaL
    figures are still given where the engine's log-probs are recorded. A run that recorded the trainer's
    routes only (`sides`: engine False) has `compared_tokens` 0, agreement and the shares null, and
    `not_compared` says which side is missing and how to record it."""
    routed, compared = float(m["routed"].sum()), float(m["compared"].sum())
    width = layer_count(m)
    differ, missing = (_widen(m[f"layer_{n}"], width).sum(0) for n in LAYER_SETS)
    return {"routed": routed > 0, "tokens": int(m["tokens"].sum()), "routed_tokens": int(routed),
            "compared_tokens": int(compared), "sides": {"trainer": routed > 0, "engine": compared > 0},
            "not_compared": ENGINE_MISSING if routed and not compared else None,
            "agreement": _num(1.0 - ratio(m["disagree"].sum(), compared)) if compared else None,
            "differ_share": _num(ratio(m["disagree"].sum(), compared)),
            "missing_share": _num(ratio(m["missing"].sum(), compared)),
            "overlap_mean": _num(ratio(m["overlap_sum"].sum(), m["overlap_n"].sum())),
            "overlap_hist": dict(zip(OVERLAP_BINS, (int(v) for v in m["overlap_hist"].sum(0)), strict=True)),
            "agree": _side(m, "agree"), "disagree": _side(m, "disagree"), "kl_share_disagree": _share(m),
            "areal_k3_mean": _num(ratio(m["areal_k3"].sum(), m["areal_n"].sum())),
            "areal_extreme_frac": _num(ratio(m["areal_extreme"].sum(), m["areal_n"].sum())),
            "layers": [{"layer": i, "differ_share": _num(ratio(differ[i], compared)),
                        "missing_share": _num(ratio(missing[i], compared))} for i in range(width)],
            "steps": [_step_row(m, i, width) for i in range(len(m["step"]))]}


def routing_of(analysis, reducer: RoutingReducer | None = None) -> dict[str, Any]:
    """summary() of an analysed run: from the analysis's own read when it was made with the reducer
    (diagnosis.core.reducers() lists it), else one more pass over the parts lacking a cached partial."""
    return summary(reduced(analysis, reducer or RoutingReducer()))
