"""The MoE routing causes: `moe_routing_mismatch` and `routing_replay_broken`.

Registered among the detectors on import (kldiag.diagnosis.core imports this module); the figures are
kldiag.analysis.reducers.routing's (RoutingReducer, read with the analysis when it was made with core.reducers()).

- `moe_routing_mismatch` (warning): the engine/trainer mismatch concentrates on the tokens the two route
  to different expert sets. A token near a router tie goes to another expert in a low-precision engine
  router, and its two log-probs then differ by far more than numerics. Named instead of `engine_mismatch`,
  `engine_precision` and `engine_temperature_mismatch` when the disagreeing tokens carry most of the
  mismatch KL (`explain_share`): a temperature would spread over every token, not concentrate.
- `routing_replay_broken` (critical): the run says routing replay was on (manifest config
  `routing_replay`: true or the framework's mode name, such as verl's "R3"; `--set routing_replay=...` on
  the command line otherwise) but the trainer's and the engine's expert sets differ on more than
  `max_differ_share` of the routed loss tokens, or the engine's routes are missing on more than that
  share. Miles fails its CI replay check at 1% of tokens (radixark/miles@31f1ca96
  `miles/utils/replay_base.py` `check_replay_result`, `replay_check_max_mismatch_fraction`). It explains
  the routing mismatch and the generic engine mismatch, and is named instead of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kldiag.analysis.reducers.route_margin import RouteMarginReducer
from kldiag.analysis.reducers.route_margin import summary as margin_summary
from kldiag.analysis.reducers.routing import RoutingReducer, summary
from kldiag.analysis.runtime.runner import reduced
from kldiag.diagnosis.types import Cause
from kldiag.errors import KldiagError
from kldiag.frameworks import fix_for

OFF = ("", "off", "none", "null", "false", "0", "no", "disabled")  # verl's mode "disabled" is off
# verl's R2 records the trainer's own routes in the old-log-prob pass and replays them in the update: the
# engine's routes are not replayed, so engine and trainer may differ under it (verl@1dda039b engine.py)
NOT_ENGINE_REPLAY = ("r2",)
# what `--set KEY=VALUE` may give the diagnosis: routing_replay (the routing causes), true_on_policy (the parity
# contract), rollout_dtype (engine_low_precision: the engine's weight dtype, e.g. fp8, bf16)
SETTABLE = ("routing_replay", "true_on_policy", "rollout_dtype")
DTYPE_RE = r"[a-z][a-z0-9_.]*"  # a dtype's name as frameworks spell it: fp8, bf16, bfloat16, mxfp8, torch.float16


@dataclass(frozen=True)
class RoutingConfig:
    """Thresholds of the routing causes (every default on this screen)."""

    min_tokens: int = 20  # disagreeing tokens needed before the mismatch on them is read
    concentration: float = 3.0  # |mismatch| on disagreeing tokens / on agreeing tokens, at least
    share_over_tokens: float = 2.0  # their share of the mismatch KL / their share of the tokens, at least
    float_noise: float = 0.01  # nats: a mean |log mu - log pi_old| below this on disagreeing tokens is no cause
    explain_share: float = 0.75  # share of the mismatch KL they carry for engine_mismatch/precision to be absorbed
    max_differ_share: float = 0.01  # under replay: routed loss tokens whose sets differ (or are missing), at most


def replay_on(manifest: Any) -> Any:
    """The run's `routing_replay` setting when it says replay was on (True, "R3", ...), else None."""
    value = (getattr(manifest, "config", None) or {}).get("routing_replay")
    if value is None or value is False:
        return None
    if isinstance(value, str) and value.strip().lower() in (*OFF, *NOT_ENGINE_REPLAY):
        return None
    return value


ON = ("true", "on", "yes", "1")
# routing_replay's values besides ON and OFF: verl's router_replay.mode names (verl 0.9.1
# verl/workers/config/engine.py EngineRouterReplayConfig: disabled | R2 | R3)
REPLAY_MODES = ("r2", "r3")


