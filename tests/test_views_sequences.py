"""kldiag/views/sequences.py: what the pages show of the sequence table is the same whether the table is
in memory (a short run) or on disk (a long run's, read with predicate pushdown)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.cache import prefix
from kldiag.analysis.core import seqrows
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import sequences as VS
from kldiag.views.numbers import fault_first

CFG = AnalysisConfig(use_cache=False)


def _run(path, nonfinite=()):
    make_run(path, SynthConfig(steps=10, seqs_per_step=8, seq_len=(5, 30), ranks=2, blowup_step=5,
                               blowup_frac=0.05, nonfinite=nonfinite, vocab_size=0, rows_per_file=400))
    return path


@pytest.fixture(scope="module", params=["healthy", "faulty"])
def both(request, tmp_path_factory):
    """(in-memory analysis, on-disk analysis) of one run."""
    path = _run(tmp_path_factory.mktemp(request.param) / "run",
                ((6, "logp"), (3, "logp_ref")) if request.param == "faulty" else ())
    mem = analyze(path, CFG)
    mp = pytest.MonkeyPatch()
    mp.setattr(seqrows, "SPILL_ROWS", 0)
    mp.setattr(seqrows, "ROW_GROUP", 8)  # many row groups: the queries skip most
    mp.setattr(prefix, "SEAL_EVERY", 2)
    try:
        disk = analyze(path, CFG)
    finally:
        mp.undo()
    assert mem.sequence_rows is None and disk.sequence_rows is not None
    return mem, disk


def test_worst_is_nlargest(both):
    mem, disk = both
    whole = mem.sequences.to_pandas()
    for n in (1, 5, len(whole), len(whole) + 3):
        want = whole.nlargest(n, VS.WORST_BY).reset_index(drop=True)
        for a in both:
            pd.testing.assert_frame_equal(VS.worst(a, n).reset_index(drop=True), want)


def test_of_step_count_and_steps(both):
    mem, disk = both
    whole = mem.sequences.to_pandas()
    assert VS.count(mem) == VS.count(disk) == len(whole)
    steps = sorted(whole["step"].unique().tolist())
    assert VS.steps_with_sequences(mem) == VS.steps_with_sequences(disk) == steps
    for step in (steps[0], steps[len(steps) // 2], steps[-1], steps[-1] + 100):
        want = whole[whole["step"] == step].reset_index(drop=True)
        for a in both:
            pd.testing.assert_frame_equal(VS.of_step(a, step).reset_index(drop=True), want, check_dtype=False)


def test_first_to_show_is_fault_first(both):
    mem, _ = both
    top = fault_first(mem.sequences.to_pandas()).iloc[0]
    want = (int(top["step"]), int(top["seq"]))
    assert VS.first_to_show(mem) == VS.first_to_show(both[1]) == want


def test_first_to_show_ranks_no_piece(both, monkeypatch):
    """On disk, the sequence to open on is found from the row groups' statistics: worst() (which ranks every
    piece's rows) is not called, and the answer is fault_first's."""
    mem, disk = both
    top = fault_first(mem.sequences.to_pandas()).iloc[0]
    monkeypatch.setattr(seqrows.SequenceRows, "worst", lambda *a, **k: pytest.fail("ranked every piece"))
    assert VS.first_to_show(disk) == (int(top["step"]), int(top["seq"]))


def test_tokens_reads_the_group_with_the_sequence(tmp_path, monkeypatch):
    """tokens() of a sequence with siblings in its GRPO group reads them in the same pass (the Sequence page
    shows the group below it): group_tokens() of that group, in any order, reads no part; every frame is
    read_sequence's, bit for bit. A sequence alone in its group is read alone."""
    from kldiag.format import Run
    from kldiag.views import groups as VG
    from kldiag.views import pages as V

    path = tmp_path / "run"
    make_run(path, SynthConfig(steps=3, seqs_per_step=9, seq_len=(5, 30), group_size=4, vocab_size=16))
    a = analyze(path)
    at = VS.of_step(a, 1)
    seq = int(at["seq"].iloc[4])  # step 1: sequences 9-17, groups of seq // 4
    sib = VG.siblings(at, 1, seq)["seq"].astype(int).tolist()
    assert len(sib) == 4 and sib[0] == seq
    reads = []
    real = Run.read_rows
    monkeypatch.setattr(Run, "read_rows", lambda self, *x, **k: reads.append(x[1]) or real(self, *x, **k))
    one = VS.tokens(a, 1, seq)
    group = VS.group_tokens(a, 1, sib[::-1])
    assert reads == [[1]] and sorted(group) == sorted(sib)
    monkeypatch.undo()
    pd.testing.assert_frame_equal(one, V.read_sequence(path, 1, seq), check_exact=True)
    for s in sib:
        pd.testing.assert_frame_equal(group[s], V.read_sequence(path, 1, s), check_exact=True)
    at0 = VS.of_step(a, 0)
    alone = int(at0["seq"].iloc[-1])  # step 0's 9th sequence: a group of one
    assert VG.siblings(at0, 0, alone)["seq"].tolist() == [alone]
    pd.testing.assert_frame_equal(VS.tokens(a, 0, alone), V.read_sequence(path, 0, alone), check_exact=True)


