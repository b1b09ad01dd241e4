"""bench/machine.py: the CPU lines the benchmarks print first (model, vector extensions, numba's target)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import machine  # noqa: E402 - bench/machine.py, a script's module


def test_cpu_info_reads_the_model_and_the_vector_flags(tmp_path):
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nmodel name\t: AMD EPYC 9654 96-Core Processor\n"
                                      "flags\t\t: fpu sse4_2 avx avx2 fma avx512f bmi2\n\nprocessor\t: 1\n"
                                      "model name\t: other\nflags\t\t: fpu\n")
    model, flags = machine.cpu_info(str(tmp_path / "cpuinfo"))
    assert model == "AMD EPYC 9654 96-Core Processor" and flags == ["sse4_2", "avx", "avx2", "fma", "avx512f"]


def test_the_lines_name_numbas_target():
    lines = machine.machine_lines()
    assert lines[0].startswith("cpu: ") and "vector extensions" in lines[0]
    assert lines[1].startswith("numba ") and " compiles for " in lines[1]
    assert machine.machine()["cpu_name"]
