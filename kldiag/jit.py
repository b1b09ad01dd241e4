"""numba's `njit`, compiled on the first call: importing a kernel's module does not import numba.

numba's import costs about a quarter of a second, and every process that imports kldiag.format or
kldiag.analysis reached it through the kernels' modules; most (a warm page render, a CLI command
that reads a cache) never call a kernel. `njit(**options)` here returns a `LazyKernel`: the plain
Python function and the options, given to `numba.njit` on the first call (numba is imported then).

Kernels call each other inside compiled code. numba resolves such a global by its type
(`typeof` reads a `_numba_type_` attribute, numba/core/typing/typeof.py `typeof_impl`) and inlines
a callee declared `inline="always"` by duck typing (`targetoptions` and `py_func`,
numba/core/untyped_passes.py `InlineInlinables._do_work`, numba 0.68): a LazyKernel answers
every attribute not its own from the compiled dispatcher, so to numba it is the dispatcher, and the
caller's code (cached on disk with cache=True) is what an eager `numba.njit` would have produced.

numba's disk cache knows a kernel's own file only: an entry is reused while that file's mtime and size
hold (numba/core/caching.py, `_SourceFileBackedLocatorMixin.get_source_stamp`), though the machine code
holds every kernel it calls or inlines from other files (fused_token's per-token maths in fused's and
fused_ride's passes). So kldiag's kernels are cached by locators that add `kernel_stamp()`, the mtimes
and sizes of every module listed in KERNEL_FILES: an edit of one of them compiles every kernel again,
never runs a stale one (tests/test_jit.py keeps the list complete).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

_LOCK = threading.Lock()  # two threads calling a kernel first build one dispatcher
PACKAGE = Path(__file__).resolve().parent
# Every module that defines a kernel, relative to the package (tests/test_jit.py: no module is missing).
KERNEL_FILES = ("analysis/kernels/estimators.py", "analysis/kernels/fastexp.py", "analysis/kernels/fused.py",
                "analysis/kernels/ride.py", "analysis/kernels/token.py", "analysis/kernels/scans.py",
                "analysis/kernels/turns.py", "analysis/kernels/side_scan.py",
                "integrations/trl/kernel.py", "mismatch/sample.py", "mismatch/whatif.py",
                "analysis/kernels/contract.py", "analysis/kernels/signal.py", "analysis/kernels/blocks.py",
                "analysis/kernels/mismatch_top.py", "analysis/kernels/context.py")


class LazyKernel:
    """A numba kernel made on first use: `numba.njit(**options)(py_func)`.

    Calls and every attribute a numba dispatcher has (`py_func` aside, which needs no numba) go to
    that dispatcher; pickles as a reference to its module's global, as a function does.
    """

    def __init__(self, py_func: Callable, options: dict[str, Any]):
        functools.update_wrapper(self, py_func)
        self.py_func, self.options = py_func, dict(options)
        self._dispatcher = None

    def dispatcher(self):
        """The numba dispatcher (built, and numba imported, on the first call)."""
        if self._dispatcher is None:
            with _LOCK:
                if self._dispatcher is None:
                    import numba

                    install_locators()
                    self._dispatcher = numba.njit(**self.options)(self.py_func)
        return self._dispatcher

    @property
    def compiled(self) -> bool:
        """Whether the dispatcher exists (numba imported for it); not whether a signature is compiled."""
        return self._dispatcher is not None

    def __call__(self, *args, **kwargs):
        return self.dispatcher()(*args, **kwargs)

    def __getattr__(self, name: str):
        # Only attributes missing from the instance land here; dunders (pickle, copy, inspect probing
        # them) must not import numba.
        if name.startswith("__") or name in ("_dispatcher", "py_func", "options"):
            raise AttributeError(name)
        return getattr(self.dispatcher(), name)

    def __reduce__(self):
        return _global, (self.__module__, self.__qualname__)

    def __repr__(self) -> str:
        return f"<LazyKernel {self.__module__}.{self.__qualname__} {'compiled' if self.compiled else 'lazy'}>"


def _global(module: str, qualname: str) -> Any:
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def njit(*args, **options):
    """`numba.njit`, deferred: `@njit(**options)` or `@njit` on a function gives a LazyKernel."""
    if args and callable(args[0]) and len(args) == 1 and not options:
        return LazyKernel(args[0], {})
    if args:
        raise TypeError("kldiag.jit.njit takes options by keyword (no signatures)")
    return lambda fn: LazyKernel(fn, options)


@functools.lru_cache(maxsize=1)
def kernel_stamp() -> str:
    """sha1 of the name, mtime and size of each of KERNEL_FILES (once per process)."""
    return stamp_of(os.stat)


def stamp_of(stat: Callable[[Path], Any]) -> str:
    """kernel_stamp() with the files' `stat` given (a test's)."""
    h = hashlib.sha1()
    for name in KERNEL_FILES:
        try:
            st = stat(PACKAGE / name)
            h.update(f"{name} {st.st_mtime_ns} {st.st_size}\n".encode())
        except OSError:
            h.update(f"{name} -\n".encode())
    return h.hexdigest()


class _KernelStamp:
    """A numba cache locator for kldiag's own files whose source stamp also holds kernel_stamp()."""

    @classmethod
    def from_function(cls, py_func, py_file):
        try:
            inside = Path(py_file).resolve().is_relative_to(PACKAGE)
        except (OSError, ValueError):
            inside = False
        return super().from_function(py_func, py_file) if inside else None  # type: ignore[misc]

    def get_source_stamp(self):
        return super().get_source_stamp(), kernel_stamp()  # type: ignore[misc]


_INSTALLED: list = []


def install_locators() -> None:
    """Put kldiag's locators before numba's own (the same three, in numba's order: NUMBA_CACHE_DIR, the
    source tree's __pycache__, the user-wide cache), once."""
    if _INSTALLED:
        return
    from numba.core import caching

    ours = []
    for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"):
        base = getattr(caching, name, None) or getattr(caching, f"_{name}")  # numba < 0.62: _-prefixed
        ours.append(type(f"Kldiag{name}", (_KernelStamp, base), {}))
    impl = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
    impl._locator_classes[:0] = ours
    _INSTALLED.extend(ours)
