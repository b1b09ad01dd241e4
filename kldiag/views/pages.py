"""What the dashboard pages show that `Analysis` does not hold: pure package code.

Two kinds of helpers, none importing Streamlit (the histograms' heatmaps and bands: `views.hists`):

- tables of an `Analysis` reshaped for display: headline figures, alert onsets, the flags
  table filtered by step range / flag / threshold, step curves of several runs;
- reads of the run's own tokens: one sequence with every per-token quantity
  (`read_sequence`, `sequence_html`), and per-part partials of the estimator comparison
  (`kldiag.views.estimators`).

Per-token maths comes from `kldiag.estimators` (Schulman 2020; DeepSeek-V3.2 eq. 7/9).
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from kldiag import estimators as E
from kldiag import format as F
from kldiag.analysis.types import AnalysisConfig
from kldiag.fmt import num
from kldiag.mismatch import sample as SS

DEFAULT_CONFIG = AnalysisConfig()
LOGP_COLUMNS = ("logp", "logp_old", "logp_ref", "logp_sampler")
FLAG_NAMES = E.FLAG_NAMES
# Quantities a sequence's tokens can be coloured by: column -> label.
SEQUENCE_QUANTITIES = {
    "d": "d = log(pi_ref/pi_theta)",
    "weight_k3_abs": "|k3 weight| = |1 - pi_ref/pi_theta|",
    "weight_k3_is_abs": "|k3_is weight| = |rho (s - r)|",
    "rho": "rho = pi_theta/pi_old",
    "mismatch": "log(pi_old/mu), engine mismatch",
}
# what each colour means, for the legend under the text (`colour_scale_html`)
SCALES = {"d": ("pi_theta above pi_ref", "d = 0", f"d = ln {E.TAU:g}: pi_theta << pi_ref"),
          "weight_k3_abs": ("", "|weight| 1 (a typical token)", "|weight| 1000 and more"),
          "weight_k3_is_abs": ("", "|weight| 1 (a typical token)", "|weight| 1000 and more"),
          "rho": ("rho 1/2 and less", "rho = 1", "rho 2 and more"),
          "mismatch": ("mu 2x above pi_old and more", "no mismatch", "pi_old 2x above mu and more")}
# what read_sequence reads: the token columns and which MoE layers the engine routed differently (format v1.3)
SEQUENCE_READ = (*F.TOKEN_SCHEMA.names, *(c for c in F.ROUTE_COLUMNS if c in ("route_layers", "route_differ",
                                                                           "route_differ_at")))
ROUTED_STYLE = "box-shadow: inset 0 -3px 0 #7c3aed"  # a token the engine routed to other experts than the trainer


# ---- runs ----------------------------------------------------------------------------


def check_run_dirs(paths: Sequence[str | os.PathLike]) -> list[Path | str]:
    """Resolve run directories (URIs stay as given); raise NotARunError/RunFormatError/
    StorageError naming the bad one.

    An empty run (no parts yet) is valid: a live run may not have published yet.
    """
    runs: list[Path | str] = []
    for p in paths:
        path = str(p) if F.is_uri(str(p)) else Path(p).expanduser().resolve()
        F.read_manifest(path)  # raises with a message that names the fix
        runs.append(path)
    return runs


def part_keys(run_dir: str | os.PathLike) -> tuple[str, ...]:
    """Identity of the published parts (rank/name/size/mtime): a new file changes it."""
    return tuple(p.key for p in F.list_parts(run_dir))


def run_label(path: str | os.PathLike, others: Sequence[str | os.PathLike] = ()) -> str:
    """Short unique name of a run for legends: its directory name, with its parent if ambiguous."""
    def split(p: str | os.PathLike) -> tuple[str, str]:  # (parent name, name), for paths and URIs
        bits = str(p).rstrip("/").rsplit("/", 2)
        return (bits[-2] if len(bits) > 1 else "", bits[-1])

    parent, name = split(path)
    same = [o for o in others if split(o)[1] == name and str(o) != str(path)]
    return f"{parent}/{name}" if same else name


def present_in(analysis) -> dict[str, bool]:
    """Which optional log-prob columns hold any value, judged on the analysis's token sample."""
    sample = SS.sample_of(analysis)
    return {c: sample.has_values(c) for c in LOGP_COLUMNS}


