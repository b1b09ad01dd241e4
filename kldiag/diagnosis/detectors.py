"""Every cause detector kldiag runs, in the order a diagnosis runs them: one explicit list.

A detector is `f(analysis, ctx) -> list[Cause]` (kldiag.diagnosis.causes); its `absorbs` names the causes it
explains. A new cause is a new function in the module of its feature (routing, staleness, parity...) and
one line here. Detectors of other packages join with kldiag.diagnosis.causes.register and run after these.
"""

from __future__ import annotations

from kldiag.diagnosis import (
    causes,
    contract,
    low_precision,
    missing,
    parity,
    retokenize,
    routing,
    signal,
    staleness,
    truncation,
    versions,
    wrong_weights,
)

BUILTIN: tuple[causes.Detector, ...] = (
    causes.k3_weight_blowup,
    causes.clamp_dead_zone,
    causes.offpolicy_drift,
    causes.engine_mismatch,
    causes.numerical_fault,
    causes.entropy_collapse,
    truncation.engine_truncated_sampling,
    parity.engine_temperature_mismatch,
    parity.engine_mismatch,
    parity.engine_root_cause,
    retokenize.engine_retokenization,
    missing.data_missing,
    routing.moe_routing_mismatch,
    routing.moe_routing_mismatch_partial,
    routing.routing_replay_broken,
    staleness.async_staleness,
    versions.mixed_version_rollout,
    wrong_weights.engine_wrong_weights,
    low_precision.engine_low_precision,
    contract.parity_broken,
    contract.batch_variance,
    signal.kl_dominated_signal,
)


def detectors() -> list[causes.Detector]:
    """kldiag's detectors (BUILTIN), then those other packages registered."""
    return [*BUILTIN, *(d for d in causes.DETECTORS if d not in BUILTIN)]
