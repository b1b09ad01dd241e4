"""Where and how reducers run over a run's parts.

runner (`Pass`: each part read at most once for every reducer lacking its cached partial, merged in part
order; `reduced`, `read_along`, `parts_of` for the faces), part_fold (one part's batches folded into every
reducer, with the next part decoded meanwhile), worker (one part's work, the same in a reader thread and a
Ray task), ray (the Ray backend), lost (parts whose rows could not be used), context (the tokens around
given tokens, read from a few row groups).

Public modules (imported from outside kldiag.analysis): those in __all__.
"""

from kldiag.analysis.runtime import context, runner

__all__ = ["context", "runner"]
