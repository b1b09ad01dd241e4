"""The one version check of the hooks pinned to a single framework release (OpenRLHF, SkyRL, AReaL):
the installed distribution's version, or an IntegrationError that names the supported release and the fix,
raised at attach time rather than in the middle of training."""

from __future__ import annotations

from kldiag.errors import IntegrationError


def check_release(dist: str, supported: str, version: str | None = None, what: str = "") -> str:
    """`version` (default: the installed `dist`'s) when it is the release `supported` ("==X.Y.Z"), else
    IntegrationError naming it; `what`: the API the hook relies on, said in the message."""
    from packaging.version import Version

    pin = f"{dist}=={supported.lstrip('=')}"
    if version is None:
        try:
            from importlib.metadata import version as dist_version

            version = dist_version(dist)
        except Exception as e:  # noqa: BLE001 - PackageNotFoundError and broken metadata alike
            raise IntegrationError(f"kldiag.integrations.{dist} needs {dist}{supported}: pip install {pin} ({e})") from e
    if Version(version) != Version(supported.lstrip("=")):
        raise IntegrationError(f"kldiag.integrations.{dist} supports {dist}{supported}{what}, found {dist} {version}; "
                               f"install it (pip install {pin}), or record with kldiag.Recorder by hand")
    return version
