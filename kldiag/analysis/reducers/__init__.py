"""Side reducers: passes over the tokens besides the analysis's own, each on the reducer protocol
(kldiag.analysis.protocol) and run by the one runner, cached per part like the analysis.

One module a feature, named as in every other layer (record/routes, diagnosis/routing, views/routing):
routing (MoE expert agreement), route_margin (the trainer router's confidence), staleness (asynchronous
policy lag), tasks (per task label), turns (per agentic turn), topk (distribution-level mismatch from top-k
lists), scan (entropy and sampler sums for the diagnosis), estimator_pass (the Estimators page's per-token
pass), contract (exact parity counts: log mu against log pi_old, batch variance at a step's first
iteration), signal (dead GRPO groups and the KL term's share of the gradient weight), coverage_table (which
optional inputs each step recorded), mismatch_tokens (the routed-differently and highest-mismatch tokens a
run without pi_ref leads with). base holds what they share: the clip-range-bound list reducer and the
column and ratio helpers. A new reducer is a new module here.

Public modules (imported from outside kldiag.analysis): those in __all__.
"""

from kldiag.analysis.reducers import (
                                      contract,
                                      coverage_table,
                                      estimator_pass,
                                      mismatch_tokens,
                                      route_margin,
                                      routing,
                                      scan,
                                      signal,
                                      staleness,
                                      tasks,
                                      topk,
                                      turns,
)

__all__ = ["contract", "coverage_table", "estimator_pass", "mismatch_tokens", "route_margin", "routing", "scan",
           "signal", "staleness", "tasks", "topk", "turns"]
