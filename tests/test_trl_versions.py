"""The TRL releases the hook accepts (kldiag.frameworks.trl.SUPPORTED) other than the installed one are
checked against their own code: every GRPOTrainer method kldiag.integrations.trl wraps, and every
GRPOConfig field, read from that release's wheel (ast, never imported) must equal the installed TRL's.

TRL 1.15's GRPOTrainer cannot train on a CPU-only torch (its fused LM head needs triton), so the
end-to-end hook tests run on the installed 1.16; this is what makes 1.15 a supported release.
`make setup` downloads the 1.15 wheel to .venv/wheels (or set TRL_WHEELS=DIR)."""

from __future__ import annotations

import ast
import inspect
import os
import zipfile
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")

from kldiag.integrations.trl import _REQUIRED_METHODS, _TRL_MAX, _TRL_MIN  # noqa: E402

WHEELS = Path(os.environ.get("TRL_WHEELS") or Path(__file__).resolve().parent.parent / ".venv" / "wheels")
OTHER_RELEASES = ["1.15.0"]  # every accepted minor release besides the installed one


def _class(text: str, name: str) -> ast.ClassDef:
    return next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == name)


def _wheel_source(version: str, member: str) -> str:
    wheel = WHEELS / f"trl-{version}-py3-none-any.whl"
    if not wheel.is_file():
        pytest.skip(f"no {wheel.name} in {WHEELS}: pip download --no-deps trl=={version} -d {WHEELS}")
    return zipfile.ZipFile(wheel).read(member).decode()


def _methods(cls: ast.ClassDef, text: str) -> dict[str, str]:
    return {n.name: ast.get_source_segment(text, n) for n in cls.body if isinstance(n, ast.FunctionDef)}


def test_the_accepted_range_is_the_checked_releases():
    accepted = {(1, minor) for minor in range(_TRL_MIN[1], _TRL_MAX[1])}
    installed = tuple(int(x) for x in trl.__version__.split(".")[:2])
    assert accepted == {installed} | {tuple(int(x) for x in v.split(".")[:2]) for v in OTHER_RELEASES}


@pytest.mark.parametrize("version", OTHER_RELEASES)
def test_wrapped_methods_are_the_installed_releases(version):
    text = _wheel_source(version, "trl/trainer/grpo_trainer.py")
    theirs = _methods(_class(text, "GRPOTrainer"), text)
    installed = inspect.getsource(inspect.getmodule(trl.GRPOTrainer))
    ours = _methods(_class(installed, "GRPOTrainer"), installed)
    for name in _REQUIRED_METHODS:
        assert name in theirs, f"trl {version} has no GRPOTrainer.{name}"
        assert theirs[name] == ours[name], f"GRPOTrainer.{name} differs in trl {version}"


@pytest.mark.parametrize("version", OTHER_RELEASES)
def test_config_fields_are_the_installed_releases(version):
    def fields(text: str) -> set[str]:
        return {n.target.id for n in _class(text, "GRPOConfig").body if isinstance(n, ast.AnnAssign)}

    installed = inspect.getsource(inspect.getmodule(trl.GRPOConfig))
    assert fields(_wheel_source(version, "trl/trainer/grpo_config.py")) == fields(installed)
