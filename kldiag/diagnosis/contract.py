"""Parity contracts: `parity_broken` (a true on-policy run whose engine and trainer log-probs differ) and
`batch_variance` (pi_theta != pi_old before the first optimizer step of a step).

Read from the `contract` reducer's exact counts (kldiag.analysis.reducers.contract; diagnosis.core.reducers() lists it).

- `parity_broken` (critical): the run declares a true on-policy contract (manifest config `true_on_policy`,
  which the slime hook sets from `--true-on-policy-mode`; `--set true_on_policy=true` on the command line
  otherwise) and some token in the loss has log mu != log pi_old (|D| > ContractConfig.tolerance, 0: bit for
  bit, as slime/Miles' CI checks compare them). Onset: the first step with a token off. It absorbs
  `engine_mismatch` and `engine_precision`: in a run that promises equality, any mismatch is this breach.
- `batch_variance` (warning; critical under a true on-policy contract): on the step's first micro-batch of its
  first iteration, where no optimizer step has run since pi_old was computed, log pi_theta != log pi_old. Checked
  where that first iteration is on-policy by the run's own record: the tokens whose `policy_version` is the step
  itself, or every such token of a true on-policy run (a stale pi_old, as TRL's steps_per_generation reuses, is
  no evidence). verl issue #6280: the log-prob recompute and the update ran other micro-batch sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kldiag.analysis.reducers import contract as K
from kldiag.analysis.runtime.runner import reduced
from kldiag.diagnosis import causes as C
from kldiag.diagnosis.types import Cause
from kldiag.frameworks import fix_for

TRUE_ON_POLICY = "true_on_policy"  # the manifest config key (and `--set` key)
ON = ("true", "on", "yes", "1")


@dataclass(frozen=True)
class ContractConfig:
    """Thresholds of the contract causes (every default on this screen)."""

    tolerance: float = 0.0  # |D| above this counts as off: 0 is bitwise (Miles' exact zero); NeMo-RL's CI gates
    # on gen_kl_error < 1e-3 instead, a mean, which kldiag's engine causes cover
    examples: int = 5  # steps listed in the evidence


def declared(manifest: Any) -> bool:
    """Whether the run declares a true on-policy contract (config `true_on_policy`: True or "true"/"on"...)."""
    value = (getattr(manifest, "config", None) or {}).get(TRUE_ON_POLICY)
    return value is True or (isinstance(value, str) and value.strip().lower() in ON)


def counts_of(analysis, config: ContractConfig = ContractConfig()) -> dict:
    """The contract reducer's merged partial (the one the analysis read along, else one more pass)."""
    return reduced(analysis, K.ContractReducer(config.tolerance))


def _steps_off(m: dict, check: int, k: int) -> list[dict]:
    r = K.of_check(m, check)
    out = []
    for i in [int(j) for j in r["n_off"].nonzero()[0][:k]]:
        out.append({"step": int(r["step"][i]), "tokens": int(r["n_tokens"][i]), "tokens_off": int(r["n_off"][i]),
                    "max_abs": float(r["max_abs"][i]), "first_seq": int(r["first_seq"][i]),
                    "first_pos": int(r["first_pos"][i])})
    return out


def _where(s: dict) -> str:
    f = s["first"]
    return f"step {f['step']}, sequence {f['seq']}, position {f['pos']}"


def parity_broken(analysis, ctx: C.Context, config: ContractConfig = ContractConfig()) -> list[Cause]:
    """The cause (module docstring); none when the run declares no contract or records no log mu."""
    if not declared(ctx.manifest):
        return []
    m = counts_of(analysis, config)
    s = K.summary(m, K.PARITY)
    if s is None or not s["tokens_off"]:
        return []
    ev = {**s, "tolerance": config.tolerance, "steps_off_first": _steps_off(m, K.PARITY, config.examples),
          "contract": f"manifest config {TRUE_ON_POLICY}"}
    summary = (f"the run declares true on-policy (log mu = log pi_old bit for bit) but {s['tokens_off']:,} of "
               f"{s['tokens']:,} loss tokens ({s['share_off']:.2%}) differ, on {s['steps_off']} of {s['steps']} steps; "
               f"first at {_where(s)}; max |log mu - log pi_old| {s['max_abs']:.3g} nats (step {s['max_step']})")
    return [Cause("parity_broken", s["first"]["step"], "critical", ev, fix_for("parity_broken", ctx.manifest),
                  summary)]


def batch_variance(analysis, ctx: C.Context, config: ContractConfig = ContractConfig()) -> list[Cause]:
    """The cause (module docstring); none without a first micro-batch that is on-policy by the run's record."""
    contract = declared(ctx.manifest)
    check = K.BATCH if contract else K.BATCH_FRESH
    m = counts_of(analysis, config)
    s = K.summary(m, check)
    if s is None or not s["tokens_off"]:
        return []
    scope = ("every first-iteration token of micro-batch 0 (true on-policy run)" if contract else
             "the first-iteration tokens of micro-batch 0 sampled by the step's own weights (policy_version = step)")
    ev = {**s, "scope": scope, "tolerance": config.tolerance,
          "steps_off_first": _steps_off(m, check, config.examples)}
    summary = (f"pi_theta != pi_old before any update: on {scope}, {s['tokens_off']:,} of {s['tokens']:,} tokens "
               f"({s['share_off']:.2%}) have log pi_theta != log pi_old, on {s['steps_off']} of {s['steps']} steps; "
               f"first at {_where(s)}; max |D| {s['max_abs']:.3g} nats: batch variance (the log-prob recompute and "
               "the update see other micro-batch sizes or padding), and the ratio is not 1 on-policy")
    return [Cause("batch_variance", s["first"]["step"], "critical" if contract else "warning", ev,
                  fix_for("batch_variance", ctx.manifest), summary)]


parity_broken.absorbs = ("engine_mismatch", "engine_precision")