def check_settings(pairs: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items checked and parsed, before any work: {key: True | False | mode name}.
    KldiagError names the keys and values it takes."""
    out: dict[str, Any] = {}
    for item in pairs:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in SETTABLE:
            raise KldiagError(f"--set {item!r}: write KEY=VALUE with KEY one of {', '.join(SETTABLE)}, "
                              "e.g. --set routing_replay=R3")
        out[key] = _checked(item, key, value.strip())
    return out


def _checked(item: str, key: str, value: str) -> Any:
    """One --set value, parsed for its key; KldiagError naming what the key takes."""
    low = value.lower()
    if key == "rollout_dtype":
        if not re.fullmatch(DTYPE_RE, low.replace("-", "_")):
            raise KldiagError(f"--set {item!r}: rollout_dtype takes the engine's weight dtype, e.g. "
                              "--set rollout_dtype=fp8 (or bf16, int8, mxfp8)")
        return value
    modes = REPLAY_MODES if key == "routing_replay" else ()
    if low not in (*ON, *OFF, *modes) or not low:
        also = f" or a replay mode ({', '.join(m.upper() for m in modes)}, disabled)" if modes else ""
        raise KldiagError(f"--set {item!r}: {key} takes true or false (on/off, yes/no, 1/0){also}, e.g. --set "
                          f"{key}={'R3' if modes else 'true'}")
    return True if low in ON else False if low in OFF else value


def apply_settings(manifest: Any, pairs: list[str]) -> None:
    """`--set KEY=VALUE` items (check_settings) into the manifest's config in memory (nothing is written)."""
    manifest.config.update(check_settings(pairs))


def figures(analysis) -> dict[str, Any] | None:
    """kldiag.analysis.reducers.routing.summary() of the run, None when it recorded no routes; computed once
    per analysis (analysis.memo), however many detectors and faces ask."""
    key = ("routing", "summary")
    if key not in analysis.memo:
        s = summary(reduced(analysis, RoutingReducer()))
        analysis.memo[key] = s if s["routed"] else None
    return analysis.memo[key]


def margins(analysis) -> dict[str, Any] | None:
    """The trainer router's margins on flipped and kept tokens (kldiag.analysis.reducers.route_margin), None when the
    run recorded none (the evidence then says nothing about router confidence)."""
    s = margin_summary(reduced(analysis, RouteMarginReducer()))
    return s if s["measured"] else None


def _margin_text(m: dict[str, Any] | None) -> str:
    if m is None or m["flipped"]["median"] is None or m["kept"]["median"] is None:
        return ""
    return (f"; the trainer router's margin (k-th minus (k+1)-th expert logit, lowest layer) has median "
            f"{m['flipped']['median']:.3g} on the tokens routed differently against {m['kept']['median']:.3g} on "
            "the others")


def _layers(s: dict, key: str, floor: float = 0.0) -> list[dict]:
    rows = [r for r in s["layers"] if (r[key] or 0.0) > floor]
    return sorted(rows, key=lambda r: -r[key])


def _concentrated(s: dict, cfg: RoutingConfig) -> bool:
    a, d = s["agree"], s["disagree"]
    if d["tokens"] < cfg.min_tokens or d["mismatch_abs_mean"] is None or d["mismatch_abs_mean"] < cfg.float_noise:
        return False
    ratio_ok = a["mismatch_abs_mean"] is None or d["mismatch_abs_mean"] >= cfg.concentration * a["mismatch_abs_mean"]
    share = s["kl_share_disagree"] or 0.0
    return ratio_ok and share >= cfg.share_over_tokens * (s["differ_share"] or 0.0)


def _onset(s: dict, key: str, floor: float) -> int | None:
    return next((r["step"] for r in s["steps"] if (r[key] or 0.0) > floor), None)


def routing_cause(analysis, cfg: RoutingConfig = RoutingConfig()) -> tuple[Cause | None, bool]:
    """(moe_routing_mismatch or None, whether it explains the generic mismatch); made once per analysis and
    settings, read by both routing detectors."""
    key = ("routing", "cause", cfg)
    if key not in analysis.memo:
        analysis.memo[key] = _routing_cause(analysis, cfg)
    return analysis.memo[key]


def _routing_cause(analysis, cfg: RoutingConfig) -> tuple[Cause | None, bool]:
    s = figures(analysis)
    if s is None or replay_on(analysis.manifest) is not None or not _concentrated(s, cfg):
        return None, False
    a, d = s["agree"], s["disagree"]
    share = s["kl_share_disagree"]
    layers = _layers(s, "differ_share")
    ev = {"agreement": s["agreement"], "differ_share": s["differ_share"], "overlap_mean": s["overlap_mean"],
          "kl_share_disagree": share, "agree": a, "disagree": d, "layers": layers,
          "areal_k3_mean": s["areal_k3_mean"], "areal_extreme_frac": s["areal_extreme_frac"],
          "router_margin": margins(analysis),
          "thresholds": {"concentration": cfg.concentration, "share_over_tokens": cfg.share_over_tokens,
                         "float_noise": cfg.float_noise, "explain_share": cfg.explain_share}}
    where = ", ".join(f"{r['layer']} ({r['differ_share']:.1%})" for r in layers[:4])
    summary_ = (f"the engine routes {s['differ_share']:.1%} of the tokens to another expert set than the trainer "
                f"(layers {where}); those tokens carry {share:.0%} of the mismatch KL(mu||pi_old): "
                "|log mu - log pi_old| "
                f"averages {d['mismatch_abs_mean']:.3g} nats on them against "
                + (f"{a['mismatch_abs_mean']:.3g}" if a["mismatch_abs_mean"] is not None else "none")
                + f" on tokens routed alike (IS ratio up to {d['is_max']:.3g})" + _margin_text(ev["router_margin"]))
    onset = _onset(s, "differ_share", 0.0)
    return (Cause("moe_routing_mismatch", onset, "warning", ev, fix_for("moe_routing_mismatch", analysis.manifest),
                  summary_), share >= cfg.explain_share)


def moe_routing_mismatch(analysis, ctx) -> list[Cause]:
    """The routing mismatch that explains the engine mismatch (absorbs engine_mismatch, engine_precision)."""
    cause, explains = routing_cause(analysis)
    return [cause] if cause is not None and explains else []


def moe_routing_mismatch_partial(analysis, ctx) -> list[Cause]:
    """The routing mismatch beside an engine mismatch of its own on the tokens routed alike (absorbs nothing)."""
    cause, explains = routing_cause(analysis)
    return [cause] if cause is not None and not explains else []


def routing_replay_broken(analysis, ctx, cfg: RoutingConfig = RoutingConfig()) -> list[Cause]:
    """Replay said on, routes that differ or are missing on more than max_differ_share of the routed loss tokens."""
    mode = replay_on(analysis.manifest)
    s = figures(analysis) if mode is not None else None
    if s is None:
        return []
    lim = cfg.max_differ_share
    differ, missing = s["differ_share"] or 0.0, s["missing_share"] or 0.0
    if differ <= lim and missing <= lim:
        return []
    steps = [r["step"] for r in s["steps"] if (r["differ_share"] or 0.0) > lim or (r["missing_share"] or 0.0) > lim]
    layers, gone = _layers(s, "differ_share", lim / 10), _layers(s, "missing_share", lim / 10)
    ev = {"routing_replay": mode, "differ_share": differ, "missing_share": missing, "max_differ_share": lim,
          "layers": layers, "missing_layers": gone, "steps": steps, "agreement": s["agreement"],
          "overlap_mean": s["overlap_mean"], "agree": s["agree"], "disagree": s["disagree"],
          "kl_share_disagree": s["kl_share_disagree"], "router_margin": margins(analysis)}
    what = []
    if differ > lim:
        what.append(f"expert sets differ on {differ:.1%} of the routed loss tokens, at layers "
                    + ", ".join(f"{r['layer']} ({r['differ_share']:.1%})" for r in layers[:6]))
    if missing > lim:
        what.append(f"the engine's routes are missing on {missing:.1%} of them, at layers "
                    + ", ".join(str(r["layer"]) for r in gone[:6]))
    shown = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
    text = (f"routing replay is on (routing_replay={mode!r}) but did not take: " + "; ".join(what)
            + f" (limit {lim:.0%}), at steps {shown}" + _margin_text(ev["router_margin"]))
    return [Cause("routing_replay_broken", steps[0] if steps else None, "critical", ev,
                  fix_for("routing_replay_broken", analysis.manifest), text)]


# A pooled temperature fit reads the routed tokens' large, two-sided gaps as a flatter engine: absorbed too.
moe_routing_mismatch.absorbs = ("engine_mismatch", "engine_precision", "engine_temperature_mismatch")
routing_replay_broken.absorbs = ("moe_routing_mismatch", "engine_mismatch", "engine_precision",
                                 "engine_temperature_mismatch")
