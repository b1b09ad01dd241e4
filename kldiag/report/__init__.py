"""`kldiag report`: a post-mortem of one run as one offline HTML file and a text summary.

    from kldiag.report import build_report
    report = build_report(kldiag.analyze("runs/x"))
"""

from kldiag.report.build import Report, ReportConfig, build_report

__all__ = ["Report", "ReportConfig", "build_report"]
