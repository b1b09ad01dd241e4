"""Per-step alert rules and their episodes: what fires, when it starts and ends, how severe.

episodes (the rules, `Persistence`/`sustained`, and their grouping into episodes), early (leading
indicators of a K3 blow-up and of an entropy collapse), alerts (the analysis's alerts table, one row an
episode). The causes built on them live in kldiag.diagnosis.

Public modules (imported from outside kldiag.analysis): those in __all__.
"""

from kldiag.analysis.rules import alerts, early, episodes

__all__ = ["alerts", "early", "episodes"]
