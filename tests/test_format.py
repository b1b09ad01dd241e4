"""Run format v1.1: schema round trip, manifest, atomic publish, reader robustness, vocab."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from kldiag import format as F
from kldiag.errors import CorruptPartError, NotARunError, RunFormatError, SchemaError, UnsupportedFormatVersionError


def token_table(step: int, n: int = 8, seed: int = 0, attempt: int = 0, rank: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    cols = {
        "step": pa.array(np.full(n, step), pa.int64()),
        "micro": pa.array(np.zeros(n), pa.int32()),
        "iteration": pa.array(np.zeros(n), pa.int16()),
        "rank": pa.array(np.full(n, rank), pa.int16()),
        "seq": pa.array(np.arange(n) // 4 + step * 100, pa.int64()),
        "group": pa.array(np.zeros(n), pa.int64()),
        "pos": pa.array(np.arange(n) % 4, pa.int32()),
        "token_id": pa.array(rng.integers(0, 50, n), pa.int32()),
        "logp": pa.array(-rng.exponential(1, n), pa.float32()),
        "logp_old": pa.array([None] * n, pa.float32()),
        "logp_ref": pa.array(-rng.exponential(1, n), pa.float32()),
        "logp_sampler": pa.array([None] * n, pa.float32()),
        "advantage": pa.array(rng.normal(size=n), pa.float32()),
        "mask": pa.array(np.ones(n, bool)),
        "entropy": pa.array([None] * n, pa.float32()),
        "attempt": pa.array(np.full(n, attempt), pa.int16()),
    }
    return pa.table(cols, schema=F.TOKEN_SCHEMA)


@pytest.fixture()
def run_dir(tmp_path):
    F.write_manifest(tmp_path, F.Manifest(kldiag_version="test", config={"beta": 0.04, "estimator": "k3"}))
    for step in range(3):
        F.publish_part(token_table(step, seed=step), F.rank_dir(tmp_path, 0), F.part_name(step, step, step))
    return tmp_path


def test_write_then_read_pins_the_schema(run_dir):
    run = F.open_run(run_dir)
    t = run.read()
    assert t.schema == F.TOKEN_SCHEMA
    assert t.num_rows == 24
    assert t.column("step").to_pylist() == [0] * 8 + [1] * 8 + [2] * 8
    assert t.column("logp_old").null_count == 24
    assert run.manifest.config["beta"] == 0.04


def test_column_projection(run_dir):
    batches = list(F.open_run(run_dir).iter_batches(columns=["step", "logp"]))
    assert all(b.schema.names == ["step", "logp"] for b in batches)
    assert sum(b.num_rows for b in batches) == 24


def test_part_is_published_atomically_without_temp_files(run_dir):
    names = sorted(p.name for p in F.rank_dir(run_dir, 0).iterdir())
    assert names == [F.part_name(s, s, s) for s in range(3)]


def test_reader_never_reads_dot_temp_or_foreign_files(run_dir):
    d = F.rank_dir(run_dir, 0)
    (d / ".part-000000009-000000009-000009.parquet.tmp").write_bytes(b"half written")
    (d / "notes.txt").write_text("hello")
    (d / "part-x.parquet").write_bytes(b"junk")
    (run_dir / "tokens" / "misc").mkdir()
    (run_dir / "tokens" / "misc" / F.part_name(5, 5, 0)).write_bytes(b"junk")
    parts = F.open_run(run_dir).parts()
    assert [p.step_min for p in parts] == [0, 1, 2]
    assert F.open_run(run_dir).read().num_rows == 24


def test_listing_skips_a_file_renamed_between_scan_and_stat(run_dir, monkeypatch):
    """A live writer renames its temp file while a reader lists the directory: skipped, no crash."""
    import os

    real_scandir = os.scandir

    class Vanished:
        name = ".part-000000009-000000009-000009.parquet.123.tmp"
        path = "gone"

        def is_file(self):
            return True

        def is_dir(self):
            return False

        def stat(self):
            raise FileNotFoundError(self.path)

    def scandir(path):
        return [*real_scandir(path), Vanished()]

    monkeypatch.setattr(os, "scandir", scandir)
    assert [p.step_min for p in F.list_parts(run_dir)] == [0, 1, 2]


def test_truncated_part_is_reported_by_name(run_dir):
    d = F.rank_dir(run_dir, 0)
    good = d / F.part_name(1, 1, 1)
    bad = d / F.part_name(7, 7, 7)
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.warns(UserWarning, match=bad.name):
        t = F.open_run(run_dir).read()
    assert t.num_rows == 24  # the published rows are all still there
    with pytest.raises(CorruptPartError, match=bad.name):
        F.open_run(run_dir).read(strict=True)


def test_part_with_wrong_schema_is_reported(run_dir):
    t = token_table(9).set_column(8, "logp", pa.array(np.zeros(8), pa.float64()))
    F.publish_part(t, F.rank_dir(run_dir, 0), F.part_name(9, 9, 9))
    with pytest.raises(SchemaError, match="logp"):
        F.open_run(run_dir).read(strict=True)
    with pytest.warns(UserWarning, match="logp"):
        assert F.open_run(run_dir).read().num_rows == 24


def test_unknown_format_version_is_a_clear_error(run_dir):
    m = json.loads((run_dir / "run.json").read_text())
    m["format_version"] = 99
    (run_dir / "run.json").write_text(json.dumps(m))
    with pytest.raises(UnsupportedFormatVersionError, match="version 99.*upgrade kldiag"):
        F.open_run(run_dir)


def test_not_a_run(tmp_path):
    with pytest.raises(NotARunError, match="no run.json"):
        F.open_run(tmp_path)
    (tmp_path / "run.json").write_text("{not json")
    with pytest.raises(RunFormatError, match="not valid JSON"):
        F.open_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(RunFormatError, match="not a kldiag manifest"):
        F.open_run(tmp_path)


def test_manifest_round_trip_keeps_unknown_keys(tmp_path):
    m = F.Manifest(trainer={"name": "trl", "version": "1.16.0"}, world_size=2, tags={"exp": "a"})
    d = m.to_dict()
    d["future_key"] = {"x": 1}
    (tmp_path / "run.json").write_text(json.dumps(d))
    back = F.read_manifest(tmp_path)
    assert back.trainer == m.trainer and back.world_size == 2 and back.extra == {"future_key": {"x": 1}}
    assert back.to_dict()["future_key"] == {"x": 1}


def test_empty_run_reads_as_empty_table(tmp_path):
    F.write_manifest(tmp_path, F.Manifest())
    t = F.open_run(tmp_path).read(columns=["step", "logp"])
    assert t.num_rows == 0 and t.schema.names == ["step", "logp"]


def test_vocab_sidecar_from_list_dict_and_tokenizers(tmp_path):
    from tokenizers import Tokenizer, models

    F.write_manifest(tmp_path, F.Manifest())
    F.write_vocab(tmp_path, ["a", "<img src=x onerror=alert(1)>", "c"])
    assert F.open_run(tmp_path).vocab() == {0: "a", 1: "<img src=x onerror=alert(1)>", 2: "c"}
    F.write_vocab(tmp_path, {"x": 1, "y": 0})
    assert F.open_run(tmp_path).vocab() == {0: "y", 1: "x"}
    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    F.write_vocab(tmp_path, tok)
    assert F.open_run(tmp_path).vocab() == {0: "hello", 1: "world", 2: "[UNK]"}
    with pytest.raises(TypeError, match="tokenizers.Tokenizer"):
        F.write_vocab(tmp_path, 42)


def test_parts_sort_by_step_then_rank(tmp_path):
    F.write_manifest(tmp_path, F.Manifest(world_size=2))
    F.publish_part(token_table(1), F.rank_dir(tmp_path, 1), F.part_name(1, 1, 0))
    F.publish_part(token_table(0), F.rank_dir(tmp_path, 1), F.part_name(0, 0, 1))
    F.publish_part(token_table(1), F.rank_dir(tmp_path, 0), F.part_name(1, 1, 0))
    parts = F.list_parts(tmp_path)
    assert [(p.step_min, p.rank) for p in parts] == [(0, 1), (1, 0), (1, 1)]
    assert len({p.key for p in parts}) == 3


def test_read_rows_reads_the_row_groups_of_its_steps_only(tmp_path, monkeypatch):
    """Run.read_rows: the rows at the steps for which `where` holds, equal to the whole run filtered, from
    the row groups whose step statistics hold a step (groups of 4 rows: a step spans two of them)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    F.write_manifest(tmp_path, F.Manifest(kldiag_version="test"))
    table = pa.concat_tables([token_table(step, seed=step) for step in range(6)])
    F.publish_part(table, F.rank_dir(tmp_path, 0), F.part_name(0, 5, 0), row_group_size=4)
    run = F.open_run(tmp_path)
    groups = []
    real = pq.ParquetFile.iter_batches
    monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                        lambda self, **kw: groups.append(kw.get("row_groups")) or real(self, **kw))
    got = run.read_rows(run.parts(), [2, 4], lambda b: pc.equal(b.column("pos"), 1))
    whole = run.read()
    want = whole.filter(pc.and_(pc.is_in(whole.column("step"), pa.array([2, 4])), pc.equal(whole.column("pos"), 1)))
    assert got.equals(want) and got.num_rows == 4
    assert groups[0] == [4, 5, 8, 9]  # of 12 groups: the two of each step
    assert run.read_rows(run.parts(), [9]).num_rows == 0
    with pytest.raises(ValueError, match="include it"):
        run.read_rows(run.parts(), [2], columns=["seq"])


