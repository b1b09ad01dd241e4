"""`diagnose(analysis) -> Diagnosis`: the episodes, the causes and the verdict of one run.

The one implementation behind `kldiag analyze` (text and --json "diagnosis"), `kldiag report`,
`kldiag watch` and the dashboard's Overview. Verdict: "unstable" when a critical cause or
episode is present (a K3 blow-up, a numerical fault, a k3_is blow-up through rho), "warning"
for a warning cause, "healthy" otherwise (info-level causes and episodes, such as `latent` or a
mismatch smaller than the policy drift, leave it healthy).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Sequence

from kldiag.analysis.cache import store
from kldiag.analysis.reducers.contract import ContractReducer
from kldiag.analysis.reducers.coverage_table import CoverageReducer
from kldiag.analysis.reducers.route_margin import RouteMarginReducer
from kldiag.analysis.reducers.routing import RoutingReducer
from kldiag.analysis.reducers.scan import ScanReducer, scan_of
from kldiag.analysis.reducers.signal import SignalReducer
from kldiag.analysis.reducers.staleness import StalenessReducer
from kldiag.analysis.reducers.tasks import TaskReducer
from kldiag.analysis.reducers.turns import TurnReducer
from kldiag.analysis.rules import episodes as EP
from kldiag.analysis.rules.alerts import rule_context
from kldiag.analysis.runtime import runner
from kldiag.diagnosis import causes as C
from kldiag.diagnosis import detectors as D
from kldiag.diagnosis import evidence
from kldiag.diagnosis import tasks as TA  # names the task that carries a cause
from kldiag.diagnosis.contract import ContractConfig
from kldiag.diagnosis.types import SEVERITIES, Cause, Diagnosis, DiagnosisConfig, Episode
from kldiag.mismatch.sample import SampleReducer


def verdict(causes: Sequence[Cause], episodes: Sequence[Episode]) -> str:
    """The worst cause's severity; a critical episode (blow-up, non-finite) is unstable in any case."""
    worst = {c.severity for c in causes} | {e.severity for e in episodes if e.severity == "critical"}
    return "unstable" if "critical" in worst else "warning" if "warning" in worst else "healthy"


def run_episodes(analysis, config: DiagnosisConfig,
                 side: dict | None = None) -> tuple[list[Episode], EP.RuleContext, dict]:
    """The run's episodes with their evidence, the rules' context and the steps as arrays. The rules
    also see the side scan's entropy_mean (the early_entropy_drop rule), aligned on the steps."""
    ctx = rule_context(analysis.config, analysis.manifest, config)
    cols = EP.table_cols(analysis.steps)
    seen = dict(cols)
    if side and "entropy_mean" in side:
        seen["entropy_mean"] = C.Context(cols, None, ctx.estimator, side=side).side_at(cols["step"], "entropy_mean")
    eps = evidence.attach(EP.episodes(seen, ctx), analysis.flags, config.evidence_tokens)
    return eps, ctx, cols


def reducers(config: DiagnosisConfig = DiagnosisConfig()) -> list:
    """What the diagnosis reads besides the analysis tables: hand them to `analyze(run, cfg, reducers)`
    and the side scan and the parity sample come from the analysis's one read of each part."""
    return [ScanReducer(config.confident_p), SampleReducer(), TurnReducer(), RoutingReducer(), StalenessReducer(),
            TaskReducer(), RouteMarginReducer(), ContractReducer(ContractConfig().tolerance), SignalReducer(),
            CoverageReducer()]


def side_scan(analysis, config: DiagnosisConfig) -> dict:
    """The extra per-step figures (entropy, confident share, token_mult_prob_error); {} on failure."""
    try:
        return scan_of(analysis, ScanReducer(config.confident_p))
    except Exception as e:  # the diagnosis never fails on its extra scan: those causes are just absent
        warnings.warn(f"kldiag: entropy/mismatch scan skipped ({type(e).__name__}: {e})", stacklevel=2)
        return {}


