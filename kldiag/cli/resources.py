"""Where the files kldiag ships beside its code are: the dashboard app and the Grafana files.

An installed kldiag (a wheel) carries them inside the package, as kldiag/_app and kldiag/_grafana
(setup.py maps them from the source tree); a source checkout used in place (PYTHONPATH, or an editable
install) has them at app/ and docs/grafana/ beside kldiag/. Each function returns the first that exists.
"""

from __future__ import annotations

from pathlib import Path

from kldiag.errors import KldiagError

PACKAGE = Path(__file__).resolve().parents[1]  # kldiag/
CHECKOUT = PACKAGE.parent  # the source tree, when kldiag runs from one
GRAFANA_FILES = ("kldiag.json", "kldiag-rules.yml")


def _first(what: str, *candidates: Path) -> Path:
    for c in candidates:
        if c.exists():
            return c
    raise KldiagError(f"{what} is not installed with this kldiag (looked at {', '.join(map(str, candidates))}): "
                      "reinstall it from a wheel or an sdist (pip install --force-reinstall kldiag), or run it "
                      "from a source checkout")


def app_main() -> Path:
    """The dashboard's Streamlit script, main.py."""
    return _first("the dashboard app", PACKAGE / "_app" / "main.py", CHECKOUT / "app" / "main.py")


def grafana_dir() -> Path:
    """The folder holding the Grafana dashboard (kldiag.json) and the alert rules (kldiag-rules.yml)."""
    return _first("the Grafana dashboard", PACKAGE / "_grafana" / GRAFANA_FILES[0],
                  CHECKOUT / "docs" / "grafana" / GRAFANA_FILES[0]).parent