def test_read_rows_decodes_a_group_up_to_its_last_row_at_the_steps(tmp_path, monkeypatch):
    """format.run.step_batches: a row group holding several steps is decoded up to the last row at the
    steps asked for (not past it), a group the statistics admit but that holds none of them is not read,
    and the rows are those of the whole run filtered, superseded rows dropped as before."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    F.write_manifest(tmp_path, F.Manifest(kldiag_version="test"))
    table = pa.concat_tables([token_table(step, seed=step) for step in range(6)])  # 8 rows a step
    F.publish_part(table, F.rank_dir(tmp_path, 0), F.part_name(0, 5, 0), row_group_size=24)  # 3 steps a group
    run = F.open_run(tmp_path)
    part = run.parts()[0]
    decoded = []
    real = pq.ParquetFile.iter_batches

    def spy(self, **kw):
        for b in real(self, **kw):
            decoded.append(b.num_rows)
            yield b

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    whole = run.read()
    for steps, rows in (([0], 8), ([1], 16), ([2], 24), ([0, 4], 24 + 16), ([5], 24)):
        decoded.clear()
        got = pa.Table.from_batches(list(F.part_batches(part, list(F.TOKEN_SCHEMA.names), 4, steps=steps)))
        assert sum(decoded) == rows, steps  # batches of 4: none past the last row at the steps
        assert got.filter(pc.is_in(got.column("step"), pa.array(steps))).equals(
            whole.filter(pc.is_in(whole.column("step"), pa.array(steps)))), steps
        assert run.read_rows([part], steps).equals(whole.filter(pc.is_in(whole.column("step"), pa.array(steps))))
    gap = pa.concat_tables([token_table(step, seed=step) for step in (6, 8)])  # statistics 6..8 admit step 7
    F.publish_part(gap, F.rank_dir(tmp_path, 0), F.part_name(6, 8, 0), row_group_size=16)
    decoded.clear()
    assert run.read_rows([p for p in run.parts() if p.step_min == 6], [7]).num_rows == 0 and decoded == []
