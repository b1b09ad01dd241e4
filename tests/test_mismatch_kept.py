"""kldiag/mismatch/kept.py: a refresh whose token sample did not change (the new part's step is not a
sampled one) reuses the fits on it, and every value equals a cold analysis's; a sample that changed is fit again."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.diagnosis import diagnose
from kldiag.diagnosis import truncation as TR
from kldiag.mismatch import kept as K
from kldiag.mismatch import parity as P
from kldiag.mismatch import sample as SS
from kldiag.mismatch import signatures as S
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import dashboard as VD

CFG = SynthConfig(steps=8, seqs_per_step=12, seq_len=(10, 40), vocab_size=0, mismatch_scale=0.05, seed=3)


def _fits(a):
    return P.report_for(a), S.report_for(a), TR.report_for(a)


def _same(x, y, path=""):
    """Deep equality of two fit results (dataclasses of numbers, arrays, dicts), NaN equal to NaN."""
    if dataclasses.is_dataclass(x):
        assert type(x) is type(y), path
        for f in dataclasses.fields(x):
            _same(getattr(x, f.name), getattr(y, f.name), f"{path}.{f.name}")
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), path
        for k in x:
            _same(x[k], y[k], f"{path}[{k}]")
    elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
        assert np.array_equal(np.asarray(x), np.asarray(y), equal_nan=np.asarray(x).dtype.kind == "f"), path
    elif isinstance(x, list | tuple):
        assert len(x) == len(y), path
        for i, (a, b) in enumerate(zip(x, y, strict=True)):
            _same(a, b, f"{path}[{i}]")
    elif isinstance(x, float) and math.isnan(x):
        assert isinstance(y, float) and math.isnan(y), path
    else:
        assert x == y, (path, x, y)


@pytest.fixture()
def grown(tmp_path, monkeypatch):
    monkeypatch.setattr(SS, "sample_stride", lambda parts, max_tokens: 2)  # the even steps are sampled
    K.forget()
    run = tmp_path / "run"
    make_run(run, CFG)
    analyze(run, AnalysisConfig(), VD.reducers())  # the cache filled (a warm analysis reads the sample from it)
    yield run
    K.forget()


def test_a_refresh_with_the_same_sample_reuses_the_fits_equal_to_cold(grown):
    first = analyze(grown, AnalysisConfig(), VD.reducers())
    before = _fits(first)
    assert all(f is not None for f in before) and SS.sample_of(first).stride == 2
    make_run(grown, dataclasses.replace(CFG, steps=10), steps=range(9, 10), manifest=False)  # step 9: not sampled
    again = analyze(grown, AnalysisConfig(), VD.reducers())
    after = _fits(again)
    assert all(a is b for a, b in zip(after, before, strict=True))  # kept: not fit again
    K.forget()
    cold = analyze(grown, AnalysisConfig(use_cache=False), VD.reducers())  # in memory: nothing kept applies
    for a, b in zip(after, _fits(cold), strict=True):
        _same(a, b)
    assert diagnose(again).to_dict() == diagnose(cold).to_dict()


def test_a_sample_that_grew_is_fit_again(grown):
    before = _fits(analyze(grown, AnalysisConfig(), VD.reducers()))
    make_run(grown, dataclasses.replace(CFG, steps=9), steps=range(8, 9), manifest=False)  # step 8: sampled
    after = _fits(analyze(grown, AnalysisConfig(), VD.reducers()))
    assert after[0] is not before[0]
    K.forget()
    for a, b in zip(after, _fits(analyze(grown, AnalysisConfig(use_cache=False), VD.reducers())), strict=True):
        _same(a, b)


def test_prepare_refresh_keeps_the_fits_of_the_run_as_it_is(grown):
    VD.prepare_refresh(grown)  # the app's Live turned on
    make_run(grown, dataclasses.replace(CFG, steps=10), steps=range(9, 10), manifest=False)
    a = analyze(grown, AnalysisConfig(), VD.reducers())
    sample = SS.sample_of(a)
    assert K.kept(sample, "parity", P.ParityConfig(), lambda: pytest.fail("fit again")) is P.report_for(a)
