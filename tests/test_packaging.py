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


# ---- the test environment: README, constraints.txt and what is installed name the same versions -------------

README_NAMES = {"torch": "torch", "transformers": "transformers", "TRL": "trl", "verl": "verl"}


def constraints() -> dict[str, str]:
    """{distribution name: version} of constraints.txt (name==version lines)."""
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert _, f"constraints.txt: {line!r} is not NAME==VERSION"
            out[name.strip().lower()] = version.strip()
    return out


def readme_versions() -> dict[str, str]:
    """{distribution: version} of the README's 'Tested with ...' sentence."""
    import re

    text = " ".join((ROOT / "README.md").read_text().split())
    sentence = text[text.index("Tested with "):].split(" on Python")[0]
    found = {README_NAMES[n]: v for n, v in re.findall(r"\b(torch|transformers|TRL|verl) (\d+(?:\.\d+)+)", sentence)}
    assert set(found) == set(README_NAMES.values()), sentence
    return found


def test_readme_and_constraints_name_the_same_versions():
    pins = constraints()
    assert {name: pins.get(name) for name in readme_versions()} == readme_versions()


def test_the_installed_versions_are_the_constrained_ones():
    """What `make setup` installed is what constraints.txt says (a local label such as +cpu aside). A
    distribution that is not installed is skipped: the suite runs without some extras too."""
    from importlib import metadata

    drift = {}
    for name, want in constraints().items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        if have.split("+", 1)[0] != want:
            drift[name] = (have, want)
    assert not drift, f"installed != constraints.txt (name: (installed, pinned)): {drift}; make clean setup"


def test_makefile_installs_with_the_constraints():
    make = (ROOT / "Makefile").read_text()
    installs = [line for line in make.splitlines() if "$(PIP) install" in line]
    assert installs and all("-c constraints.txt" in line for line in installs), installs
    assert "bash .ci/wheel_check.sh" in make and "kldiag demo $(ARGS)" in make


def test_the_version_is_written_in_one_place():
    import re

    from kldiag.version import __version__

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kldiag.version.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+(\.dev\d+)?", __version__)
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## Unreleased" in changelog or f"## {__version__}" in changelog


def test_kldiag_version(capsys):
    from kldiag.cli import main
    from kldiag.version import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"kldiag {__version__}"


def test_the_shipped_files_are_found_and_grafana_writes_them(tmp_path, capsys):
    from kldiag.cli import main
    from kldiag.cli.resources import app_main, grafana_dir

    assert app_main().name == "main.py" and (grafana_dir() / "kldiag-rules.yml").is_file()
    assert main(["grafana", "--out", str(tmp_path / "g")]) == 0
    for name in ("kldiag.json", "kldiag-rules.yml"):
        assert (tmp_path / "g" / name).read_bytes() == (ROOT / "docs" / "grafana" / name).read_bytes()


def test_setup_ships_the_app_and_the_grafana_files_inside_the_package():
    text = (ROOT / "setup.py").read_text()
    assert '"kldiag._app": "app"' in text and '"kldiag._grafana": "docs/grafana"' in text
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert "graft app" in manifest and "docs/grafana" in manifest
