"""Mismatch views: what the dashboard's Mismatch page and `kldiag report` show (pandas frames).

Computation lives in kldiag.diagnosis (parity, whatif, decompose) and kldiag.crosswalk; this module
only shapes it for display. One TokenSet per run feeds every view.
"""

from __future__ import annotations

import dataclasses
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from kldiag.analysis import analyze
from kldiag.analysis.cache import store
from kldiag.analysis.types import AnalysisConfig
from kldiag.crosswalk import crosswalk, framework_of, null_reasons
from kldiag.mismatch import corrections as CR
from kldiag.mismatch import decompose as DC
from kldiag.mismatch import parity as P
from kldiag.mismatch import sample as SS
from kldiag.mismatch import tokenset as TS
from kldiag.mismatch import whatif as W
from kldiag.views import leads as VL

DEFAULT_FRAMEWORK = "verl"  # the crosswalk shown for a run whose trainer is none of the frameworks


@dataclass
class MismatchView:
    """Everything the page draws before any widget is touched. Kept in the run's result store
    (kldiag.analysis.cache.store): a fresh process reads it, and reads the token sample (`tokens`) only
    when a what-if that is not stored yet replays it."""

    parity: P.ParityReport | None
    by_step: pd.DataFrame
    by_prob: pd.DataFrame
    by_pos: pd.DataFrame
    by_entropy: pd.DataFrame | None
    summary: dict[str, Any] = field(default_factory=dict)
    has_sampler: bool = False
    step_stride: int = 1  # 1: every step of the run is in the sample; k: every k-th
    group_share: float = 1.0  # < 1: about this share of each kept step's prompt groups (the sample's cap)
    analysis: Any = field(default=None, repr=False, compare=False)  # where `tokens` come from; not stored

    @property
    def tokens(self) -> TS.TokenSet:
        """The run's shared token sample (SS.sample_of: kept by the analysis while a face holds it, or
        while inside `holding(view)` or `held(analysis)`)."""
        return tokens_of(self.analysis)


HOLDS = "mismatch_holds"  # Analysis.memo's key of the TokenSet lists that the open `held(analysis)` keep
_LOCK = threading.Lock()  # a page's sessions render in threads of one process, on one cached Analysis


def tokens_of(analysis) -> TS.TokenSet:
    """The analysed run's shared TokenSet (SS.sample_of(analysis).tokens()), held by every open
    `held(analysis)`."""
    ts = SS.sample_of(analysis).tokens()
    memo = getattr(analysis, "memo", None)
    if memo is not None and memo.get(HOLDS):
        with _LOCK:
            for pins in memo.get(HOLDS, ()):
                if not any(p is ts for p in pins):
                    pins.append(ts)
    return ts


@contextmanager
def held(analysis):
    """Inside, the token sample's TokenSet is made at most once, when first read (tokens_of: the view's
    decomposition, each what-if, the crosswalk), and held; released on leaving. The sample keeps its sets
    weakly, so a page render or a report that reads it in several places would otherwise make it again each
    time (a 2M-token set: about 0.2-0.3 s and 230 MB). Nothing is made when every result comes from the
    result store."""
    memo = getattr(analysis, "memo", None)
    if memo is None:
        yield analysis
        return
    pins: list[TS.TokenSet] = []
    with _LOCK:
        memo.setdefault(HOLDS, []).append(pins)
    try:
        yield analysis
    finally:
        with _LOCK:
            memo[HOLDS] = [p for p in memo.get(HOLDS, []) if p is not pins]


@contextmanager
def holding(view: MismatchView):
    """held(view.analysis) (the report replays a dozen what-ifs on the view's tokens), yielding the view."""
    with held(view.analysis):
        yield view


def _analysed(analysis):
    """An Analysis with the Mismatch view's reducers: a path or URI is analysed here first."""
    return analysis if hasattr(analysis, "reduced") else analyze(analysis, AnalysisConfig(), reducers())


def compute(analysis) -> MismatchView:
    """The view of an analysed run, from its shared token sample (SS.sample_of: read along with the
    analysis when it was made with `reducers()`)."""
    ts = tokens_of(analysis)
    d = DC.every_view(ts)
    ent = d["by_entropy"]
    return MismatchView(P.report_for(analysis), d["by_step"].to_pandas(), d["by_prob"].to_pandas(),
                        d["by_pos"].to_pandas(), ent.to_pandas() if ent is not None else None, d["summary"],
                        ts.has_sampler, ts.step_stride, ts.group_share)


def load(analysis) -> MismatchView:
    """compute(analysis), read from the run's result store when it holds it (a path or URI is
    analysed here first)."""
    analysis = _analysed(analysis)
    view = store.cached(analysis, "mismatch_view", [], lambda: compute(analysis))
    view.analysis = analysis
    return view


def view_of(analysis) -> MismatchView:
    """load(analysis), made once per Analysis (the report's text and HTML share it)."""
    if not hasattr(analysis, "memo"):
        return load(analysis)
    if "mismatch_view" not in analysis.memo:
        analysis.memo["mismatch_view"] = load(analysis)
    return analysis.memo["mismatch_view"]


def sample_caption(view: MismatchView) -> str:
    """What part of a large run the Mismatch figures read (the token sample)."""
    steps = f"every {view.step_stride}th step" if view.step_stride > 1 else "every step"
    groups = f" and {view.group_share:.0%} of each step's prompt groups" if view.group_share < 1 else ""
    return (f"A large run: these figures read {steps}{groups} (the token sample, at most "
            f"{SS.SAMPLE_CAP / 1e6:g}M tokens).")