def columns_present(run_dir: str | os.PathLike) -> dict[str, bool]:
    """Which optional log-prob columns hold any value, judged on the newest readable part.

    A run without logp_ref has no KL to diagnose; without logp_old it is on-policy (rho = 1).
    """
    parts = F.list_parts(run_dir)
    if not parts:
        return {c: False for c in LOGP_COLUMNS}
    run = F.open_run(run_dir)
    for part in reversed(parts):  # the newest part that reads (corrupt ones warn by name)
        t = run.read_parts([part], columns=LOGP_COLUMNS)
        if t.num_rows:
            return {c: t.column(c).null_count < t.num_rows for c in LOGP_COLUMNS}
    return {c: False for c in LOGP_COLUMNS}


# ---- per-token quantities ------------------------------------------------------------




def nulls(table: pa.Table | pa.RecordBatch) -> dict[str, np.ndarray]:
    """Where each log-prob column is null (absent), as bool [n] (a NaN value is not null)."""
    return {c: np.asarray(table.column(c).is_null().to_numpy(zero_copy_only=False), dtype=bool)
            for c in LOGP_COLUMNS}


def token_columns(table: pa.Table) -> dict[str, np.ndarray]:
    """derive's input from a token table: the log-prob columns (float64) and the loss mask."""
    cols = {c: E.as_f64(table.column(c)) for c in LOGP_COLUMNS}
    cols["mask"] = np.asarray(table.column("mask").to_numpy(zero_copy_only=False), bool)
    return cols


