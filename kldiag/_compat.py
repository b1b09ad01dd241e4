"""Old import paths of modules that moved when the package was laid out by stage.

`import kldiag.recorder` (and every other path below) still works and gives the module at its
new place, the same object, so attributes set on one are seen through the other. One line per
moved path; new code imports the new paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any

MOVED = {
    "kldiag.recorder": "kldiag.record.recorder",
    "kldiag._writer": "kldiag.record.writer",
    "kldiag._rows": "kldiag.record.rows",
    "kldiag.guard": "kldiag.live.guard",
    "kldiag.watch": "kldiag.live.watch",
    "kldiag.lab": "kldiag.tools.lab",
    "kldiag.demo": "kldiag.tools.demo",
    "kldiag.demo_train": "kldiag.tools.demo_train",
    "kldiag.synth": "kldiag.tools.synth",
    "kldiag.dashboard": "kldiag.cli.dashboard",
    "kldiag.report_render": "kldiag.report.render",
    "kldiag.report_mismatch": "kldiag.report.mismatch",
    "kldiag.views_dash": "kldiag.views.dash",
    "kldiag.views_estimators": "kldiag.views.estimators",
    "kldiag.views_groups": "kldiag.views.groups",
    "kldiag.views_mismatch": "kldiag.views.mismatch",
    "kldiag.analysis.cli": "kldiag.cli.analyze",
    "kldiag.crosswalk.cli": "kldiag.cli.crosswalk",
    "kldiag.export.cli": "kldiag.cli.export",
    "kldiag.diagnosis.episodes": "kldiag.analysis.rules.episodes",
    "kldiag.diagnosis.fixes": "kldiag.frameworks",
    "kldiag.diagnosis.decompose": "kldiag.mismatch.decompose",
    "kldiag.diagnosis.whatif": "kldiag.mismatch.whatif",
    "kldiag.diagnosis.tokenset": "kldiag.mismatch.tokenset",
    "kldiag.diagnosis.view": "kldiag.views.diagnosis",
    "kldiag.integrations.importers": "kldiag.importers",
    "kldiag.integrations.importers.cli": "kldiag.cli.importers",
    "kldiag.integrations.importers.slime": "kldiag.importers.slime",
    "kldiag.integrations.importers.nemo_rl": "kldiag.importers.nemo_rl",
    "kldiag.integrations.importers.prime_rl": "kldiag.importers.prime_rl",
    "kldiag.crosswalk.audit_reasons": "kldiag.crosswalk.audit.reasons",
    "kldiag.crosswalk.logs": "kldiag.crosswalk.audit.logs",
    "kldiag.integrations.trl_guard": "kldiag.integrations.trl.guard",
    "kldiag.integrations.trl_histograms": "kldiag.integrations.trl.histograms",
    "kldiag.integrations.trl_kernel": "kldiag.integrations.trl.kernel",
    "kldiag.integrations.trl_metrics": "kldiag.integrations.trl.metrics",
    "kldiag.integrations.trl_routes": "kldiag.integrations.trl.routes",
    "kldiag.integrations.verl_batch": "kldiag.integrations.verl.batch",
    "kldiag.integrations.verl_metrics": "kldiag.integrations.verl.metrics",
    "kldiag.integrations.verl_plugin": "kldiag.integrations.verl.plugin",
    "kldiag.integrations.verl_trainer": "kldiag.integrations.verl.trainer",
    "kldiag.integrations.slime_metrics": "kldiag.integrations.slime.metrics",
    "kldiag.integrations.failures": "kldiag.integrations.common.failures",
    "kldiag.integrations.ids": "kldiag.integrations.common.ids",
    "kldiag.integrations.step_metrics": "kldiag.integrations.common.step_metrics",
    "kldiag.integrations.versions": "kldiag.integrations.common.versions",
}


class _Alias(importlib.abc.Loader):
    def create_module(self, spec: Any) -> None:
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module: Any) -> None:
        # the import system reads sys.modules back after exec_module: the old name gets the new module
        sys.modules[module.__name__] = importlib.import_module(MOVED[module.__name__])


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(name, _Alias(), is_package=name == "kldiag.integrations.importers")


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
