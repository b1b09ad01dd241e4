"""The result store (kldiag/analysis/cache/store.py, codec.py): a stored result equals a recomputation field
by field; a new part, other settings or a corrupt entry make a miss, never a crash; nothing is stored
for a run with a skipped part, without the cache, or where the cache cannot be written."""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.cache import codec, store
from kldiag.diagnosis import causes as C
from kldiag.diagnosis import core, diagnose
from kldiag.diagnosis.detectors import detectors
from kldiag.diagnosis.types import Cause
from kldiag.mismatch import whatif as W
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import dashboard
from kldiag.views import mismatch as VM

CFG = SynthConfig(steps=12, seqs_per_step=8, seq_len=(8, 40), blowup_step=6, blowup_frac=0.05,
                  nonfinite=((8, "logp"),), rows_per_file=1500)


def same(x, y, path: str = "") -> None:
    """x equals y field by field (NaN equal to NaN, arrays and frames exactly, types too)."""
    assert type(x) is type(y), path
    if isinstance(x, pd.DataFrame):
        pd.testing.assert_frame_equal(x, y, check_exact=True)
    elif isinstance(x, pa.Table):
        assert x.equals(y, check_metadata=True), path
    elif dataclasses.is_dataclass(x):
        for f in dataclasses.fields(x):
            if f.compare:
                same(getattr(x, f.name), getattr(y, f.name), f"{path}.{f.name}")
    elif isinstance(x, dict):
        assert list(x) == list(y), path
        for k in x:
            same(x[k], y[k], f"{path}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), path
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            same(a, b, f"{path}[{i}]")
    elif isinstance(x, np.ndarray):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert np.array_equal(x, y, equal_nan=x.dtype.kind in "fc"), path
    elif isinstance(x, float) and math.isnan(x):
        assert math.isnan(y), path
    else:
        assert x == y, path


def roundtrip(value):
    return codec.decode(codec.encode(value))


def test_codec_roundtrip_exact():
    frame = pd.DataFrame({"step": np.arange(4, dtype=np.int64), "v": [0.1, np.nan, np.inf, -0.0],
                          "ok": [True, False, True, True], "name": ["a", None, "c", "d"]})
    value = {"nan": math.nan, "inf": -math.inf, 3: (1, "x", None), "set": {1, 2}, "f32": np.float32(0.1),
             "i8": np.int8(-3), "bool": np.bool_(True), "arr": np.arange(6, dtype=np.float32).reshape(2, 3),
             "frame": frame, "indexed": frame.set_index("step"), "table": pa.table({"a": [1, 2], "b": ["x", None]}),
             "path": Path("/tmp/x"), "cause": Cause("numerical_fault", 3, "critical", {"steps": [3]}, "fix it"),
             "empty": pd.DataFrame(), "big": 1 << 70}
    same(roundtrip(value), value)


def test_codec_refuses_what_it_cannot_encode_exactly():
    @dataclasses.dataclass
    class Foreign:  # not a kldiag class: never rebuilt from a file
        x: int = 1

    for value in (Foreign(), object(), pd.DataFrame({"c": pd.Categorical(["a"])}), 1j):
        with pytest.raises(codec.Uncacheable):
            codec.encode(value)
    arrays = codec.encode(Cause("x", None, "info", {}, ""))
    arrays[codec.TREE] = np.frombuffer(bytes(arrays[codec.TREE]).replace(b"kldiag.", b"os.pa."), np.uint8)
    with pytest.raises(ValueError):
        codec.decode(arrays)


@pytest.fixture()
def run(tmp_path) -> Path:
    path = tmp_path / "run"
    make_run(path, CFG)
    return path


def fresh(run: Path, config: AnalysisConfig = AnalysisConfig()):
    return analyze(run, config, dashboard.reducers())


def entries(run: Path, name: str = "") -> list[Path]:
    folder = run / ".kldiag" / store.FOLDER
    return sorted(folder.glob(f"{name}*.res")) if folder.is_dir() else []


def recomputed(a):
    return core._diagnose(a, core.DiagnosisConfig(), detectors())


def test_stored_diagnosis_equals_a_fresh_one(run, monkeypatch):
    first = diagnose(fresh(run))
    assert first.causes and len(entries(run, "diagnosis")) == 1
    a = fresh(run)  # another process's analysis of the same parts: read from the store
    monkeypatch.setattr(core, "_diagnose", lambda *args: pytest.fail("recomputed on a hit"))
    hit = diagnose(a)
    monkeypatch.undo()
    same(hit, recomputed(a))
    same(hit, first)


def test_new_part_other_settings_and_corrupt_entries_are_misses(run):
    diagnose(fresh(run))
    make_run(run, CFG, steps=range(12, 16), manifest=False)  # one more part: another key
    a = fresh(run)
    same(diagnose(a), recomputed(a))
    assert len(entries(run, "diagnosis")) == 2
    b = fresh(run, AnalysisConfig(weight_limit=5.0))  # other thresholds: another key
    same(diagnose(b), recomputed(b))
    assert len(entries(run, "diagnosis")) == 3
    for i, path in enumerate(entries(run, "diagnosis")):  # truncated, garbage, emptied
        data = path.read_bytes()
        path.write_bytes([data[: len(data) // 2], b"not a cache file", b""][i])
    for analysis in (a, b):
        same(diagnose(analysis), recomputed(analysis))


def test_tree_corrupted_inside_a_valid_file_is_a_miss(run):
    diagnose(fresh(run))
    (path,) = entries(run, "diagnosis")
    from kldiag.analysis import protocol as reduce

    raw = dict(reduce.load_arrays(path))
    raw[codec.TREE] = np.frombuffer(b'{"__nope": 1}', np.uint8)
    assert reduce.save_arrays(path, raw)
    a = fresh(run)
    same(diagnose(a), recomputed(a))


def test_nothing_stored_without_cache_with_a_skipped_part_or_unwritable(run):
    diagnose(fresh(run, AnalysisConfig(use_cache=False)))
    assert not entries(run)
    (run / ".kldiag" / store.FOLDER).parent.mkdir(exist_ok=True)
    (run / ".kldiag" / store.FOLDER).write_text("a file where the folder goes: nothing can be written")
    a = fresh(run)
    same(diagnose(a), recomputed(a))  # still works, stores nothing
    (run / ".kldiag" / store.FOLDER).unlink()
    part = sorted(run.glob("tokens/rank-*/part-*.parquet"))[-1]
    part.write_bytes(b"garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = fresh(run)
        assert a.skipped and store.MEMO not in a.memo
        diagnose(a)
    assert not entries(run)


def test_foreign_detector_is_not_stored(run, monkeypatch):
    def extra(analysis, ctx):
        return []

    monkeypatch.setattr(C, "DETECTORS", [*C.DETECTORS, extra])
    diagnose(fresh(run))
    assert not entries(run, "diagnosis")


def test_warnings_given_again_on_a_hit(run, monkeypatch):
    def failing(analysis, ctx):
        raise RuntimeError("boom")

    failing.__module__ = "kldiag.diagnosis.causes"  # a built-in that fails: warned, its cause left out
    monkeypatch.setattr(C, "DETECTORS", [*C.DETECTORS, failing])
    for _ in range(2):
        with pytest.warns(UserWarning, match="boom"):
            diagnose(fresh(run))
    assert len(entries(run, "diagnosis")) == 1


def test_mismatch_views_from_the_store_equal_recomputed(run, monkeypatch):
    a = fresh(run)
    stored = [VM.view_of(a), VM.whatif_frame(VM.view_of(a), W.WhatIf()), VM.crosswalk_frame(a, "verl")]
    b = fresh(run)
    monkeypatch.setattr(VM, "compute", lambda *args: pytest.fail("recomputed on a hit"))
    view = VM.view_of(b)
    hit = [view, VM.whatif_frame(view, W.WhatIf()), VM.crosswalk_frame(b, "verl")]
    monkeypatch.undo()
    from kldiag.crosswalk import crosswalk, null_reasons
    from kldiag.mismatch import sample as SS

    table = crosswalk(b.run_dir, "verl", sample=SS.sample_of(b))
    again = [VM.compute(b), W.replay(view.tokens, W.WhatIf()).to_pandas(), (table.to_pandas(), null_reasons(table))]
    for x, y, z in zip(stored, hit, again, strict=True):
        same(y, z)
        same(x, z)
    assert view.has_sampler and len(view.tokens) > 0
    from kldiag.analysis.reducers import turns as TU
    from kldiag.views import turns as VT

    VT.view_of(a)
    monkeypatch.setattr(TU, "turns_of", lambda *args: pytest.fail("recomputed on a hit"))
    turns = VT.view_of(b)
    monkeypatch.undo()
    same(turns, VT.TurnsView(TU.turns_of(b)))
    assert turns.summary["steps"]


def test_old_entries_pruned(run, monkeypatch):
    monkeypatch.setattr(store, "KEEP", 2)
    view = VM.view_of(fresh(run))
    for cap in (1.5, 2.0, 3.0, 4.0):
        VM.whatif_frame(view, W.WhatIf(cap=cap))
    assert len(entries(run, "whatif")) == 2
    assert len(entries(run, "mismatch_view")) == 1  # another name's entries are left alone


def test_code_version_digests_every_kldiag_module(monkeypatch):
    """The key's code digest covers the faces' modules (a view's, a fit's), not kldiag/analysis alone: an edit
    of the parity fit or of the Mismatch view makes their stored results misses."""
    read: list[Path] = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or real(self))
    store.code_version.cache_clear()
    try:
        store.code_version()
    finally:
        monkeypatch.undo()
        store.code_version.cache_clear()
    pkg = Path(store.__file__).resolve().parents[2]
    names = {p.relative_to(pkg).as_posix() for p in read}
    assert {"mismatch/parity.py", "views/mismatch.py", "diagnosis/core.py", "analysis/cache/store.py"} <= names
