"""What kldiag keeps under RUN/.kldiag so that a warm read does not recompute.

prefix (the analysis's merged prefix: a refresh merges only new parts), side_prefix (the same for the
reducers riding along), store and codec (derived results, a diagnosis or a page's frames, as exact bytes),
files (what the cache holds and which of it this kldiag still reads; `kldiag cache`).

Public modules (imported from outside kldiag.analysis): those in __all__.
"""

from kldiag.analysis.cache import files, store

__all__ = ["files", "store"]
