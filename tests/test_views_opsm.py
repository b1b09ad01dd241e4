"""The Estimators page's off-policy sequence mask from Analysis.opsm (kldiag/views/opsm.py): the same
shares as opsm_drop over every sequence's own row, at every delta, per step and over the run, whether
the sequence rows stayed in memory or were spilled to chunk files."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from kldiag import estimators as E
from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.cache import prefix
from kldiag.analysis.core import keyed, seqrows, spill, tables
from kldiag.analysis.types import OPSM_DELTAS
from kldiag.errors import KldiagError
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import opsm as VO

CFG = AnalysisConfig(use_cache=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("opsm") / "run"
    make_run(path, SynthConfig(steps=10, seqs_per_step=12, seq_len=(5, 40), ranks=2, blowup_step=6,
                               blowup_frac=0.05, vocab_size=0, rows_per_file=400))
    return path


def per_sequence(path) -> keyed.Keyed:
    """Every (step, seq) row the analysis merged, read back in one table (what the counts come from)."""
    got = {}
    real = spill.loaded

    def keep(chunks):
        for c in real(chunks):
            got.setdefault("rows", []).append(c)
            yield c

    mp = pytest.MonkeyPatch()
    mp.setattr(spill, "loaded", keep)
    try:
        a = analyze(path, AnalysisConfig(use_cache=False, top_k_sequences=10**9))  # the in-memory path
    finally:
        mp.undo()
    return a, keyed.concat(got["rows"])


def test_known_truth_and_slide():
    seqs = {"step": np.array([0, 0, 1, 1]), "seq": np.array([0, 1, 2, 3]),
            "sum_adv": np.array([-1.0, -1.0, 1.0, -0.5]), "n_adv": np.ones(4, np.int64),
            "sum_opsm": np.array([0.4, 0.004, 5.0, 0.02]), "n_opsm": np.array([4, 4, 4, 2])}
    # mean gaps: .1 .001 1.25 .01
    counts = tables.opsm_counts(seqs, (1e-4, 5e-3, 0.05, 1.0))
    assert VO.summary(counts, 1e-4) == (3, 4) and VO.summary(counts, 0.05) == (1, 4)
    assert VO.curve(counts)["masked_frac"].tolist() == [0.75, 0.5, 0.25, 0.0]
    assert VO.by_step(counts, 0.05).set_index("step")["masked_frac"].to_dict() == {0: 0.5, 1: 0.0}
    seqs["n_adv"][3] = 0  # no advantage: neither masked nor counted in the share
    assert VO.summary(tables.opsm_counts(seqs, (1e-4,)), 1e-4) == (2, 3)


def test_counts_equal_opsm_drop_on_every_sequence(run):
    a, s = per_sequence(run)
    adv = s["sum_adv"] / np.where(s["n_adv"] > 0, s["n_adv"], 1)
    adv[s["n_adv"] == 0] = np.nan
    steps = np.unique(s["step"])
    np.testing.assert_array_equal(a.opsm.step, steps)
    np.testing.assert_array_equal(a.opsm.sequences, [np.sum(s["step"] == t) for t in steps])
    assert a.opsm.deltas == OPSM_DELTAS
    for j, d in enumerate(OPSM_DELTAS):
        drop = E.opsm_drop(adv, s["sum_opsm"], s["n_opsm"], d)
        np.testing.assert_array_equal(a.opsm.masked[:, j], [np.sum(drop[s["step"] == t]) for t in steps])
    assert a.opsm.masked[:, 0].sum() > 0  # the synthetic run drifts: delta 0 masks some sequences


def test_shares_match_the_step_table_and_the_run(run):
    a = analyze(run, CFG)
    delta = 1e-4  # the analysis's default opsm_delta: the step table's opsm_masked_frac
    got = VO.by_step(a.opsm, delta)
    want = a.steps.column("opsm_masked_frac").to_numpy(zero_copy_only=False)
    np.testing.assert_allclose(got["masked_frac"].to_numpy(), want, rtol=0, atol=0)
    masked, known = VO.summary(a.opsm, delta)
    assert known == a.opsm.known.sum() and masked == a.opsm.masked[:, OPSM_DELTAS.index(delta)].sum()
    curve = VO.curve(a.opsm)
    assert list(curve["delta"]) == [d for d in OPSM_DELTAS if d > 0]
    assert np.all(np.diff(curve["masked_frac"].to_numpy()) <= 0)  # a larger delta masks no more
    with pytest.raises(KldiagError, match="pick one of"):
        VO.summary(a.opsm, 0.5)


def test_spilled_chunks_give_the_same_counts(run, tmp_path, monkeypatch):
    want = analyze(run, CFG).opsm
    monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    monkeypatch.setattr(spill, "SPILL_CHUNK_ROWS", 16)
    monkeypatch.setattr(prefix, "SEAL_EVERY", 2)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for _ in range(2):  # cold, then from the cache's chunk files
        got = analyze(copy, AnalysisConfig()).opsm
        for f in ("step", "sequences", "known", "masked"):
            np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
