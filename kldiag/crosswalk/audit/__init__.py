"""The audit: a framework's own logged metrics against the crosswalk's recomputation from the tokens.

core (`audit(run, framework, logs=...)`: per step and metric, logged against recomputed, within ATOL/RTOL,
each difference with its reason), reasons (why a difference is explained: a known framework behaviour), logs
(reading a framework's logs: W&B/TensorBoard exports, CSV, JSON lines). docs/audit.md.
"""

from kldiag.crosswalk.audit.core import (
                                         ATOL,
                                         RTOL,
                                         VERDICTS,
                                         AuditError,
                                         AuditResult,
                                         MetricAudit,
                                         audit,
                                         close,
                                         explain,
                                         rel_diff,
)
from kldiag.crosswalk.audit.logs import Logs, LogsError, detect, read_logs

__all__ = ["ATOL", "RTOL", "VERDICTS", "AuditError", "AuditResult", "Logs", "LogsError", "MetricAudit", "audit", "close",
           "detect", "explain", "read_logs", "rel_diff"]
