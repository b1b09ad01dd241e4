"""`pip install 'kldiag[torch]'` never downgrades the user's torch: the extra has no upper bound."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def test_torch_extra_has_no_upper_bound():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    torch = [r for group in extras.values() for r in group if r.replace(" ", "").startswith("torch") and
             r.replace(" ", "")[5:6] in ("", ">", "<", "=", "!", "~", ";", "[")]
    assert torch and all("<" not in r and "==" not in r for r in torch), torch


def test_readme_names_the_tested_versions():
    text = (ROOT / "README.md").read_text()
    assert all(name in text for name in ("Tested with torch 2.", "transformers 5.", "TRL 1."))
