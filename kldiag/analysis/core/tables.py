"""Final tables from merged partials: steps, sequences, flags, histograms, trainer KL.

Every mean is a ratio of merged sums and counts (docs/metrics.md); a count of zero gives
a null, never a zero and never NaN. Quantiles come from the merged histograms.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from kldiag import estimators as E
from kldiag.analysis.core import around, bins, keyed, slime_kl, spill, verl_kl
from kldiag.analysis.types import (
    ABS_EDGES,
    FLAG_COLUMNS,
    HIST_EDGES,
    OPSM_DELTAS,
    SEQUENCE_COLUMNS,
    STEP_COLUMNS,
    AnalysisConfig,
    Histograms,
    OpsmCounts,
)

HIST_NAMES = ("d", "weight_k3_abs", "weight_k3_is_abs", "rho")
DERIVED_VERSION = 1  # of the per-chunk sums kept beside a chunk file (spill.kept): bump when they change


def ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """num / den, NaN (a null in the table) where den is 0."""
    num, den = np.asarray(num, np.float64), np.asarray(den, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def _nullable(a: np.ndarray) -> pa.Array:
    """float64 array with NaN as null (the tables never hold NaN: a NaN is a missing value)."""
    a = np.asarray(a, np.float64)
    return pa.array(a, mask=np.isnan(a))


def by_step(steps: keyed.Keyed) -> keyed.Keyed:
    """Per-(step, rank) partial rows merged into per-step rows."""
    return keyed.reduce_by_key({k: v for k, v in steps.items() if k != "rank"})


def quantiles(h: np.ndarray, vmax: np.ndarray, q: float) -> np.ndarray:
    """bins.quantile of each step's |weight| histogram h [n_steps, n_bins] (NaN where vmax is NaN)."""
    return bins.quantile_rows(h, ABS_EDGES, q, vmax) if len(h) else np.zeros(0)


def step_table(p: keyed.Keyed, seqs: keyed.Keyed | list, cfg: AnalysisConfig,
               keys: tuple[str, ...] = ("step",)) -> pa.Table:
    """One row per key (step, or step and rank) with the columns of STEP_COLUMNS (+ rows)."""
    n_d = p["n_d"]
    has_d = n_d > 0
    w_max = np.where(has_d, p["max_w"], np.nan)
    w_is_max = np.where(p["n_w_is"] + (p["max_w_is"] == np.inf) > 0, p["max_w_is"], np.nan)
    cols: dict[str, Any] = {k: p[k] for k in keys}
    cols["tokens"] = p["n_tokens"]
    cols["sequences"], masked = sequence_counts(p, seqs, cfg, keys)
    cols.update(k1_mean=ratio(p["sum_k1"], n_d), k2_mean=ratio(p["sum_k2"], n_d),
                k3_mean=ratio(p["sum_k3"], p["n_k3"]), k3_is_mean=ratio(p["sum_k3_is"], p["n_k3_is"]),
                weight_k3_abs_mean=ratio(p["sum_w"], p["n_w"]), weight_k3_abs_max=w_max)
    h_w = p["h_weight_k3_abs"]
    for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999)):
        cols[f"weight_k3_abs_{name}"] = quantiles(h_w, w_max, q)
    cols.update(weight_k3_is_abs_mean=ratio(p["sum_w_is"], p["n_w_is"]), weight_k3_is_abs_max=w_is_max,
                weight_k3_is_abs_p99=quantiles(p["h_weight_k3_is_abs"], w_is_max, 0.99),
                blame_share=blame_share(p["sum_w_flagged"], p["sum_w"], p["n_w"]),
                theta_ll_ref_count=p["n_theta"], weight_blowup_count=p["n_blowup"],
                clamp_saturated_count=p["n_clamp"], nonfinite_count=p["n_nonfinite"],
                invalid_count=p["n_invalid"], flagged_frac=ratio(p["n_flagged"], p["n_tokens"]))
    has_x = p["n_x"] > 0
    rho_sum = p["sum_rho"]
    cols.update(rho_mean=ratio(rho_sum, p["n_rho"]), rho_min=np.where(has_x, p["min_rho"], np.nan),
                rho_max=np.where(has_x, p["max_rho"], np.nan),
                rho_ess=ratio(rho_sum * rho_sum, p["n_rho"] * p["sum_rho2"]),
                rho_clip_frac=ratio(p["n_clip"], p["n_x"]), drift_abs_mean=ratio(p["sum_drift"], p["n_x"]),
                mismatch_kl=ratio(p["sum_mismatch"], p["n_mismatch"]), opsm_masked_frac=masked,
                rows=p["n_rows"])
    names = [*keys, *[c for c in STEP_COLUMNS if c not in keys], "rows"]
    arrays = [_nullable(cols[c]) if np.asarray(cols[c]).dtype.kind == "f" else pa.array(cols[c]) for c in names]
    return pa.table(arrays, names=names)


