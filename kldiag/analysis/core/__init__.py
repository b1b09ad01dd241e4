"""The analysis's own reducer: one record batch -> partials -> tables.

batch (a record batch's columns as kernel inputs, the thresholds), stats (one batch's per-step, per-sequence
and flagged-row partials from the compiled pass), around (the token ids around each flagged row, read with its
batch), keyed (mergeable keyed tables), bins (histogram edges as integer arithmetic), partials
(`AnalysisReducer`: a part's Partial, merged in part order), spill and seqrows (sequence rows kept on disk),
tables (the final steps, sequences, flags, histograms and the trainer's own KL), slime_kl and verl_kl (a
framework's KL as it logs it), flagged and coverage (what the faces say about flags and missing columns).

Public modules (imported from outside kldiag.analysis): those in __all__.
"""

from kldiag.analysis.core import bins, coverage, flagged, keyed, slime_kl, tables, verl_kl

__all__ = ["bins", "coverage", "flagged", "keyed", "slime_kl", "tables", "verl_kl"]
