"""The package version, in one place (run manifests and the CLI record it)."""

__version__ = "0.1.0"