def blame_share(sum_flagged: np.ndarray, sum_w: np.ndarray, n_w: np.ndarray) -> np.ndarray:
    """Share of the finite |k3 weight| carried by flagged tokens.

    0 when the total weight is 0 (policy equals reference, as at a trainer's first step: no
    weight, so none of it on flagged tokens); null only when no token has a finite weight.
    """
    share = ratio(sum_flagged, sum_w)
    return np.where((n_w > 0) & (sum_w == 0), 0.0, share)


def raw_chunks(seqs: keyed.Keyed | list) -> list:
    """Per-(step, seq) rows as step-ordered, step-disjoint chunks (prefix.Stream hands them over so),
    the non-empty ones; a spilled one (spill.py) is read only by what derives from it, when it must."""
    return [c for c in (seqs if isinstance(seqs, list) else [seqs]) if spill.rows(c)]


def sequence_counts(p: keyed.Keyed, seqs: keyed.Keyed | list[keyed.Keyed], cfg: AnalysisConfig,
                    keys) -> tuple[np.ndarray, np.ndarray]:
    """Per-row number of sequences and the fraction the off-policy sequence mask drops. `seqs`: one
    table or step-disjoint chunks in step order (each reduced alone: integer counts, the same result)."""
    red = spill.kept_all(raw_chunks(seqs), ("counts", tuple(keys), cfg.opsm_delta), lambda k: _counts(k, cfg, keys),
                         DERIVED_VERSION)
    if not red:
        return np.zeros(len(p["step"]), np.int64), np.full(len(p["step"]), np.nan)
    # Align with p's rows (same keys, both sorted); a step may have no sequence row.
    want = np.stack([p[k] for k in keys], 1)
    have = np.stack([red[k] for k in keys], 1)
    out_n, out_m = np.zeros(len(want), np.int64), np.full(len(want), np.nan)
    index = {tuple(r): i for i, r in enumerate(have)}
    for j, r in enumerate(want):
        i = index.get(tuple(r))
        if i is not None:
            out_n[j] = red["n_seq"][i]
            out_m[j] = ratio(red["n_masked"][i], red["n_known"][i])
    return out_n, out_m


def _counts(seqs: keyed.Keyed, cfg: AnalysisConfig, keys) -> keyed.Keyed:
    masked, known = opsm_masked(seqs, cfg.opsm_delta)
    table = {"step": seqs["step"], **({"rank": seqs["first_rank"]} if "rank" in keys else {}),
             "n_seq": np.ones(len(masked), np.int64), "n_known": known.astype(np.int64),
             "n_masked": (masked & known).astype(np.int64)}
    return keyed.reduce_by_key(table)


