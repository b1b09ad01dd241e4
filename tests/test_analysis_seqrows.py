"""The sequence table on disk (kldiag/analysis/core/seqrows.py): spilled past SPILL_ROWS rows, it equals the
in-memory table bit for bit (cold, cached, grown part by part), and its queries read what they show."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pyarrow.compute as pc
import pytest
from analysis_same import assert_same_analysis

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache import prefix
from kldiag.analysis.core import keyed, seqrows, spill
from kldiag.tools.synth import SynthConfig, make_run

CFG = AnalysisConfig(use_cache=False, per_rank=True, trainer_compatible=True)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("seqrows") / "run"
    make_run(path, SynthConfig(steps=12, seqs_per_step=9, seq_len=(5, 40), ranks=2, blowup_step=6,
                               blowup_frac=0.05, nonfinite=((7, "logp"),), vocab_size=0, rows_per_file=500))
    return path


def test_spilled_table_equals_the_in_memory_one(run, tmp_path, monkeypatch):
    want = analyze(run, CFG)
    assert want.sequence_rows is None  # a small run's table stays in memory
    monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    monkeypatch.setattr(seqrows, "ROW_GROUP", 16)  # several row groups: the queries skip some
    monkeypatch.setattr(prefix, "SEAL_EVERY", 2)  # several sealed chunks
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    for cfg in (CFG, AnalysisConfig(per_rank=True, trainer_compatible=True)):  # no cache; cold then warm cache
        for _ in range(2):
            got = analyze(copy, cfg)
            rows = got.sequence_rows
            assert rows is not None and got.sequence_count == want.sequences.num_rows
            assert_same_analysis(got, want)
            assert got.sequence_rows is rows  # queries still go to the file after a whole read


@pytest.mark.parametrize("pieces", ["one", "several"])
def test_queries_read_only_what_they_show(run, tmp_path, monkeypatch, pieces):
    table = analyze(run, CFG).sequences
    monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    monkeypatch.setattr(seqrows, "ROW_GROUP", 16)
    cfg = CFG
    if pieces == "several":  # chunk files in the cache: a piece each, shared with the next analysis
        monkeypatch.setattr(spill, "SPILL_CHUNK_ROWS", 40)
        monkeypatch.setattr(prefix, "SEAL_EVERY", 2)
        shutil.copytree(run, tmp_path / "run")
        run, cfg = tmp_path / "run", AnalysisConfig(per_rank=True, trainer_compatible=True)
        analyze(run, cfg)
    rows = analyze(run, cfg).sequence_rows
    assert (len(rows.pieces) > 2) == (pieces == "several")
    w = np.nan_to_num(table.column("weight_k3_abs_max").to_numpy(zero_copy_only=False), nan=-np.inf)
    order = np.argsort(-w, kind="stable")[:7]
    assert rows.worst(7).equals(table.take(order))
    assert rows.worst(10**6).equals(table.take(np.argsort(-w, kind="stable")))  # every row; ties in table order
    step, seq = table.column("step")[20].as_py(), table.column("seq")[20].as_py()
    assert rows.sequence(step, seq).equals(table.slice(20, 1))
    assert rows.sequence(step, -5).num_rows == 0
    mask = pc.and_(pc.greater_equal(table.column("step"), 3), pc.less_equal(table.column("step"), 5))
    assert rows.steps(3, 5).equals(table.filter(mask))
    assert rows.table(columns=["step", "seq"]).equals(table.select(["step", "seq"]))


def test_chunks_are_saved_as_one_array(tmp_path):
    chunks = [np.arange(5, dtype=np.int64), np.arange(3, dtype=np.int64) + 9]
    h = np.ones((4, 3))
    assert reduce.save_arrays(tmp_path / "x.part", {"a": chunks, "h": [h[:1], h[1:]], "rows": np.array([2])})
    got = reduce.load_arrays(tmp_path / "x.part")
    np.testing.assert_array_equal(got["a"], np.concatenate(chunks))
    np.testing.assert_array_equal(got["h"], h)
    assert got["rows"].tolist() == [2]


def test_a_prefix_whose_chunk_file_is_gone_is_recomputed(run, tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "SPILL_CHUNK_ROWS", 1)
    monkeypatch.setattr(prefix, "SEAL_EVERY", 2)
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    cfg = AnalysisConfig(per_rank=True, trainer_compatible=True)
    want = analyze(run, CFG)
    assert_same_analysis(analyze(copy, cfg), want)  # cold: writes the prefix and its chunk files
    files = list((copy / ".kldiag" / "prefix" / "seqs").glob("*.seqs"))
    assert files
    files[0].unlink()  # another process's cleanup, or a user
    assert_same_analysis(analyze(copy, cfg), want)


def test_unlisted_chunk_files_are_removed_once_stale(tmp_path):
    for name in ("listed.seqs", "old.seqs", "new.seqs", "other.part"):
        (tmp_path / name).write_bytes(b"x")
    for name in ("listed.seqs", "old.seqs", "other.part"):
        os.utime(tmp_path / name, (1, 1))
    spill.remove_unlisted(tmp_path, {"listed.seqs"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["listed.seqs", "new.seqs", "other.part"]


def test_spilled_chunks_read_back_equal(tmp_path):
    table = {"step": np.arange(5), "seq": np.arange(5) * 2, "sum_k3": np.linspace(0, 1, 5), "h_d": np.ones((5, 3))}
    for folder in (tmp_path, None):
        h = spill.spill(table, folder)
        assert isinstance(h, spill.Spilled) and h.rows == 5 and h.step_max == 4
        got = h.load()
        assert all(np.array_equal(got[c], table[c]) for c in table)


def test_a_fresh_process_opens_the_pieces_an_earlier_one_wrote(run, tmp_path, monkeypatch):
    """A chunk file's sequence rows are written once, beside it, for every later process: a warm analysis
    with nothing remembered in memory (a fresh process) builds no table row and gives the same table."""
    from kldiag.analysis.core import tables

    want = analyze(run, CFG).sequences
    monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    monkeypatch.setattr(spill, "SPILL_CHUNK_ROWS", 40)
    monkeypatch.setattr(prefix, "SEAL_EVERY", 2)
    shutil.copytree(run, tmp_path / "run")
    cfg = AnalysisConfig(per_rank=True, trainer_compatible=True)
    analyze(tmp_path / "run", cfg)  # cold: chunk files; the prefix lists them
    analyze(tmp_path / "run", cfg)  # warm: their pieces written beside them
    folder = tmp_path / "run" / ".kldiag" / "prefix" / "seqs"
    written = sorted(p.name for p in folder.glob("*.seqs.*.parquet"))
    assert written and all(p.split(".seqs.")[0] + ".seqs" in os.listdir(folder) for p in written)
    spill._memo.clear()  # what a fresh process remembers
    built = []
    real = tables.sequence_table
    monkeypatch.setattr(tables, "sequence_table", lambda s, c: built.append(keyed.rows(s)) or real(s, c))
    got = analyze(tmp_path / "run", cfg)
    assert got.sequences.equals(want)
    assert sum(built) < want.num_rows  # only rows after the prefix's chunk files are built again
    assert sorted(p.name for p in folder.glob("*.seqs.*.parquet")) == written


def test_a_chunk_files_piece_goes_with_it(tmp_path):
    (tmp_path / "a.seqs").write_bytes(b"x")
    for chunk, derived in (("a", "parquet"), ("a", "arrays"), ("b", "parquet"), ("b", "arrays")):  # b: gone
        (tmp_path / f"{chunk}.seqs.0123.{derived}").write_bytes(b"x")  # its table piece, its sums (spill.kept)
    old = time.time() - spill.STALE_SECONDS - 10
    for p in tmp_path.iterdir():
        os.utime(p, (old, old))
    spill.remove_unlisted(tmp_path, {"a.seqs"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.seqs", "a.seqs.0123.arrays", "a.seqs.0123.parquet"]


def _order(table, by: str, n: int):
    """The n first rows by `by` descending, nulls last, ties in table order (what worst() gives)."""
    v = np.nan_to_num(table.column(by).to_numpy(zero_copy_only=False).astype(np.float64), nan=-np.inf)
    return table.take(np.argsort(-v, kind="stable")[:n])


def test_worst_of_a_growing_run_equals_a_cold_one(run, tmp_path, monkeypatch):
    """A run grown part by part (a live dashboard's refresh): worst(n) ranks a named piece once (its top rows
    kept beside it, read again by a fresh process) and equals the cold table's order, ties included."""
    monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    monkeypatch.setattr(seqrows, "ROW_GROUP", 16)
    monkeypatch.setattr(spill, "SPILL_CHUNK_ROWS", 40)
    monkeypatch.setattr(prefix, "SEAL_EVERY", 2)
    grown = tmp_path / "run"
    (grown / "tokens").mkdir(parents=True)
    shutil.copy(run / "run.json", grown / "run.json")
    parts = sorted(run.glob("tokens/rank-*/*.parquet"), key=lambda p: (p.name.split("-")[1], p.parent.name))
    cfg, ranked = AnalysisConfig(per_rank=True, trainer_compatible=True), []
    real = seqrows.top_rows
    monkeypatch.setattr(seqrows, "top_rows", lambda p, n, by: ranked.append((p.path, n, by)) or real(p, n, by))
    for k in range(3, len(parts) + 1, 3):
        for p in parts[:k]:
            (grown / p.parent.relative_to(run)).mkdir(exist_ok=True)
            if not (grown / p.relative_to(run)).exists():
                shutil.copy(p, grown / p.relative_to(run))
        got = analyze(grown, cfg)
        table = analyze(grown, CFG).sequences  # cold, in memory
        for by, n in (("weight_k3_abs_max", 5), ("tokens", 9), ("weight_k3_abs_max", 10**6)):  # tokens: ties
            assert got.sequence_rows.worst(n, by).equals(_order(table, by, n)), (k, by, n)
    named = [r for r in ranked if r[0] is not None]
    assert named and len(named) == len(set(named))  # a named piece ranked once per (n, by)
    spill._memo.clear()  # a fresh process: the pieces opened again, their top rows read from beside them
    ranked.clear()
    got = analyze(grown, cfg).sequence_rows
    assert got.worst(5).equals(_order(table, "weight_k3_abs_max", 5))
    assert [r for r in ranked if r[0] is not None] == []


