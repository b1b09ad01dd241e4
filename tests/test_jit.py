"""kldiag.jit: numba is imported when a kernel is first called, not with the package."""

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from kldiag.jit import LazyKernel, njit

ROOT = Path(__file__).resolve().parents[1]


def run_child(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          check=True, env=env, cwd=ROOT).stdout


def test_package_import_does_not_import_numba():
    out = run_child("""
        import sys
        import kldiag, kldiag.analysis, kldiag.views.pages, kldiag.format, kldiag.diagnosis, kldiag.mismatch
        import kldiag.report, kldiag.cli, kldiag.views.dashboard, kldiag.views.estimators
        import kldiag.analysis.kernels.fused, kldiag.analysis.kernels.estimators, kldiag.analysis.reducers.scan
        print(sorted(m for m in sys.modules if m == "numba" or m.startswith("numba.")))
    """)
    assert out.strip() == "[]"


def test_kernel_imports_numba_on_first_call_and_matches_numpy():
    out = run_child("""
        import sys
        import numpy as np
        from kldiag.analysis.kernels import fastexp, scans
        assert "numba" not in sys.modules and not fastexp.exp_array.compiled
        x = np.linspace(-50.0, 50.0, 1001)
        out = np.empty_like(x)
        fastexp.exp_array(x, out)  # calls fastexp.exp, itself lazy, inside compiled code
        assert "numba" in sys.modules and fastexp.exp_array.compiled
        assert np.allclose(out, np.exp(x), rtol=4e-16, atol=0), "exp"
        starts, ordered = scans.seq_starts(np.array([0, 0, 1, 1, 1]), np.array([3, 3, 3, 4, 4]))
        print(starts.tolist(), ordered)
    """)
    assert out.strip() == "[0, 2, 3, 5] True"


@njit(inline="always", cache=False)
def _twice(v):
    return 2.0 * v


@njit(cache=False, nogil=True)
def _sum_twice(x):
    s = 0.0
    for i in range(len(x)):
        s += _twice(x[i])  # a lazy kernel called, and inlined, from compiled code
    return s


def test_lazy_kernel_compiles_with_its_options_and_calls_lazy_kernels():
    x = np.arange(10.0)
    assert isinstance(_sum_twice, LazyKernel) and _sum_twice.py_func(x) == 90.0
    assert _sum_twice(x) == 90.0
    assert _sum_twice.targetoptions["nogil"] is True  # numba's dispatcher behind it, with the options given
    assert _twice.targetoptions["inline"] == "always"
    assert len(_sum_twice.signatures) == 1
    assert pickle.loads(pickle.dumps(_sum_twice)) is _sum_twice  # by reference, as a function
    assert _sum_twice.__name__ == "_sum_twice" and "LazyKernel" in repr(_sum_twice)


def test_bare_decorator_and_positional_signature():
    @njit
    def add(a, b):
        return a + b

    assert add(2, 3) == 5
    try:
        njit("int64(int64)")
    except TypeError as e:
        assert "keyword" in str(e)
    else:
        raise AssertionError("a signature should be refused")


def test_every_module_with_a_kernel_is_in_the_stamp():
    """A kernel module left out of KERNEL_FILES would be inlined into others' cached code unseen."""
    from kldiag import jit

    package = ROOT / "kldiag"
    with_kernels = {str(p.relative_to(package)) for p in package.rglob("*.py")
                    if p.name != "jit.py" and "@njit" in p.read_text()}
    assert with_kernels == set(jit.KERNEL_FILES)


def test_a_kernels_cache_entry_is_keyed_by_every_kernel_module(tmp_path):
    """numba keys a cached kernel by its own file; kldiag's locator adds every kernel module's stamp, so an
    edit of kernels/token.py (inlined into kernels/fused.py's pass) invalidates fused.py's cached pass too."""
    from kldiag import jit
    from kldiag.analysis.kernels import fastexp

    out = np.empty(2)
    fastexp.exp_array(np.zeros(2), out)
    locator = fastexp.exp_array.dispatcher()._cache._impl._locator
    assert isinstance(locator, jit._KernelStamp)
    own, stamp = locator.get_source_stamp()
    assert stamp == jit.kernel_stamp()

    def stat(grown: int):
        def fake(path):  # kernels/token.py `grown` bytes longer, as after an edit
            st = os.stat(path)
            return SimpleNamespace(st_mtime_ns=st.st_mtime_ns,
                                   st_size=st.st_size + (grown if str(path).endswith("kernels/token.py") else 0))
        return fake

    assert jit.stamp_of(stat(0)) == stamp
    assert jit.stamp_of(stat(1)) != stamp
    outside = tmp_path / "mine.py"
    outside.write_text("def f():\n    return 1\n")
    assert locator.__class__.from_function(lambda: 1, str(outside)) is None  # another package's kernels: numba's own
