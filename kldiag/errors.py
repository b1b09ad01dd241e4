"""Every exception kldiag raises on purpose. Each message names the fix."""

from __future__ import annotations


class KldiagError(Exception):
    """Base class: catch this to handle any error kldiag raises on purpose."""


class UnknownEstimatorError(KldiagError, ValueError):
    """An estimator name that is not in the registry."""


class RunFormatError(KldiagError):
    """A path that is not a kldiag run, or a run whose files do not follow format v1."""


class NotARunError(RunFormatError, FileNotFoundError):
    """The path has no run.json manifest."""


class UnsupportedFormatVersionError(RunFormatError):
    """The manifest declares a format version this kldiag cannot read."""


class SchemaError(RunFormatError):
    """A part file lacks a required column or stores it with the wrong type."""


class CorruptPartError(RunFormatError):
    """A part file cannot be opened as Parquet (truncated, or foreign bytes)."""


class StorageError(KldiagError, OSError):
    """A run URI that cannot be opened, listed or written: a missing bucket, refused access,
    an unreachable endpoint, a scheme with no filesystem installed. Names the URI, never the
    credentials."""


class EmptyRunError(KldiagError):
    """A run directory with no published token rows yet."""


class RecorderError(KldiagError):
    """The recorder could not write (raised only in strict mode)."""


class IntegrationError(KldiagError):
    """A trainer integration cannot attach (for example an unsupported trainer version)."""


class EngineError(KldiagError):
    """The analysis engine cannot run: an engine whose optional extra is not installed
    (`pip install 'kldiag[ray]'`), a cluster that cannot be reached, a part that keeps
    failing on the cluster (named), or workers running another kldiag version."""


class DumpError(KldiagError):
    """A framework dump that `kldiag import` cannot read: a corrupt or foreign file (named;
    skipped unless --strict), a pickle that needs --trust-pickle, an empty source."""


class UnsupportedDumpVersionError(DumpError):
    """A framework dump whose format version the importer does not know (named with the version)."""


class ExportError(KldiagError):
    """`kldiag export` cannot write: the exporter's optional extra is missing
    (`pip install 'kldiag[tensorboard]'`), or LOGDIR already holds another run's export."""
