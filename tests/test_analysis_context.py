"""The report's context (kldiag/analysis/runtime/context.py): the token ids around given tokens, read from the row
groups that hold them, equal to the same context cut from the whole run read as one table."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import kldiag
from kldiag import format as F
from kldiag.analysis.runtime import context
from kldiag.report import build as RB


def _table(steps: range, rank: int, seed: int, attempt: int = 0, null_ids: bool = False) -> pa.Table:
    """Sequences of 1-12 tokens, 3 a step, 2 reuse iterations; token ids random (some null)."""
    rng = np.random.default_rng(seed)
    rows = []
    for step in steps:
        for seq in range(3):
            n = int(rng.integers(1, 13))
            for it in range(2):
                rows += [(step, it, seq, pos) for pos in range(n)]
    step, it, seq, pos = (np.array(c) for c in zip(*rows, strict=True))
    n = len(rows)
    ids = rng.integers(0, 1000, n)
    cols = {"step": pa.array(step, pa.int64()), "micro": pa.array(np.zeros(n), pa.int32()),
            "iteration": pa.array(it, pa.int16()), "rank": pa.array(np.full(n, rank), pa.int16()),
            "seq": pa.array(seq, pa.int64()), "group": pa.array(np.zeros(n), pa.int64()),
            "pos": pa.array(pos, pa.int32()),
            "token_id": pa.array(ids, pa.int32(), mask=(rng.random(n) < 0.2) if null_ids else None),
            "logp": pa.array(-rng.exponential(1, n), pa.float32()),
            "logp_old": pa.array([None] * n, pa.float32()),
            "logp_ref": pa.array(-rng.exponential(3, n), pa.float32()),
            "logp_sampler": pa.array([None] * n, pa.float32()),
            "advantage": pa.array(rng.normal(size=n), pa.float32()), "mask": pa.array(np.ones(n, bool)),
            "entropy": pa.array([None] * n, pa.float32()), "attempt": pa.array(np.full(n, attempt), pa.int16())}
    return pa.table(cols, schema=F.TOKEN_SCHEMA)


@pytest.fixture()
def run(tmp_path):
    """Two ranks, several parts each, row groups of 7 rows (sequences straddle them), rank 0's steps 4-5
    rewritten by a second attempt with other token ids (its first attempt's rows there are superseded)."""
    F.write_manifest(tmp_path, F.Manifest(kldiag_version="test", config={"beta": 0.04, "estimator": "k3"}))
    index = 0
    for rank in (0, 1):
        for lo in (0, 3):
            F.publish_part(_table(range(lo, lo + 3), rank, seed=10 * rank + lo, null_ids=lo == 3),
                           F.rank_dir(tmp_path, rank), F.part_name(lo, lo + 2, index), row_group_size=7)
            index += 1
    F.publish_part(_table(range(4, 6), 0, seed=99, attempt=1), F.rank_dir(tmp_path, 0),
                   F.part_name(4, 5, index, attempt=1), row_group_size=7)
    return tmp_path


def _brute(run_dir, keys, width):
    """The same context cut from every (non-superseded) row of the run, with pandas."""
    t = F.open_run(run_dir).read(["step", "rank", "seq", "iteration", "pos", "token_id"]).to_pandas()
    t["token_id"] = t["token_id"].fillna(-1).astype(int)
    out = {}
    for s, rk, q, it, p in keys:
        seq = t[(t["step"] == s) & (t["rank"] == rk) & (t["seq"] == q) & (t["iteration"] == it)].sort_values("pos")
        out[(s, rk, q, it, p)] = (seq[(seq["pos"] >= p - width) & (seq["pos"] < p)]["token_id"].tolist(),
                                  seq[(seq["pos"] > p) & (seq["pos"] <= p + width)]["token_id"].tolist())
    return out


def _keys(run_dir, n, seed):
    t = F.open_run(run_dir).read(["step", "rank", "seq", "iteration", "pos"]).to_pylist()
    rng = np.random.default_rng(seed)
    return [tuple(t[int(i)][c] for c in ("step", "rank", "seq", "iteration", "pos")) for i in rng.choice(len(t), n)]


@pytest.mark.parametrize("width", [0, 1, 5])
def test_around_equals_the_context_cut_from_the_whole_run(run, width):
    keys = _keys(run, 60, width) + [(4, 0, 0, 1, 0), (5, 0, 2, 0, 3)]  # steps rewritten by attempt 1
    got = context.around(F.open_run(run), F.list_parts(run), keys, width)
    assert got == _brute(run, keys, width)
    assert any(-1 in b + a for b, a in got.values()) or width == 0  # null ids read as -1


def test_superseded_rows_and_unknown_sequences_are_no_context(run):
    first = F.open_run(run).read(["step", "rank", "seq", "iteration", "pos", "token_id"], include_superseded=True)
    got = context.around(F.open_run(run), F.list_parts(run), [(4, 0, 0, 0, 0), (4, 0, 7, 0, 0), (99, 0, 0, 0, 0)], 3)
    assert got[(4, 0, 7, 0, 0)] == got[(99, 0, 0, 0, 0)] == ([], [])
    attempt1 = _table(range(4, 6), 0, seed=99, attempt=1).to_pylist()
    want = [r["token_id"] for r in attempt1 if (r["step"], r["seq"], r["iteration"]) == (4, 0, 0)][1:4]
    assert got[(4, 0, 0, 0, 0)] == ([], want)
    assert first.num_rows > F.open_run(run).read(["step"]).num_rows  # there were superseded rows to drop


def test_around_reads_only_the_row_groups_of_its_steps(run, monkeypatch):
    import pyarrow.parquet as pq
    read = []
    real = pq.ParquetFile.iter_batches
    monkeypatch.setattr(pq.ParquetFile, "iter_batches",
                        lambda self, **kw: read.append(len(kw["row_groups"])) or real(self, **kw))
    total = sum(F.open_part(p).metadata.num_row_groups for p in F.list_parts(run))
    context.around(F.open_run(run), F.list_parts(run), [(1, 1, 0, 0, 0)], 2)
    assert len(read) == 1 and 0 < sum(read) < total / 4


def test_report_offenders_carry_their_context(run):
    analysis = kldiag.analyze(run)
    worst = RB.offenders(analysis, 5, 2)
    flags = analysis.flags.to_pylist()
    flags.sort(key=lambda r: -abs(r["weight_k3"]))  # stable: the flags table's order breaks ties
    keys = [(r["step"], r["rank"], r["seq"], r["iteration"], r["pos"]) for r in flags[:5]]
    want = _brute(run, keys, 2)
    piece = lambda ids: [f"<{x}>" if x >= 0 else "?" for x in ids]  # noqa: E731 (the run has no vocab)
    assert len(worst) == 5 and [(o.step, o.seq, o.pos) for o in worst] == [(k[0], k[2], k[4]) for k in keys]
    assert [(o.before, o.after) for o in worst] == [(piece(want[k][0]), piece(want[k][1])) for k in keys]
    assert any(o.before or o.after for o in worst)


@pytest.mark.parametrize("batch_size", [1, 3, 7, 1 << 20])
def test_the_pass_keeps_the_context_of_every_flagged_token(run, batch_size, monkeypatch):
    """analysis.core.around: each flagged token's context as the pass read it (sequences cut by record batches of
    1, 3, 7 rows) equals the context cut from the whole run, at every width up to around.WIDTH; of_flagged then
    reads no part."""
    from kldiag.analysis.core import around as kept
    from kldiag.format import parts as format_parts

    a = kldiag.analyze(run, kldiag.AnalysisConfig(batch_size=batch_size, use_cache=False))
    keys = [tuple(r[c] for c in ("step", "rank", "seq", "iteration", "pos")) for r in a.flags.to_pylist()]
    assert len(keys) > 20 and set(a.flag_context) == set(keys)
    want = {width: _brute(run, keys, width) for width in (0, 2, kept.WIDTH)}
    opened = []
    real = format_parts.PartInfo.open
    monkeypatch.setattr(format_parts.PartInfo, "open", lambda self: opened.append(self) or real(self))
    got = {width: context.of_flagged(a, keys, width) for width in want}
    assert got == want and opened == []


def test_rows_out_of_pos_order_are_read_from_the_part(tmp_path):
    """A writer whose sequence rows are not in pos order: the pass keeps no context for their tokens (UNKNOWN), and
    of_flagged reads it from the part, equal to the context cut from the whole run."""
    from kldiag.analysis.core import around as kept

    F.write_manifest(tmp_path, F.Manifest(kldiag_version="test", config={"beta": 0.04, "estimator": "k3"}))
    t = _table(range(0, 3), 0, seed=5)
    order = np.arange(t.num_rows)
    order[[3, 4]] = order[[4, 3]]  # two rows of the first sequence swapped
    F.publish_part(t.take(pa.array(order)), F.rank_dir(tmp_path, 0), F.part_name(0, 2, 0))
    a = kldiag.analyze(tmp_path, kldiag.AnalysisConfig(use_cache=False))
    keys = [tuple(r[c] for c in ("step", "rank", "seq", "iteration", "pos")) for r in a.flags.to_pylist()]
    unknown = [k for k in keys if (a.flag_context[k] == kept.UNKNOWN).all()]
    assert unknown and context.of_flagged(a, keys, 3) == _brute(tmp_path, keys, 3)
