"""The Estimators page's data: what each estimator would have done on a run's own tokens.

A reducer (`EstimatorReducer`) the dashboard hands to `analyze`: computed in the analysis's one read
of each part (`kldiag.views.dashboard.reducers()` lists it), cached with it, merged (`merge_partials`), so a
live run costs only its new files. Read with the analysis, it rides in the analysis's compiled pass
(`kldiag/analysis/kernels/ride.py`: one loop over each batch for both, `ridden_arrays`); read alone (the
analysis's partial cached, or other thresholds), it runs its own (`kldiag/analysis/kernels/estimators.py`,
`batch_arrays`). Only tokens in the loss (mask) with a reference log-prob count. Per-token maths:
`kldiag.estimators` (Schulman 2020; k3_is is DeepSeek-V3.2 eq. 7, its weight eq. 9).
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import pandas as pd
import pyarrow as pa

from kldiag import estimators as E
from kldiag import format as F
from kldiag.analysis.reducers import estimator_pass as K
from kldiag.analysis.reducers.estimator_pass import ABS_GRID, Batch, EstimatorRide, bools
from kldiag.analysis.types import ABS_EDGES, AnalysisConfig
from kldiag.errors import RunFormatError
from kldiag.views.estimator_sample import (  # noqa: F401 - the sample's names, read as estimators.X too
    DTYPES,
    KEEP_FLAGGED,
    KEEP_TOP,
    KINDS,
    PER_ESTIMATOR,
    SAMPLE_COLUMNS,
    SAMPLED,
    SCALARS,
    kept_pick,
    kept_pick_index,
    kind_index,
    largest,
    merge_arrays,
    sample_pick,
)
from kldiag.views.hists import hist_quantiles
from kldiag.views.pages import DEFAULT_CONFIG, LOGP_COLUMNS, derive

COMPARED = ("k1", "k2", "k3", "k3_is", "k3_clamped")
READ_COLUMNS = ["step", "seq", "mask", *LOGP_COLUMNS]

L = K.LAYOUT  # the compiled pass's output layout


@dataclass
class EstimatorPartial:
    """Mergeable sums over tokens in the loss. Dicts are keyed by estimator name (COMPARED)."""

    rows: int = 0  # every row read, for re-weighting samples
    tokens: int = 0  # rows in the loss with a reference log-prob
    flagged: int = 0  # theta_ll_ref | weight_blowup | clamp_saturated | nonfinite | invalid (the analysis's)
    clamp_saturated: int = 0
    k3_weight_lost: float = 0.0  # sum |k3 weight| of clamp-saturated tokens: what clamping drops
    value_sum: dict[str, float] = field(default_factory=dict)
    value_nonfinite: dict[str, int] = field(default_factory=dict)
    weight_abs_sum: dict[str, float] = field(default_factory=dict)
    weight_abs_flagged: dict[str, float] = field(default_factory=dict)
    weight_abs_max: dict[str, float] = field(default_factory=dict)
    weight_hist: dict[str, np.ndarray] = field(default_factory=dict)  # counts over ABS_EDGES bins
    sample: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=list(SAMPLE_COLUMNS)))
    skipped: list[str] = field(default_factory=list)


def values_and_weights(q: dict[str, np.ndarray], config: AnalysisConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(value, weight) per compared estimator from `views.derive` output."""
    saturated = q["k3"] > config.clamp
    return {
        "k1": (q["k1"], np.ones_like(q["k1"])),
        "k2": (q["k2"], q["weight_k2"]),
        "k3": (q["k3"], q["weight_k3"]),
        "k3_is": (q["k3_is"], q["weight_k3_is"]),
        "k3_clamped": (np.minimum(q["k3"], config.clamp), np.where(saturated, 0.0, q["weight_k3"])),
    }


def _batch_partial(batch: pa.RecordBatch | pa.Table, config: AnalysisConfig, sample_size: int,
                   seed: int) -> EstimatorPartial:
    """The partial of one batch (tests, `part_partial`): `batch_arrays` as an EstimatorPartial."""
    return from_arrays(batch_arrays(batch, config, sample_size, seed))