def derive(cols: Mapping[str, np.ndarray], config: AnalysisConfig = DEFAULT_CONFIG,
           absent: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Every per-token quantity from the four log-prob columns (float64 [n]).

    `absent` marks null entries (see `nulls`); without it NaN means absent (except in logp). An absent
    logp_old means on-policy: rho = 1. An absent logp_ref leaves the KL columns NaN.
    Returns d, rho, k1, k2, k3, k3_is, weight_k2/k3/k3_is, their abs, mismatch = log(pi_old/mu) (NaN
    without the engine's log-prob) and the flags.
    """
    if absent is None:  # logp is never null in format v1: a NaN there is always a finding
        absent = {c: np.isnan(cols[c]) & (c != "logp") for c in LOGP_COLUMNS}
    s, r = cols["logp"], cols["logp_ref"]
    o = np.where(absent["logp_old"], s, cols["logp_old"])
    out = {"d": E.log_ratio(s, r), "rho": E.rho(s, o)}
    for name in ("k1", "k2", "k3"):
        out[name] = E.value(name, s, r)
    out["k3_is"] = E.k3_is(s, r, o)
    out["weight_k2"] = E.weight_k2(s, r)
    out["weight_k3"] = E.weight_k3(s, r)
    out["weight_k3_is"] = E.weight_k3_is(s, r, o)
    out["weight_k3_abs"] = np.abs(out["weight_k3"])
    out["weight_k3_is_abs"] = np.abs(out["weight_k3_is"])
    out["mismatch"] = np.where(absent["logp_sampler"], np.nan, o - cols["logp_sampler"])  # log(pi_old/mu)
    flags = E.flags(s, r, tau=config.tau, limit=config.weight_limit, clamp=config.clamp)
    for name in ("theta_ll_ref", "weight_blowup", "clamp_saturated"):
        out[name] = np.asarray(getattr(flags, name))
    # A null is absent, not non-finite: only present values can be findings. Outside the loss (tool
    # output, prompt echo) logp_old and logp_sampler are placeholders a dump may fill with 0.0 or NaN.
    loss = np.asarray(cols["mask"], bool) if "mask" in cols else True
    present = [(cols[c], ~absent[c] & (loss if c in ("logp_old", "logp_sampler") else True)) for c in LOGP_COLUMNS]
    out["nonfinite"] = np.logical_or.reduce([p & ~np.isfinite(x) for x, p in present])
    with np.errstate(invalid="ignore"):
        out["invalid"] = np.logical_or.reduce([p & (x > 0) for x, p in present])
    # "flagged" as the analysis counts it (docs/metrics.md): any of the five flags, bad log-probs included
    out["flagged"] = (out["theta_ll_ref"] | out["weight_blowup"] | out["clamp_saturated"] | out["nonfinite"]
                      | out["invalid"])
    return out


# ---- one sequence --------------------------------------------------------------------


def read_sequence(run_dir: str | os.PathLike, step: int, seq: int,
                  config: AnalysisConfig = DEFAULT_CONFIG, vocab: Mapping[int, str] | None = None) -> pd.DataFrame:
    """The tokens of sequence `seq` at `step`, one row per (iteration, pos), sorted.

    Reads only the row groups whose step statistics hold `step` (Run.read_rows). Columns: the token columns of
    format v1, the route columns that say which layers were routed differently (null without routes), `piece` (decoded text, or "<id>" without a vocab) and everything `derive` gives.
    An unknown (step, seq) gives an empty frame.
    """
    parts = [p for p in F.list_parts(run_dir) if p.step_min <= step <= p.step_max]
    table = F.open_run(run_dir).read_rows(parts, [int(step)], lambda b: pc.equal(b.column("seq"), int(seq)),
                                          columns=SEQUENCE_READ)
    return sequence_frame(table.sort_by([("iteration", "ascending"), ("pos", "ascending")]), config, vocab)


def sequence_frame(table: pa.Table, config: AnalysisConfig = DEFAULT_CONFIG,
                   vocab: Mapping[int, str] | None = None) -> pd.DataFrame:
    """`read_sequence`'s frame of one sequence's token rows (SEQUENCE_READ, in the order shown): the
    columns read, every column `derive` gives, and `piece`."""
    df = table.to_pandas()
    for name, values in derive(token_columns(table), config, nulls(table)).items():
        df[name] = values
    df["piece"] = decode(df["token_id"], vocab)
    return df


def decode(token_ids: pd.Series | Sequence, vocab: Mapping[int, str] | None) -> list[str]:
    """Text of each token id; "<id>" when there is no vocab or the id is unknown."""
    out = []
    for t in token_ids:
        if t is None or (isinstance(t, float) and np.isnan(t)):
            out.append("<?>")
        elif vocab is not None and int(t) in vocab and vocab[int(t)] is not None:
            out.append(str(vocab[int(t)]))
        else:
            out.append(f"<{int(t)}>")
    return out


def _intensity(values: np.ndarray, quantity: str) -> np.ndarray:
    """Colour strength in [0, 1] and sign per token (NaN -> 0).

    d and rho are read on a log scale around "no difference" (d = 0, rho = 1); weights on
    log10 from 1 (a typical token) to 1e3 and beyond.
    """
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        if quantity == "d":
            x = v / np.log(E.TAU)  # 1.0 at the theta_ll_ref threshold
        elif quantity == "rho":
            x = np.log(v) / np.log(2.0)  # 1.0 at rho = 2 or 1/2
        elif quantity == "mismatch":
            x = v / np.log(2.0)  # 1.0 at pi_old/mu = 2 or 1/2
        else:
            x = np.log10(np.maximum(v, 1e-12)) / 3.0  # 1.0 at |weight| = 1000
    x = np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    return np.clip(x, -1.0, 1.0)


HOVER_FIELDS = ("pos", "token_id", "logp", "logp_old", "logp_ref", "logp_sampler",
                "d", "rho", "k3", "k3_is", "weight_k3", "weight_k3_is")


def sequence_html(df: pd.DataFrame, quantity: str = "weight_k3_abs", focus_pos: int | None = None) -> str:
    """The sequence as text, each token's background coloured by `quantity`.

    Token text is untrusted model output: every piece and every attribute value goes
    through html.escape; hover text sits in title attributes. Red means pi_theta below
    pi_ref (d > 0), large weights or rho > 1; blue the opposite. The token at `focus_pos`
    (a deep link's token) is outlined and carries the class kldiag-focus.
    """
    if quantity not in SEQUENCE_QUANTITIES:
        raise ValueError(f"unknown quantity {quantity!r}; choose one of {sorted(SEQUENCE_QUANTITIES)}")
    strength = _intensity(df[quantity].to_numpy(dtype=np.float64, na_value=np.nan), quantity)
    n = len(df)

    def column(c: str) -> list:  # column by column (Python scalars, as rows give): no row tuple per token
        return df[c].tolist() if c in df.columns else [None] * n

    tips = ["\n".join(parts) for parts in zip(*([f"{k}: {num(v, missing='n/a', nan='n/a')}" for v in column(k)]
                                                  for k in HOVER_FIELDS), strict=True)] if n else []
    flagged = [[f for f, on in zip(FLAG_NAMES, row, strict=True) if bool(on)]
               for row in zip(*(column(f) if f in df.columns else [False] * n for f in FLAG_NAMES), strict=True)]
    pos, pieces = column("pos"), df["piece"].tolist()
    routed = [list(v) if v is not None and d else [] for v, d in zip(column("route_differ_at"),
                                                                    [bool(x) and x == x for x in column("route_differ")],
                                                                    strict=True)]
    spans = []
    for i in range(n):
        flags = flagged[i]
        tip = tips[i] + "\nflags: " + (", ".join(flags) or "none")
        if routed[i]:
            tip += "\nrouted differently at MoE layers " + ", ".join(map(str, routed[i]))
        a = strength[i]
        rgb = "220,38,38" if a >= 0 else "37,99,235"
        border = "2px solid #7f1d1d" if flags else "1px solid transparent"
        style = f"background: rgba({rgb},{abs(a) * 0.85:.3f}); border-bottom: {border}"
        style += f"; {ROUTED_STYLE}" if routed[i] else ""
        cls_routed = " kldiag-routed" if routed[i] else ""
        focus = focus_pos is not None and pos[i] == focus_pos
        cls = ("kldiag-tok kldiag-focus" if focus else "kldiag-tok") + cls_routed
        style += "; outline: 2px solid #f59e0b; outline-offset: 1px" if focus else ""
        spans.append(f'<span class="{cls}" style="{style}" title="{html.escape(tip, quote=True)}">'
                     f"{html.escape(str(pieces[i]), quote=True)}</span>")
    body = "".join(spans)
    return ('<div class="kldiag-seq" style="font-family: ui-monospace, monospace; white-space: pre-wrap; '
            f'line-height: 1.9; word-break: break-word">{body}</div>')


def colour_scale_html(quantity: str, routed: bool = False) -> str:
    """The legend of sequence_html's colours for `quantity`: a blue-white-red bar with what its ends mean,
    the flag underline, and (routed) the purple underline of tokens routed to other experts."""
    low, mid, high = SCALES[quantity]
    bar = ("display:inline-block;width:160px;height:10px;vertical-align:middle;margin:0 6px;"
           "background:linear-gradient(to right, rgba(37,99,235,0.85), rgba(255,255,255,1), rgba(220,38,38,0.85))")
    if not low:  # a magnitude: white to red only
        bar = bar.replace("rgba(37,99,235,0.85), ", "")
    parts = [f'<span class="kldiag-scale" style="font-size:0.8em;color:#475569">{html.escape(low or mid)}'
             f'<span style="{bar}"></span>{html.escape(high)}' + (f" (white: {html.escape(mid)})" if low else "")
             + ' · <span style="border-bottom:2px solid #7f1d1d">underlined</span>: carries a flag']
    if routed:
        parts.append(f' · <span style="{ROUTED_STYLE}">purple underline</span>: routed to other experts by the engine')
    return "".join(parts) + "</span>"


def measured_quantities(df: pd.DataFrame) -> list[str]:
    """The SEQUENCE_QUANTITIES the sequence holds a finite value of (d and the weights need logp_ref); without
    d, the engine mismatch first (rho alone is 1 on an on-policy run)."""
    have = [q for q in SEQUENCE_QUANTITIES if q in df and np.isfinite(df[q].to_numpy(np.float64, na_value=np.nan)).any()]
    return sorted(have, key=lambda q: q != "mismatch") if "d" not in have else have


# ---- analysis tables for display -----------------------------------------------------


def headline(steps: pd.DataFrame) -> dict[str, float]:
    """Headline figures of a run from its steps table (STEP_COLUMNS)."""
    if steps.empty:
        return {"steps": 0, "tokens": 0}
    last = steps.iloc[-1]
    tokens = float(steps["tokens"].sum())
    flagged = float((steps["flagged_frac"].fillna(0) * steps["tokens"]).sum())
    return {
        "steps": len(steps),
        "last_step": int(last["step"]),
        "tokens": int(tokens),
        "k3_mean": float(last["k3_mean"]),
        "k3_is_mean": float(last["k3_is_mean"]),
        "weight_k3_abs_max": _nanmax(steps["weight_k3_abs_max"]),
        "weight_k3_is_abs_max": _nanmax(steps["weight_k3_is_abs_max"]),
        "flagged_frac": flagged / tokens if tokens else 0.0,
    }


def _nanmax(col: pd.Series) -> float:
    """Max ignoring NaN; NaN when there is no value (a run without reference), without a warning."""
    v = col.to_numpy(dtype=np.float64, na_value=np.nan)
    return float(np.nanmax(v)) if np.any(~np.isnan(v)) else float("nan")


def onset_steps(alerts: pd.DataFrame) -> list[tuple[int, str]]:
    """(step, label) where a vertical line goes: the first alert of each kind, one line per
    step, its label naming every kind that starts there."""
    if alerts.empty:
        return []
    first = alerts.sort_values("step", kind="stable").groupby("kind", sort=False).head(1)
    kinds = first.groupby("step", sort=True)["kind"].agg(lambda k: ", ".join(dict.fromkeys(k)))
    return [(int(step), str(label)) for step, label in kinds.items()]


def filter_flags(flags: pd.DataFrame, step_range: tuple[int, int] | None = None,
                 kinds: Sequence[str] = (), min_abs_weight: float = 0.0,
                 sort_by: str = "weight_k3_abs", descending: bool = True) -> pd.DataFrame:
    """Rows of the flags table inside `step_range` (inclusive), carrying any flag in `kinds`
    (all rows when empty) and with |k3 weight| >= min_abs_weight (non-finite rows always kept)."""
    df = flags.copy()
    df["weight_k3_abs"] = df["weight_k3"].abs()
    keep = np.ones(len(df), dtype=bool)
    if step_range is not None:
        keep &= (df["step"] >= step_range[0]).to_numpy() & (df["step"] <= step_range[1]).to_numpy()
    if kinds:
        unknown = sorted(set(kinds) - set(FLAG_NAMES))
        if unknown:
            raise ValueError(f"unknown flags {unknown}; choose among {list(FLAG_NAMES)}")
        keep &= df[list(kinds)].fillna(False).astype(bool).any(axis=1).to_numpy()
    if min_abs_weight > 0:
        keep &= ((df["weight_k3_abs"] >= min_abs_weight) | df["nonfinite"].fillna(False).astype(bool)).to_numpy()
    out = df[keep]
    if sort_by not in out.columns:
        raise ValueError(f"cannot sort by {sort_by!r}; choose a column of the flags table")
    # non-finite and invalid log-probs first whatever the order: they are findings, and their NaN weights
    # would otherwise sort last
    bad = (out["nonfinite"].fillna(False).astype(bool) | out["invalid"].fillna(False).astype(bool)).to_numpy()
    out = out.assign(_good=~bad).sort_values(["_good", sort_by], ascending=[True, not descending], kind="stable",
                                             na_position="last")
    return out.drop(columns="_good").reset_index(drop=True)


def compare_steps(steps: Mapping[str, pd.DataFrame], metric: str) -> pd.DataFrame:
    """Long frame (run, step, value) of one step metric over several runs, for one chart."""
    frames = []
    for name, df in steps.items():
        if metric in df.columns:
            frames.append(pd.DataFrame({"run": name, "step": df["step"].to_numpy(),
                                        "value": df[metric].to_numpy(dtype=np.float64, na_value=np.nan)}))
    if not frames:
        return pd.DataFrame({"run": pd.Series(dtype=str), "step": pd.Series(dtype=np.int64),
                             "value": pd.Series(dtype=np.float64)})
    return pd.concat(frames, ignore_index=True)


def numeric_metrics(steps: Sequence[pd.DataFrame]) -> list[str]:
    """Numeric step columns every given run has (the Compare page's metric choices)."""
    common = None
    for df in steps:
        cols = [c for c in df.columns if c != "step" and pd.api.types.is_numeric_dtype(df[c])]
        common = cols if common is None else [c for c in common if c in cols]
    return common or []