def _call(detector, analysis, ctx: C.Context) -> list[Cause]:
    params = [p for p in inspect.signature(detector).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return list(detector(analysis, ctx) if len(params) >= 2 else detector(analysis))


def diagnose(analysis, config: DiagnosisConfig = DiagnosisConfig(), detectors=None) -> Diagnosis:
    """Episodes, causes (each detector's, a failing detector warned about and skipped) and verdict.

    Reads no part when `analysis` was made with `reducers()`; else the ones it lacks are read together,
    in one more pass over the parts whose partials are not cached yet (`runner.read_along`); `detectors` defaults to
    kldiag.diagnosis.detectors.detectors() (kldiag's, then those other packages registered). A built-in cause is
    dropped when another detector named the same cause, or ran and lists its name in its `replaces`; any cause is
    dropped when a detector that found a cause lists its name in its `absorbs` (a root cause that explains it).
    The result is kept in the run's result store (kldiag.analysis.cache.store: keyed by the parts read, the
    analysis's settings, the manifest, `config` and the code), so a fresh process on an unchanged run
    reads it; not when `detectors` is given or a detector of another package is registered (its code
    is not in the key).
    """
    dets = D.detectors() if detectors is None else list(detectors)
    own = [f"{getattr(d, '__module__', '')}:{getattr(d, '__qualname__', d)}" for d in dets]
    if detectors is None and config is not None and all(name.startswith("kldiag.") for name in own):
        return store.cached(analysis, "diagnosis", [dataclasses.asdict(config), own],
                            lambda: _diagnose(analysis, config, dets, along=True))
    return _diagnose(analysis, config, dets, along=detectors is None)


def _read_along(analysis, config: DiagnosisConfig | None) -> None:
    """The built-in detectors' reducers that `analysis` was made without, read in one pass (runner.read_along):
    `diagnose(kldiag.analyze(run))` reads each part once more, not once per reducer. On an error each
    detector's own read goes on as before (and a failing one is warned about and skipped)."""
    reds = [r for r in reducers(config or DiagnosisConfig()) if config is not None or r.name != ScanReducer.name]
    try:
        runner.read_along(analysis, reds)
    except Exception as e:  # the detectors then read what they need themselves, as without it
        warnings.warn(f"kldiag: the diagnosis's reducers were not read in one pass ({type(e).__name__}: {e})",
                      stacklevel=3)


def _diagnose(analysis, config: DiagnosisConfig | None, dets: Sequence, along: bool = False) -> Diagnosis:
    if along:  # the built-in detectors read every one of reducers()
        _read_along(analysis, config)
    side = side_scan(analysis, config) if config is not None else {}
    eps, rctx, cols = run_episodes(analysis, config, side)
    ctx = C.Context(cols, analysis.manifest, rctx.estimator, config, side or {"step": cols["step"][:0]}, eps)
    found: list[tuple[bool, Cause]] = []
    replaced, absorbed = set(), set()
    for det in dets:
        try:
            builtin = getattr(det, "__module__", "") == C.__name__
            got = _call(det, analysis, ctx)
            found += [(builtin, c) for c in got]
            replaced |= set(() if builtin else getattr(det, "replaces", ()))
            absorbed |= set(getattr(det, "absorbs", ()) if got else ())
        except Exception as e:
            warnings.warn(f"kldiag: cause detector {getattr(det, '__name__', det)} failed ({type(e).__name__}: "
                          f"{e}); its cause is left out", stacklevel=2)
    replaced |= {c.cause for b, c in found if not b}  # a parity detector replaces ours, even with no cause
    causes = [c for b, c in found if not (b and c.cause in replaced) and c.cause not in absorbed]
    rank = {s: i for i, s in enumerate(SEVERITIES)}
    causes.sort(key=lambda c: (-rank.get(c.severity, 0), c.onset if c.onset is not None else 1 << 62))
    TA.name_carriers(analysis, causes)
    return Diagnosis(verdict(causes, eps), causes, eps)