def opsm_masked(seqs: keyed.Keyed, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek off-policy sequence mask: advantage < 0 and mean(log mu - logp) > delta.

    The mean divides by max(tokens, 1) as TRL does. Returns (masked, known): a sequence
    without an advantage is unknown.
    """
    adv = ratio(seqs["sum_adv"], seqs["n_adv"])
    return E.opsm_drop(adv, seqs["sum_opsm"], seqs["n_opsm"], delta), ~np.isnan(adv)


def opsm_counts(seqs: keyed.Keyed | list, deltas: tuple[float, ...] = OPSM_DELTAS) -> OpsmCounts:
    """The off-policy sequence mask per step at every delta, from the per-(step, seq) rows (one table or
    step-disjoint chunks, each counted alone and remembered with its chunk file: integer counts)."""
    red = spill.kept_all(raw_chunks(seqs), ("opsm", tuple(deltas)), lambda k: _opsm_rows(k, deltas), DERIVED_VERSION)
    if not red:
        z = np.zeros(0, np.int64)
        return OpsmCounts(tuple(deltas), z, z, z, np.zeros((0, len(deltas)), np.int64))
    return OpsmCounts(tuple(deltas), red["step"], red["n_seq"], red["n_known"], red["n_masked"])


def _opsm_rows(seqs: keyed.Keyed, deltas: tuple[float, ...]) -> keyed.Keyed:
    adv = ratio(seqs["sum_adv"], seqs["n_adv"])  # opsm_masked's, once for every delta
    known = ~np.isnan(adv)
    masked = np.stack([E.opsm_drop(adv, seqs["sum_opsm"], seqs["n_opsm"], d) for d in deltas], 1).astype(np.int64)
    return keyed.reduce_by_key({"step": seqs["step"], "n_seq": np.ones(len(known), np.int64),
                                "n_known": known.astype(np.int64), "n_masked": masked.reshape(len(known), -1)})


def sequence_table(s: keyed.Keyed, cfg: AnalysisConfig) -> pa.Table:
    """One row per (step, seq): SEQUENCE_COLUMNS plus tokens, micro, iteration."""
    if not s:
        return pa.table({c: pa.array([], pa.float64()) for c in SEQUENCE_COLUMNS})
    masked, known = opsm_masked(s, cfg.opsm_delta)
    has_d = s["n_k3"] + (s["max_w"] == np.inf) > 0
    cols = {"step": pa.array(s["step"]), "seq": pa.array(s["seq"]),
            "group": pa.array(s["first_group"], mask=s["first_group"] < 0), "rank": pa.array(s["first_rank"]),
            "length": pa.array(s["n_rows"]), "advantage": _nullable(ratio(s["sum_adv"], s["n_adv"])),
            "k3_mean": _nullable(ratio(s["sum_k3"], s["n_k3"])),
            "k3_is_mean": _nullable(ratio(s["sum_k3_is"], s["n_k3_is"])),
            "weight_k3_abs_max": _nullable(np.where(has_d, s["max_w"], np.nan)),
            "weight_k3_is_abs_max": _nullable(np.where(has_d, s["max_w_is"], np.nan)),
            "flagged_count": pa.array(s["n_flagged"]), "nonfinite_count": pa.array(s["n_nonfinite"]),
            "opsm_masked": pa.array(masked, mask=~known), "tokens": pa.array(s["n_tokens"]),
            "micro": pa.array(s["first_micro"]), "iteration": pa.array(s["first_iteration"])}
    table = pa.table(cols)
    if cfg.top_k_sequences is not None and table.num_rows > cfg.top_k_sequences:
        order = np.argsort(-np.nan_to_num(np.where(has_d, s["max_w"], -1.0), nan=-1.0), kind="stable")
        table = table.take(pa.array(np.sort(order[: cfg.top_k_sequences])))
    return table


def histograms(p: keyed.Keyed) -> Histograms:
    """Per-step histograms (merged across ranks)."""
    return Histograms(steps=np.asarray(p["step"]), edges=dict(HIST_EDGES),
                      counts={name: p[f"h_{name}"] for name in HIST_NAMES})


def flag_table(top: keyed.Keyed, bad: keyed.Keyed, vocab: dict[int, str] | None, cfg: AnalysisConfig) -> pa.Table:
    """Worst tokens by |k3 weight| plus the non-finite/invalid ones, with estimators.py values."""
    rows = keyed.concat([t for t in (bad, top) if t])
    if not rows:
        return pa.table({c: pa.array([], pa.float64()) for c in FLAG_COLUMNS})
    key = np.stack([rows[c] for c in ("step", "rank", "seq", "pos", "micro", "iteration")], 1)
    _, first = np.unique(key, axis=0, return_index=True)
    rows = {c: a[np.sort(first)] for c, a in rows.items()}
    s = rows["logp"]
    o = np.where(rows["logp_old_null"], s, rows["logp_old"])
    r = np.where(rows["logp_ref_null"], np.nan, rows["logp_ref"])
    m = np.where(rows["logp_sampler_null"], np.nan, rows["logp_sampler"])
    with np.errstate(all="ignore"):
        vals = {"d": E.log_ratio(s, r), "rho": E.rho(s, o), "k3": E.k3(s, r), "k3_is": E.k3_is(s, r, o),
                "weight_k3": E.weight_k3(s, r), "weight_k3_is": E.weight_k3_is(s, r, o)}
        fl = E.flags(s, r, o, None, cfg.tau, cfg.weight_limit, cfg.clamp)
    present = [x for x, null in ((s, None), (rows["logp_old"], rows["logp_old_null"]), (r, None),
                                 (rows["logp_sampler"], rows["logp_sampler_null"])) if x is not None]
    with np.errstate(invalid="ignore"):
        nonfinite = (~np.isfinite(s) | (~np.isfinite(rows["logp_old"]) & ~rows["logp_old_null"])
                     | (~np.isfinite(r) & ~rows["logp_ref_null"]) | (~np.isfinite(m) & ~rows["logp_sampler_null"]))
        invalid = np.asarray(E.flag_invalid(*present), bool)  # +inf is non-finite, not also invalid
    cols: dict[str, pa.Array] = {c: pa.array(rows[c]) for c in ("step", "seq", "pos", "rank", "micro", "iteration")}
    cols["token_id"] = pa.array(rows["token_id"].astype(np.int32), mask=rows["token_id_null"])
    pieces = [None if (vocab is None or n) else vocab.get(int(t)) for t, n in zip(rows["token_id"],
                                                                                rows["token_id_null"], strict=True)]
    cols["piece"] = pa.array(pieces, pa.string())
    for name in ("logp", "logp_old", "logp_ref", "logp_sampler", "advantage"):
        cols[name] = pa.array(rows[name], mask=rows[f"{name}_null"])
    cols["mask"] = pa.array(rows["mask"])
    for name, v in vals.items():
        cols[name] = pa.array(v, mask=np.isnan(v))
    for name in ("theta_ll_ref", "weight_blowup", "clamp_saturated"):
        cols[name] = pa.array(np.asarray(getattr(fl, name)))
    cols["nonfinite"], cols["invalid"] = pa.array(nonfinite), pa.array(invalid)
    table = pa.table({c: cols[c] for c in FLAG_COLUMNS})
    bad_first = ~(nonfinite | invalid)
    order = np.lexsort([-np.nan_to_num(np.abs(vals["weight_k3"]), nan=-1.0), rows["step"], bad_first])
    return table.take(pa.array(order))


def flag_context(top: keyed.Keyed, bad: keyed.Keyed) -> dict[tuple[int, int, int, int, int], np.ndarray]:
    """(step, rank, seq, iteration, pos) -> the token ids around that flagged token (around.CONTEXT's row)."""
    out = {}
    for t in (bad, top):
        if t and around.CONTEXT in t:
            keys = zip(*(t[c].tolist() for c in ("step", "rank", "seq", "iteration", "pos")), strict=True)
            out.update(zip(keys, t[around.CONTEXT], strict=True))
    return out


def trainer_kl(seqs: keyed.Keyed | list[keyed.Keyed], config: dict[str, Any], run: Any = None) -> pa.Table:
    """The KL the trainer logs. config["kl_semantics"] == "slime" (runs from slime): slime's
    train/kl_loss, computed from the run's rows by analysis.core.slime_kl. Otherwise TRL's:
    per micro-batch masked mean of per-token kl, then mean over micro-batches.

    TRL (GRPOTrainer._compute_loss): kl = exp(r - s) - (r - s) - 1, times coef_1 = exp(s - o)
    when use_bias_correction_kl (per sequence, exp of the masked mean of s - o, when
    importance_sampling_level == "sequence"); per micro-batch sum(kl * mask) / clamp(sum(mask),
    min=1), summed over ranks before dividing; `log` averages the micro-batch values of the
    logging window, skipping NaN.
    """
    empty = pa.table({"step": pa.array([], pa.int64()), "kl": pa.array([], pa.float64()),
                      "micro_batches": pa.array([], pa.int64()), "kl_sum": pa.array([], pa.float64()),
                      "window_end": pa.array([], pa.int64()), "logged_kl": pa.array([], pa.float64())})
    if config.get("kl_semantics") == "slime" and run is not None:
        return slime_kl.trainer_kl(run, config)
    if config.get("kl_semantics") == "verl" and run is not None:  # runs of kldiag.integrations.verl
        return verl_kl.trainer_kl(run, config)
    corrected = bool(config.get("use_bias_correction_kl")) or config.get("estimator") == "k3_is"
    sequence_level = corrected and config.get("importance_sampling_level") == "sequence"
    # a micro-batch's key leads with its step: step-disjoint chunks reduce alone to the same rows
    micro = spill.kept_all(raw_chunks(seqs), ("micro", corrected, sequence_level),
                           lambda k: _micro_sums(k, corrected, sequence_level), DERIVED_VERSION)
    if not micro:
        return empty
    with np.errstate(invalid="ignore"):
        value = micro["sum_num"] / np.maximum(micro["n_den"], 1)
    ok = ~np.isnan(value) & (micro["n_ref"] > 0)
    per_step = keyed.reduce_by_key({"step": micro["step"], "sum_kl": np.where(ok, value, 0.0),
                                    "n_micro": ok.astype(np.int64)})
    kl = ratio(per_step["sum_kl"], per_step["n_micro"])
    table = pa.table({"step": pa.array(per_step["step"]), "kl": _nullable(kl),
                      "micro_batches": pa.array(per_step["n_micro"]), "kl_sum": pa.array(per_step["sum_kl"])})
    return with_logging_windows(table, int(config.get("logging_steps") or 1))


def _micro_sums(seqs: keyed.Keyed, corrected: bool, sequence_level: bool) -> keyed.Keyed:
    if sequence_level:
        coef = np.exp(seqs["sum_trl_x"] / np.maximum(seqs["n_tokens"], 1))
        num = coef * seqs["sum_trl_k3"]
    else:
        num = seqs["sum_trl_k3_is"] if corrected else seqs["sum_trl_k3"]
    return keyed.reduce_by_key({"step": seqs["step"], "micro": seqs["first_micro"],
                                "iteration": seqs["first_iteration"], "sum_num": num,
                                "n_den": seqs["n_tokens"], "n_ref": seqs["n_trl_ref"]})


def with_logging_windows(table: pa.Table, logging_steps: int) -> pa.Table:
    """Add `window_end` and `logged_kl`: the value TRL logs with `logging_steps` > 1.

    TRL logs at steps that are multiples of logging_steps (kldiag's step is TRL's
    global_step at logging time) the mean of every micro-batch value since the previous
    log, and the rest of a window with the final metrics at the end of training. So
    window_end = ceil(step / logging_steps) * logging_steps, and logged_kl, set on the last
    step of each window in the table (null on the others), is sum(kl_sum) / sum(micro_batches)
    over the window.
    """
    if logging_steps < 1:
        raise ValueError(f"logging_steps = {logging_steps} must be >= 1 (manifest config)")
    step = table.column("step").to_numpy()
    end = -(-step // logging_steps) * logging_steps
    sums = keyed.reduce_by_key({"end": end, "sum_kl": table.column("kl_sum").to_numpy(),
                                "n_micro": table.column("micro_batches").to_numpy()})
    logged = np.full(len(step), np.nan)
    last = np.flatnonzero(np.append(end[1:] != end[:-1], True)) if len(step) else np.zeros(0, np.intp)
    logged[last] = ratio(sums["sum_kl"], sums["n_micro"])
    return table.append_column("window_end", pa.array(end)).append_column("logged_kl", _nullable(logged))


SUPERSEDED_SCHEMA = pa.schema([("rank", pa.int16()), ("attempt", pa.int16()), ("rows", pa.int64())])


def superseded_table(sup: keyed.Keyed) -> pa.Table:
    """rank, attempt, rows: rows left out because a later attempt re-recorded their steps."""
    if not sup or keyed.rows(sup) == 0:
        return SUPERSEDED_SCHEMA.empty_table()
    return pa.table({"rank": pa.array(sup["rank"], pa.int16()), "attempt": pa.array(sup["attempt"], pa.int16()),
                     "rows": pa.array(sup["n_rows"], pa.int64())}, schema=SUPERSEDED_SCHEMA)
