"""The machine a benchmark ran on: CPU model, its vector extensions, and what numba compiles for.

    python bench/machine.py          # the lines bench/analyze.py prints first

Timings and the last bits of float sums depend on these (docs/scale.md, "What is bitwise reproducible"):
numba compiles kldiag's kernels for the host CPU unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say otherwise.
"""

from __future__ import annotations

import platform
from pathlib import Path

# /proc/cpuinfo flags that change how a vectorised loop is compiled (width, FMA contraction)
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_fp16",
                "amx_tile", "sve", "asimd")


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, list[str]]:
    """(model name, the VECTOR_FLAGS the first CPU lists) from /proc/cpuinfo; platform's answer elsewhere."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        text = Path(path).read_text()
    except OSError:
        return model, []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model", "cpu model") and value.strip():
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
        if model and flags and key == "":
            break
    return model, [f for f in VECTOR_FLAGS if f in flags]


def numba_target() -> dict[str, str]:
    """numba's compile target: the CPU name and features it gives LLVM (NUMBA_CPU_NAME/FEATURES, else the host)."""
    try:
        import numba
        from llvmlite import binding as llvm
    except ImportError:
        return {"numba": "not installed"}
    name = numba.config.CPU_NAME or llvm.get_host_cpu_name()
    features = numba.config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    enabled = sorted(f[1:] for f in features.split(",") if f.startswith("+"))
    vector = [f for f in enabled if f.startswith(("avx", "fma", "sse4", "neon", "sve"))]
    return {"numba": numba.__version__, "llvmlite": ".".join(map(str, llvm.llvm_version_info)), "cpu_name": name,
            "vector_features": ",".join(vector), "source": "NUMBA_CPU_NAME" if numba.config.CPU_NAME else "host"}


def machine_lines() -> list[str]:
    """The lines a benchmark prints first."""
    model, flags = cpu_info()
    t = numba_target()
    lines = [f"cpu: {model} ({platform.machine()}); vector extensions: {', '.join(flags) or 'none listed'}"]
    if "cpu_name" in t:
        lines.append(f"numba {t['numba']} (LLVM {t['llvmlite']}) compiles for {t['cpu_name']} ({t['source']}); "
                     f"vector features: {t['vector_features'] or 'none'}")
    else:
        lines.append("numba: not installed")
    return lines


def machine() -> dict[str, object]:
    """The same as a JSON-able dict (bench/analyze.py --json)."""
    model, flags = cpu_info()
    return {"cpu_model": model, "arch": platform.machine(), "vector_extensions": flags, **numba_target()}


if __name__ == "__main__":
    print("\n".join(machine_lines()))
