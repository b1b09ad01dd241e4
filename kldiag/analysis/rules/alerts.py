"""Alerts: episodes of the rules in kldiag.analysis.rules.episodes, one row per episode.

A rule firing on consecutive steps is one row (a 200-step blow-up is one alert, a run that
recovers and relapses is two). Columns (ALERT_COLUMNS): `step` (= start), `kind`, `metric`,
`value` (peak value), `baseline` (the rule's threshold), `message`, `start`, `end` (null while
ongoing), `peak_step`, `peak_value`, `severity`, `steps` (firing steps). The per-step detail
stays in the steps table; `kldiag.analysis.rules.episodes.RULES` says which columns each rule reads.
"""

from __future__ import annotations

import pyarrow as pa

from kldiag.analysis.rules import episodes as EP
from kldiag.analysis.rules.episodes import Episode, RuleConfig
from kldiag.analysis.types import ALERT_COLUMNS, AnalysisConfig

_TYPES = {"step": pa.int64(), "kind": pa.string(), "metric": pa.string(), "value": pa.float64(),
          "baseline": pa.float64(), "message": pa.string(), "start": pa.int64(), "end": pa.int64(),
          "peak_step": pa.int64(), "peak_value": pa.float64(), "severity": pa.string(), "steps": pa.int64()}


def rule_context(cfg: AnalysisConfig, manifest=None, diag: RuleConfig | None = None) -> EP.RuleContext:
    """The rules' context for a run: its loss estimator (manifest config, else k3) and thresholds."""
    estimator = ((manifest.config or {}).get("estimator") if manifest is not None else None) or EP.DEFAULT_ESTIMATOR
    return EP.RuleContext(estimator=estimator, weight_limit=cfg.weight_limit, alert_window=cfg.alert_window,
                          alert_factor=cfg.alert_factor, config=diag or RuleConfig())


def baseline(kind: str, ctx: EP.RuleContext) -> float:
    """The rule's threshold (its absolute floor for the early warnings; 0 where it is relative only)."""
    c, ew = ctx.config, ctx.config.early
    return {"blowup": c.blowup_weight, "latent": c.blowup_weight, "blame_share": c.blame_share,
            "mismatch": c.mismatch_kl, "weight_blowup_onset": ctx.weight_limit,
            "early_weight_trend": ew.weight_floor * ctx.weight_limit, "early_blame_trend": ew.blame_floor,
            "early_entropy_drop": ew.entropy_drop}.get(kind, 0.0)


def episode_table(eps: list[Episode], ctx: EP.RuleContext) -> pa.Table:
    rows = [{"step": e.start, "kind": e.kind, "metric": e.metric, "value": e.peak_value,
             "baseline": baseline(e.kind, ctx), "message": e.message, "start": e.start, "end": e.end,
             "peak_step": e.peak_step, "peak_value": e.peak_value, "severity": e.severity, "steps": e.steps}
            for e in eps]
    return pa.table({c: pa.array([r[c] for r in rows], _TYPES[c]) for c in ALERT_COLUMNS})


def compute_alerts(steps: pa.Table, flags: pa.Table, cfg: AnalysisConfig, manifest=None) -> pa.Table:
    """ALERT_COLUMNS rows, one per episode, sorted by start step."""
    ctx = rule_context(cfg, manifest)
    return episode_table(EP.episodes(EP.table_cols(steps), ctx), ctx)