def test_empty_first_to_show():
    class Empty:
        sequence_rows = None

        class sequences:  # noqa: N801 - a stand-in for a pa.Table
            @staticmethod
            def to_pandas():
                return pd.DataFrame({"step": np.zeros(0, np.int64), "seq": np.zeros(0, np.int64),
                                     "nonfinite_count": np.zeros(0), VS.WORST_BY: np.zeros(0)})

    assert VS.first_to_show(Empty()) is None


def test_tokens_and_group_stored_equal_read(tmp_path, monkeypatch):
    """tokens() and group_tokens() read the parts once: a fresh analysis of the same parts gets them from
    the result store (kldiag.analysis.cache.store), equal to pages.read_sequence / groups.read_group."""
    from kldiag.format import open_run
    from kldiag.views import groups as VG
    from kldiag.views import pages as V

    path = tmp_path / "run"
    make_run(path, SynthConfig(steps=4, seqs_per_step=8, seq_len=(5, 30), nonfinite=((2, "logp"),)))
    vocab = open_run(path).vocab()
    first = analyze(path)
    s3, s1, s2 = VS.of_step(first, 2)["seq"].tolist()[:3]
    one, group = VS.tokens(first, 2, s3, vocab), VS.group_tokens(first, 2, [s3, s1, s2], vocab)
    monkeypatch.setattr(V, "read_sequence", lambda *a, **k: pytest.fail("read again"))
    monkeypatch.setattr(VG, "read_group", lambda *a, **k: pytest.fail("read again"))
    again = analyze(path)
    hit, hit_group = VS.tokens(again, 2, s3, vocab), VS.group_tokens(again, 2, [s3, s1, s2], vocab)
    monkeypatch.undo()
    want = V.read_sequence(path, 2, s3, vocab=vocab)
    assert len(want) and (want["piece"] != "<" + want["token_id"].astype(str) + ">").all()
    for got in (one, hit):
        pd.testing.assert_frame_equal(got, want, check_exact=True)
    want_group = VG.read_group(path, 2, [s3, s1, s2], vocab=vocab)
    assert list(hit_group) == list(want_group) == list(group)
    for s in want_group:
        pd.testing.assert_frame_equal(hit_group[s], want_group[s], check_exact=True)
    no_vocab = VS.tokens(again, 2, s3)  # another entry: pieces without the vocab
    pd.testing.assert_frame_equal(no_vocab, V.read_sequence(path, 2, s3), check_exact=True)


def test_long_run_answers_stored(tmp_path, monkeypatch):
    """worst, of_step and first_to_show of an on-disk sequence table: a fresh analysis of the same parts
    reads them from the result store, equal to the query's."""
    path = _run(tmp_path / "run", ((6, "logp"),))
    monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    monkeypatch.setattr(seqrows, "ROW_GROUP", 8)
    first = analyze(path)
    assert first.sequence_rows is not None
    want = (VS.worst(first, 5), VS.of_step(first, 3), VS.first_to_show(first))
    for name in ("worst", "steps", "table"):
        monkeypatch.setattr(seqrows.SequenceRows, name, lambda *a, **k: pytest.fail("queried again"))
    again = analyze(path)
    got = (VS.worst(again, 5), VS.of_step(again, 3), VS.first_to_show(again))
    monkeypatch.undo()
    pd.testing.assert_frame_equal(got[0], want[0], check_exact=True)
    pd.testing.assert_frame_equal(got[1], want[1], check_exact=True)
    assert got[2] == want[2] == VS.first_to_show(analyze(path, CFG)) and len(want[0]) == 5


def test_tokens_keeps_its_types_when_a_sibling_has_nulls(tmp_path):
    """A sequence read with its group is built alone from its rows: a column null in a sibling's rows only
    (token_id here) keeps this sequence's type (int, not float), as read_sequence gives it."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from kldiag.views import pages as V

    path = tmp_path / "run"
    make_run(path, SynthConfig(steps=2, seqs_per_step=8, seq_len=(5, 30), group_size=4, vocab_size=16))
    for part in path.glob("tokens/rank-*/*.parquet"):  # step 1's sequence 9 (group 8-11) without token ids
        t = pq.read_table(part)
        ids = pc.if_else(pc.equal(t.column("seq"), 9), pa.scalar(None, pa.int32()), t.column("token_id"))
        pq.write_table(t.set_column(t.schema.get_field_index("token_id"), t.schema.field("token_id"), ids), part)
    a = analyze(path)
    one = VS.tokens(a, 1, 8)
    group = VS.group_tokens(a, 1, [8, 9, 10, 11])
    want = V.read_sequence(path, 1, 8)
    assert want["token_id"].dtype.kind == "i" and group[9]["token_id"].isna().all()
    pd.testing.assert_frame_equal(one, want, check_exact=True)
