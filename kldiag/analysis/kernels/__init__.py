"""The compiled loops (numba, float64 inside): no pyarrow, no files, no state. Internal to kldiag.analysis.

One record batch, as the analysis reads it: core/batch.py turns its columns into numpy arrays (float32
log-probs as stored, NaN at nulls); scans.seq_starts finds the runs of equal (step, seq); fused.fused_pass
walks the rows once, chunk by chunk, and for each token computes in token.py's inlined maths d = logp_ref -
logp and x = logp - logp_old, then k1, k2, k3 = expm1(d) - d, the weights 1 - exp(d) and rho = exp(x)
(fastexp's vectorised exp/expm1), the engine mismatch against logp_sampler, the bins of four histograms and
the flags; it adds each into per-sequence and per-step sums. ride.py is the same pass with the Estimators
page's per-token work (estimators.py) riding in it, side_scan.py the diagnosis's entropy and sampler sums,
turns.py the per-turn pass. Every kernel is checked equal to kldiag.estimators (tests/test_fused*.py).

Nothing outside kldiag.analysis imports these modules: the rooms above reach them through named public
functions (reducers/estimator_pass.py, reducers/scan.py).
"""

__all__: list[str] = []