def reducers() -> list:
    """What the Mismatch view reads besides the analysis: the shared token sample."""
    return [SS.SampleReducer()]


def parity_rows(view: MismatchView) -> list[tuple[str, str, str]]:
    """(label, value, help) for the page's metric row and the report's list."""
    rep = view.parity
    if rep is None:
        return []
    f = rep.fit
    temp = f"{f.implied_temperature:.4g}" if f.implied_temperature == f.implied_temperature else "n/a"
    return [("Implied engine temperature", temp,
             f"1 / slope of log mu on log pi_old ({f.method} fit over {f.tokens:,} tokens, {f.contexts:,} shared "
             "contexts); 1 when the engine and the trainer agree"),
            ("Fit residual (nats)", f"{f.residual_std:.2g}", "float noise when the temperature model is exact"),
            ("Mean log mu - log pi_old", f"{f.offset:+.3g}", "a constant offset at slope 1 is a semantic bug"),
            ("Mismatch growth",  # a short label: a metric's label is cut at a quarter of the page
             f"{rep.growth['mismatch_growth']:.3g}" if rep.growth["mismatch_growth"] is not None else "n/a",
             "mean mismatch in the run's last quarter over its first; "
             + (f"policy drift over the same quarters: x{rep.growth['drift_growth']:.3g}"
                if rep.growth["drift_growth"] is not None else "too few steps"))]


def parity_findings(diagnosis) -> list[str]:
    """One line per engine cause of the run's Diagnosis (empty: the engine agrees with the trainer up to
    noise). The diagnosis arbitrates between the parity fits, the root-cause signatures, truncation and
    re-tokenisation (one root cause, one cause), so the page and the report say what the verdict says."""
    return [f"{c.cause}: {c.summary}" for c in diagnosis.causes if c.cause.startswith("engine_")]


def at_centre(bins: pd.DataFrame, x: str) -> pd.DataFrame:
    """Integer-position bins [lo, hi) placed at their centre (lo + hi - 1) / 2 in column `x`; the open last
    bin (hi beyond twice lo) at lo. The chart's hover names the range."""
    lo, hi = bins["lo"], bins["hi"]
    closed = hi <= 2 * lo.clip(lower=1)
    return bins.assign(**{x: ((lo + hi - 1) / 2).where(closed, lo)})


def whatif_frame(view: MismatchView, w: W.WhatIf) -> pd.DataFrame:
    """W.replay of the view's tokens, per step (kept in the run's result store per correction)."""
    return store.cached(view.analysis, "whatif", dataclasses.asdict(w), lambda: W.replay(view.tokens, w).to_pandas())


def whatif_missing(frame: pd.DataFrame) -> str | None:
    """Why a what-if replayed no token (it reads the tokens in the loss with a finite advantage), or None."""
    if len(frame) and float(frame["tokens"].sum()) > 0:
        return None
    return VL.needs("A correction's replay (tokens masked, ESS, policy-gradient mass removed)", "advantage")


def whatif_totals(frame: pd.DataFrame) -> dict[str, float]:
    """Run-level totals of a what-if frame (token- and sequence-weighted fractions, mean ESS, mass shares)."""
    n, s = frame["tokens"].sum(), frame["sequences"].sum()
    return {"token_frac": float((frame["token_frac"] * frame["tokens"]).sum() / max(n, 1)),
            "seq_frac": float((frame["seq_frac"] * frame["sequences"]).sum() / max(s, 1)),
            "ess": float(frame["ess"].mean()),
            "mass_removed_pos_share": float(frame["mass_removed_pos_share"].mean()),
            "mass_removed_neg_share": float(frame["mass_removed_neg_share"].mean())}


def whatif_table(view: MismatchView) -> list[dict[str, Any]]:
    """One row per correction and convention at the default thresholds (WhatIf()): the run-level totals, with the
    framework's loss denominator after rejection (corrections.DENOMINATORS) and the mean grad_scale under it. The
    report's table and `kldiag analyze --json` "whatif"."""
    rows = []
    for method in W.METHODS:
        for conv in W.CONVENTIONS if view.has_sampler else ("trainer",):
            frame = whatif_frame(view, W.WhatIf(method, conv))
            denom, source = CR.DENOMINATORS[method]
            rows.append({"method": method, "old": "pi_old" if conv == "trainer" else "mu", **whatif_totals(frame),
                         "denominator": denom, "grad_scale": float(frame["grad_scale"].mean()),
                         "denominator_source": source})
    return rows


def crosswalk_frame(analysis, framework: str, **settings: Any) -> tuple[pd.DataFrame, dict[str, str]]:
    """The crosswalk table of an analysed run (on its shared token sample) and its null reasons (kept in
    the run's result store per framework and settings)."""
    analysis = _analysed(analysis)

    def compute_frame() -> tuple[pd.DataFrame, dict[str, str]]:
        t = crosswalk(analysis.run_dir, framework, sample=SS.sample_of(analysis), **settings)
        return t.to_pandas(), null_reasons(t)

    return store.cached(analysis, "crosswalk", [framework, settings], compute_frame)


def own_framework(manifest) -> str:
    return framework_of(manifest) or DEFAULT_FRAMEWORK