def test_first_largest_is_worst_one(run, tmp_path, monkeypatch):
    """first_largest(by): worst(1, by)'s row (NaN last, ties in table order: `tokens` has many) from the row
    groups whose footer statistics hold the largest value, and worst(1)'s answer where no group has them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    monkeypatch.setattr(seqrows, "ROW_GROUP", 16)
    monkeypatch.setattr(spill, "SPILL_CHUNK_ROWS", 40)
    monkeypatch.setattr(prefix, "SEAL_EVERY", 2)
    shutil.copytree(run, tmp_path / "run")
    rows = analyze(tmp_path / "run", AnalysisConfig(per_rank=True, trainer_compatible=True)).sequence_rows
    groups = sum(p.read(lambda src: pq.ParquetFile(src).metadata.num_row_groups) for p in rows.pieces)
    assert len(rows.pieces) > 2 and groups > 8
    read = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, g, **kw: read.append(g) or real(self, g, **kw))
    for by in ("weight_k3_abs_max", "tokens", "k3_mean", "flagged_count"):
        cols = ["step", "seq", by]
        read.clear()
        got = rows.first_largest(by, cols)
        assert len(read) < groups // 2, by  # the groups that hold the largest, not every group
        assert got.equals(rows.worst(1, by).select(cols)), by
    table = rows.table()  # the same rows in one piece written without statistics: worst(1)'s answer
    path = tmp_path / "nostats.parquet"
    pq.write_table(table, path, row_group_size=16, write_statistics=False)
    f = open(path, "rb")  # noqa: SIM115 - the piece holds it open, as seqrows' own pieces do
    bare = seqrows.SequenceRows([seqrows.Piece(f, table.num_rows, 0, 11, table.schema)], table.schema)
    by, cols = "weight_k3_abs_max", ["step", "seq", "weight_k3_abs_max"]
    assert bare.first_largest(by, cols).equals(rows.worst(1, by).select(cols))
    nan = table.set_column(table.schema.get_field_index(by), by, pa.array(np.full(table.num_rows, np.nan)))
    pq.write_table(nan, tmp_path / "nan.parquet", row_group_size=16)  # every value NaN: no group has statistics
    f2 = open(tmp_path / "nan.parquet", "rb")  # noqa: SIM115
    allnan = seqrows.SequenceRows([seqrows.Piece(f2, nan.num_rows, 0, 11, nan.schema)], nan.schema)
    assert allnan.first_largest(by, ["step", "seq"]).equals(nan.slice(0, 1).select(["step", "seq"]))  # the first row
    f.close()
    f2.close()
