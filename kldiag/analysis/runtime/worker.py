"""One part's work, the same in this process's reader threads and in a Ray task.

`compute(part, reducers, ...)` returns every reducer's partial of the part, or the error that made the part unreadable
(the engine skips it, or raises in strict mode).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence

import pyarrow as pa

from kldiag.analysis import protocol as reduce
from kldiag.analysis.runtime import part_fold
from kldiag.errors import RunFormatError
from kldiag.format import PartInfo

PART_ERRORS = (RunFormatError, OSError, pa.ArrowException)  # a part that raises these is skipped (or strict)


def cpus() -> int:
    """The cores this process may run on: its affinity (taskset, a container's or a batch job's cpuset),
    not the machine's count, which os.cpu_count gives even to a job granted 4 of its 64 cores."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def threads(wanted: int | None) -> int:
    """Threads that read and reduce parts (AnalysisConfig.threads): `wanted`, else one per core."""
    return wanted or cpus()


def keep_freed_memory() -> None:
    """Ask glibc to keep freed buffers for reuse instead of returning them to the OS.

    The kernel allocates many batch-sized temporaries; page-faulting fresh ones costs as
    much as the arithmetic (measured in bench/analyze.py). Caps: 256 MiB kept.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: serve batch temporaries from the heap
        libc.mallopt(-1, 256 << 20)  # M_TRIM_THRESHOLD: keep up to this much freed memory
    except (OSError, AttributeError):
        pass


def release_freed_memory() -> None:
    """Give the freed memory that keep_freed_memory kept back to the OS, once a pass is over: the
    reader threads' heaps hold up to M_TRIM_THRESHOLD each, which the caller's next allocations
    (the diagnosis, a dashboard's tables) cannot reuse (measured: 400 MB after a warm analysis of a
    300M-row run with the dashboard's reducers)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def compute(part: PartInfo, reducers: Sequence[reduce.Reducer], batch_size: int) -> dict | Exception:
    """Worker entry point: {reducer name: the part's partial}, or the error that made the part unreadable."""
    keep_freed_memory()
    return part_fold.compute_part(part, reducers, batch_size, PART_ERRORS)