def batch_arrays(batch: pa.RecordBatch | pa.Table, config: AnalysisConfig, sample_size: int,
                 seed: int) -> dict[str, np.ndarray]:
    """The partial of one batch as named arrays (to_arrays' layout): its per-token work in one compiled
    pass (estimator_kernel.token_pass), which also keeps the sample's always-kept tokens; the sample's
    columns are `derive`'s on the few rows drawn."""
    n = batch.num_rows
    raw, absent = {}, _nulls(batch)
    for c in LOGP_COLUMNS:
        col = batch.column(c)
        raw[c] = col.to_numpy(zero_copy_only=False) if col.null_count < n else np.full(n, np.nan, np.float32)
    mask = (bools(batch, "mask") if isinstance(batch, pa.RecordBatch)
            else np.asarray(batch.column("mask").to_numpy(zero_copy_only=False), bool))
    fsum = np.zeros((4, len(COMPARED)))
    icount = np.zeros((1, len(COMPARED)), np.int64)
    hist = np.zeros((len(COMPARED), len(ABS_EDGES) + 1), np.int64)
    scal = np.zeros(5, np.int64)
    top_w, top_j, worst_w, worst_j = np.empty(KEEP_TOP), np.empty(KEEP_TOP, np.int64), np.empty(KEEP_FLAGGED), \
        np.empty(KEEP_FLAGGED, np.int64)
    step, seq = (np.ascontiguousarray(batch.column(c).to_numpy()) for c in ("step", "seq"))
    chunk_j = np.empty(-(-n // L.CHUNK) + 1, np.int64)
    lost = K.token_pass(raw["logp"], raw["logp_old"], raw["logp_ref"], raw["logp_sampler"], absent["logp"],
                        absent["logp_old"], absent["logp_ref"], absent["logp_sampler"], mask, np.log(config.tau),
                        config.weight_limit, config.clamp, ABS_GRID, fsum, icount, hist, scal, top_w, top_j,
                        worst_w, worst_j, np.empty(0), np.empty(0, bool), np.empty(0, np.int64), chunk_j)
    out = kernel_arrays(n, fsum, icount, hist, scal, lost)
    m = int(scal[L.S_TOKENS])
    pick, kind = kept_pick_index(top_j[: scal[L.S_TOP]], worst_j[: scal[L.S_WORST]], m, sample_size, seed)
    at = np.empty(len(pick), np.int64)
    K.token_rows(mask, absent["logp_ref"], chunk_j, pick, at)
    out.update(sample_arrays({c: raw[c][at] for c in LOGP_COLUMNS}, {c: v[at] for c, v in absent.items()},
                             step[at], seq[at], kind, config))
    return out


def kernel_arrays(n: int, fsum: np.ndarray, icount: np.ndarray, hist: np.ndarray, scal: np.ndarray,
                  lost: float) -> dict[str, np.ndarray]:
    """A batch's partial but its sample, as named arrays, from estimator_kernel.token_pass's outputs."""
    out = {"rows": np.array([n]), "tokens": scal[L.S_TOKENS:L.S_TOKENS + 1].copy(),
           "flagged": scal[L.S_FLAGGED:L.S_FLAGGED + 1].copy(),
           "clamp_saturated": scal[L.S_CLAMP:L.S_CLAMP + 1].copy(), "k3_weight_lost": np.array([float(lost)])}
    for k, row in (("value_sum", fsum[L.F_VALUE]), ("value_nonfinite", icount[L.I_NONFINITE]),
                   ("weight_abs_sum", fsum[L.F_WABS]), ("weight_abs_flagged", fsum[L.F_WFLAG]),
                   ("weight_abs_max", fsum[L.F_WMAX])):
        out.update({f"{k}/{name}": row[e:e + 1].copy() for e, name in enumerate(COMPARED)})
    out.update({f"weight_hist/{name}": hist[e] for e, name in enumerate(COMPARED)})
    return out


def sample_arrays(raw: dict[str, np.ndarray], absent: dict[str, np.ndarray], step: np.ndarray, seq: np.ndarray,
                  kind: np.ndarray, config: AnalysisConfig) -> dict[str, np.ndarray]:
    """The sample's columns (`derive`'s) of the drawn rows: log-probs as stored and null masks at them."""
    q = derive({c: E.as_f64(raw[c]) for c in LOGP_COLUMNS}, config, absent)
    q.update(step=step, seq=seq)
    q["kind"] = kind
    return {f"sample/{c}": np.asarray(q[c], DTYPES.get(c, np.float64)) for c in SAMPLE_COLUMNS}


def ridden_arrays(b: Batch, out: dict[str, np.ndarray], config: AnalysisConfig, sample_size: int,
                  seed: int) -> dict[str, np.ndarray]:
    """batch_arrays from the analysis's pass (fused_ride.run's outputs for kernel.Batch b): the same partial,
    its sums added in that pass's chunks."""
    scal = out["scal"]
    arrays = kernel_arrays(b.n, out["fsum"], out["icount"], out["hist"], scal, float(out["k3_weight_lost"][0]))
    pick, kind = kept_pick_index(out["top_j"], out["worst_j"], int(scal[L.S_TOKENS]), sample_size, seed)
    null = [None if b.raw[c] is None else b.null[c] for c in LOGP_COLUMNS]  # None: absent, or no null
    r_null = null[LOGP_COLUMNS.index("logp_ref")]
    no_null = np.zeros(b.n, bool)
    at = np.empty(len(pick), np.int64)
    K.token_rows_at(b.mask, no_null if r_null is None else r_null, out["chunk_r0"], out["chunk_j"], pick, at)
    raw = {c: np.full(len(at), np.nan, np.float32) if b.raw[c] is None else b.raw[c][at] for c in LOGP_COLUMNS}
    absent = {c: np.ones(len(at), bool) if b.raw[c] is None else np.zeros(len(at), bool) if v is None else v[at]
              for c, v in zip(LOGP_COLUMNS, null, strict=True)}
    arrays.update(sample_arrays(raw, absent, b.step[at], b.seq[at], kind, config))
    return arrays


def _nulls(batch: pa.RecordBatch | pa.Table) -> dict[str, np.ndarray]:
    """`pages.nulls`, with one shared all-False array for the columns without a null (the usual case)."""
    n, none = batch.num_rows, None
    out = {}
    for c in LOGP_COLUMNS:
        col = batch.column(c)
        if col.null_count:
            out[c] = np.asarray(col.is_null().to_numpy(zero_copy_only=False), dtype=bool)
        else:
            none = np.zeros(n, bool) if none is None else none
            out[c] = none
    return out


@dataclass(frozen=True)
class EstimatorReducer:
    """The Estimators page's partial as a reducer (kldiag.analysis.protocol): read in the analysis's
    pass over each part, cached with it, merged in part order."""

    tau: float = DEFAULT_CONFIG.tau
    weight_limit: float = DEFAULT_CONFIG.weight_limit
    clamp: float = DEFAULT_CONFIG.clamp
    sample_size: int = 2000  # uniformly drawn tokens per part, besides the worst ones
    name: str = "estimators"
    rides: ClassVar[str] = "analysis"  # its per-token work runs in the analysis's pass when both are read
    # 2: "flagged" counts non-finite and invalid log-probs, as the analysis does; 3: no per-sequence rows
    # (the page's off-policy mask reads Analysis.opsm); 4: computed in the analysis's pass when read with it
    # (fused_ride.py): its sums added in that pass's chunks, equal to the standalone pass's to rounding
    version: int = 4
    merge_every: int = 256  # each merge re-draws the token sample: merge in few, large steps
    columns: tuple[str, ...] = tuple(READ_COLUMNS)

    def settings(self) -> dict:
        return {"tau": self.tau, "weight_limit": self.weight_limit, "clamp": self.clamp,
                "sample_size": self.sample_size}

    def config(self) -> AnalysisConfig:
        return AnalysisConfig(tau=self.tau, weight_limit=self.weight_limit, clamp=self.clamp)

    def start(self, part: F.PartInfo) -> dict:
        return {"seed": zlib.crc32(part.name.encode()), "parts": []}

    def add(self, state: dict, batch: pa.RecordBatch) -> None:
        seed = state["seed"] + len(state["parts"])
        state["parts"].append(batch_arrays(batch, self.config(), self.sample_size, seed))

    def ride(self, state: dict) -> EstimatorRide:
        """Its per-token work in the analysis's compiled pass (K.PartFold, when both are in one group):
        each batch's partial from that pass's outputs (`ridden_arrays`)."""
        def take(b: Batch, out: dict) -> None:
            seed = state["seed"] + len(state["parts"])
            state["parts"].append(ridden_arrays(b, out, self.config(), self.sample_size, seed))
        return EstimatorRide(self.tau, self.weight_limit, self.clamp, KEEP_TOP, KEEP_FLAGGED, take,
                             lambda batch: self.add(state, batch))

    def finish(self, state: dict, dropped: int) -> dict[str, np.ndarray]:
        return merge_arrays(state["parts"], sample_size=self.sample_size, seed=state["seed"])

    def merge(self, partials) -> dict[str, np.ndarray]:
        return merge_arrays(list(partials))


def to_arrays(p: EstimatorPartial) -> dict[str, np.ndarray]:
    """An EstimatorPartial as named arrays (the engine's cache format); `kind` as its KINDS index."""
    out = {k: np.array([getattr(p, k)]) for k in SCALARS}
    for k in PER_ESTIMATOR:
        out.update({f"{k}/{name}": np.array([v]) for name, v in getattr(p, k).items()})
    out.update({f"weight_hist/{name}": np.asarray(v) for name, v in p.weight_hist.items()})
    sample = p.sample.assign(kind=p.sample["kind"].map(KINDS.index)) if len(p.sample) else p.sample
    out.update({f"sample/{c}": sample[c].to_numpy(dtype=DTYPES.get(c, np.float64)) for c in SAMPLE_COLUMNS})
    return out


def from_arrays(a: dict[str, np.ndarray]) -> EstimatorPartial:
    p = EstimatorPartial(**{k: a[k][0].item() for k in SCALARS})
    for key, v in a.items():
        table, _, name = key.partition("/")
        if table in PER_ESTIMATOR:
            getattr(p, table)[name] = v[0].item()
        elif table == "weight_hist":
            p.weight_hist[name] = np.asarray(v)
    sample = pd.DataFrame({c: a[f"sample/{c}"] for c in SAMPLE_COLUMNS})
    p.sample = sample.assign(kind=np.array([KINDS[int(k)] for k in sample["kind"]], dtype=object))
    return p


def part_partial(part: F.PartInfo, config: AnalysisConfig = DEFAULT_CONFIG,
                 sample_size: int = 2000, batch_size: int = 1 << 20) -> EstimatorPartial:
    """The partial of one part file, read on its own (tests; faces get it from the analysis's pass).

    A corrupt part is skipped with a warning and listed in `skipped` (strict: raises).
    """
    red = EstimatorReducer(config.tau, config.weight_limit, config.clamp, sample_size)
    got = K.compute_part(part, [red], batch_size, () if config.strict else (RunFormatError, OSError,
                                                                                 pa.ArrowException))
    if isinstance(got, Exception):
        warnings.warn(f"kldiag: skipping {part.path}: {got}", stacklevel=2)
        return EstimatorPartial(skipped=[str(part.path)])
    return from_arrays(got[red.name])


def merge_partials(parts: Sequence[EstimatorPartial], sample_size: int = 5000, seed: int = 0) -> EstimatorPartial:
    """Exact merge of sums, maxima and histograms; the token sample is re-drawn uniformly."""
    out = EstimatorPartial()
    parts = [p for p in parts if p is not None]
    for p in parts:
        out.rows += p.rows
        out.tokens += p.tokens
        out.flagged += p.flagged
        out.clamp_saturated += p.clamp_saturated
        out.k3_weight_lost += p.k3_weight_lost
        out.skipped += p.skipped
        for name in p.value_sum:
            out.value_sum[name] = out.value_sum.get(name, 0.0) + p.value_sum[name]
            out.value_nonfinite[name] = out.value_nonfinite.get(name, 0) + p.value_nonfinite[name]
            out.weight_abs_sum[name] = out.weight_abs_sum.get(name, 0.0) + p.weight_abs_sum[name]
            out.weight_abs_flagged[name] = out.weight_abs_flagged.get(name, 0.0) + p.weight_abs_flagged[name]
            out.weight_abs_max[name] = max(out.weight_abs_max.get(name, 0.0), p.weight_abs_max[name])
            out.weight_hist[name] = out.weight_hist.get(name, 0) + p.weight_hist[name]
    out.sample = _merge_samples([p for p in parts if len(p.sample)], sample_size, seed)
    return out


def _merge_samples(parts: Sequence[EstimatorPartial], n: int, seed: int) -> pd.DataFrame:
    """The worst tokens of every part (flagged and top |k3 weight|, bounded as in `sample_pick`)
    and a uniform sample of at most n others: each part's sampled rows weighted by tokens/sampled."""
    if not parts:
        return pd.DataFrame(columns=list(SAMPLE_COLUMNS))
    df = pd.concat([p.sample for p in parts], ignore_index=True)
    if "kind" not in df.columns:
        df["kind"] = SAMPLED
    special = df[df["kind"] != SAMPLED]
    if len(special):
        pick, kind = sample_pick(special["weight_k3"].to_numpy(), (special["kind"] == "flagged").to_numpy(), 0, 0)
        special = special.iloc[pick].assign(kind=kind)
    sampled = []
    for p in parts:
        mine = p.sample[p.sample["kind"] == SAMPLED] if "kind" in p.sample.columns else p.sample
        sampled.append((mine, p.tokens / max(len(mine), 1)))
    rest = pd.concat([m for m, _ in sampled], ignore_index=True)
    weights = np.concatenate([np.full(len(m), wt) for m, wt in sampled])
    if len(rest) > n:
        pick = np.random.default_rng(seed).choice(len(rest), size=n, replace=False, p=weights / weights.sum())
        rest = rest.iloc[np.sort(pick)]
    return pd.concat([special, rest], ignore_index=True).sort_values(["step"], kind="stable").reset_index(drop=True)


# ---- what the page shows -------------------------------------------------------------


# the display order: the figures first, the long "expected gradient" text last (it pushed |weight| max off the page)
TABLE_ORDER = ("estimator", "value mean", "|weight| mean", "|weight| p99", "|weight| max", "flagged share of |weight|",
               "non-finite values", "expected gradient")


def estimator_table(p: EstimatorPartial) -> pd.DataFrame:
    """One row per estimator: mean value, mean/p99/max |weight|, flagged tokens' share of |weight|."""
    rows = []
    for name in COMPARED:
        if name not in p.value_sum:
            continue
        n = max(p.tokens - p.value_nonfinite[name], 1)
        # The histogram interpolates inside a bin; never report a p99 above the max.
        p99 = min(hist_quantiles(p.weight_hist[name][None, :], ABS_EDGES, [0.99])[0, 0], p.weight_abs_max[name])
        total = p.weight_abs_sum[name]
        rows.append({
            "estimator": name,
            "expected gradient": E.get_estimator(name).target,
            "value mean": p.value_sum[name] / n,
            "non-finite values": p.value_nonfinite[name],
            "|weight| mean": total / max(p.tokens, 1),
            "|weight| p99": p99,
            "|weight| max": p.weight_abs_max[name],
            "flagged share of |weight|": p.weight_abs_flagged[name] / total if total > 0 else 0.0,
        })
    return pd.DataFrame(rows)


def clamp_summary(p: EstimatorPartial) -> dict[str, float]:
    """Clamp saturation: the fraction of tokens above the clamp, and K3's |weight| they carry."""
    total = p.weight_abs_sum.get("k3", 0.0)
    return {
        "tokens": p.tokens,
        "flagged_frac": p.flagged / p.tokens if p.tokens else 0.0,
        "clamp_saturated_frac": p.clamp_saturated / p.tokens if p.tokens else 0.0,
        "k3_weight_lost_share": p.k3_weight_lost / total if total > 0 else 0.0,
    }
