"""Partials merge associatively: any grouping and order of files gives the same result."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from kldiag.analysis import protocol as reduce
from kldiag.analysis.core import keyed, partials
from kldiag.analysis.core.batch import Thresholds
from kldiag.analysis.runtime import part_fold
from kldiag.format import list_parts, open_run
from kldiag.tools.synth import SynthConfig, make_run

TH = Thresholds(20.0, 10.0, 10.0, 0.2, 0.2, 25)


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "p"
    # Small files and batches: sequences and steps span files, ranks share steps.
    make_run(run, SynthConfig(steps=6, seqs_per_step=8, seq_len=(5, 30), ranks=2, rows_per_file=300,
                              blowup_step=3, blowup_frac=0.05, nonfinite=((2, "logp"),)))
    found = list_parts(run)
    return [part_fold.partial_of(p, TH, batch_size=97) for p in found]


def assert_same(a: partials.Partial, b: partials.Partial) -> None:
    assert a.rows == b.rows
    for table in partials.TABLES:
        x, y = getattr(a, table), getattr(b, table)
        assert sorted(x) == sorted(y), table
        for col in x:
            if col.startswith("sum_"):  # float sums: equal up to summation order
                np.testing.assert_allclose(x[col], y[col], rtol=1e-12, err_msg=f"{table}.{col}")
            else:
                np.testing.assert_array_equal(x[col], y[col], err_msg=f"{table}.{col}")


def test_merge_order_and_grouping_do_not_matter(parts):
    assert len(parts) >= 4
    reference = partials.merge(parts, TH.top_k)
    rng = np.random.default_rng(0)
    for _ in range(4):
        shuffled = [parts[i] for i in rng.permutation(len(parts))]
        assert_same(partials.merge(shuffled, TH.top_k), reference)
    head, tail = parts[: len(parts) // 2], parts[len(parts) // 2:]
    nested = partials.merge([partials.merge(tail, TH.top_k), partials.merge(head, TH.top_k)], TH.top_k)
    assert_same(nested, reference)
    pairwise = parts[0]
    for p in parts[1:]:
        pairwise = partials.merge([p, pairwise], TH.top_k)
    assert_same(pairwise, reference)


def test_merged_sequences_are_whole(parts):
    merged = partials.merge(parts, TH.top_k)
    keys = list(zip(merged.seqs["step"], merged.seqs["seq"], strict=True))
    assert len(keys) == len(set(keys)) == 6 * 8 * 2
    assert merged.steps["n_nonfinite"].sum() == 1
    assert len(merged.top["wabs"]) == TH.top_k and np.all(np.diff(merged.top["wabs"]) <= 0)


def test_cache_roundtrip(parts, tmp_path):
    path = tmp_path / "p.part"
    assert reduce.save_arrays(path, partials.to_arrays(parts[0]))
    assert_same(partials.from_arrays(reduce.load_arrays(path)), parts[0])
    good = path.read_bytes()
    for broken in (b"not a partial", good[:40], good[:-8], good[:20] + b"x" * 30 + good[50:]):
        path.write_bytes(broken)
        assert reduce.load_arrays(path) is None


def test_reduce_by_key_combines_each_column_by_its_prefix():
    t = {"step": np.array([2, 1, 2]), "sum_x": np.array([1.0, 2.0, 3.0]), "max_y": np.array([np.nan, 5.0, 4.0]),
         "first_g": np.array([7, 8, 9]), "h_z": np.array([[1, 0], [0, 1], [2, 2]])}
    for perm in itertools.permutations(range(3)):
        out = keyed.reduce_by_key({k: v[list(perm)] for k, v in t.items()})
        np.testing.assert_array_equal(out["step"], [1, 2])
        np.testing.assert_array_equal(out["sum_x"], [2.0, 4.0])
        np.testing.assert_array_equal(out["max_y"], [5.0, 4.0])
        np.testing.assert_array_equal(out["h_z"], [[0, 1], [3, 2]])


def test_every_path_reduces_a_part_over_the_same_batches(tmp_path, monkeypatch):
    """The threaded path (several parts at once), the pipelined one (one part, the process
    pool's and Ray's) give one part the same partial bit for bit, also when the part is
    longer than a kernel batch (float sums depend on where batches split sequences)."""
    make_run(tmp_path / "r", SynthConfig(steps=3, seqs_per_step=8, seq_len=(20, 60), ranks=2, vocab_size=0))
    found = list_parts(tmp_path / "r")
    assert len(found) == 2 and all(p.size > 0 for p in found)
    red = partials.AnalysisReducer(TH)
    threaded = {i: partials.from_arrays(r[red.name])
                for i, r in part_fold.fold_parts([(p, [red]) for p in found], 97, (), threads=2)}
    pipelined = {i: partials.from_arrays(r[red.name])
                 for i, r in part_fold.fold_parts([(p, [red]) for p in found], 97, (), threads=1)}
    for i, part in enumerate(found):
        one = part_fold.partial_of(part, TH, 97)
        assert_same(pipelined[i], one)
        for table in partials.TABLES:
            for col, v in getattr(one, table).items():
                np.testing.assert_array_equal(getattr(threaded[i], table)[col], v, err_msg=f"{table}.{col}")


def test_ranks_merge_on_the_way_in_unless_per_rank(tmp_path):
    """per_rank off: a part's per-step rows drop their rank, so the merged partial holds one row per
    step however many ranks record (the driver's memory at 1,024 ranks); the tables are the same."""
    from kldiag.analysis import analyze
    from kldiag.analysis import pipeline as engine
    from kldiag.analysis.types import AnalysisConfig

    make_run(tmp_path / "r", SynthConfig(steps=4, seqs_per_step=6, ranks=3, vocab_size=0))
    run = open_run(tmp_path / "r")
    merged = {}
    for per_rank in (False, True):
        th = engine.thresholds(AnalysisConfig(per_rank=per_rank), run.manifest)
        red = partials.AnalysisReducer(th)
        parts = [part_fold.compute_part(p, [red], 1 << 20)[red.name] for p in run.parts()]
        merged[per_rank] = partials.from_arrays(red.merge(parts))
    assert len(merged[False].steps["step"]) == 4 and set(merged[False].steps["rank"]) == {partials.ALL_RANKS}
    assert len(merged[True].steps["step"]) == 12
    off = analyze(tmp_path / "r", AnalysisConfig(use_cache=False))
    on = analyze(tmp_path / "r", AnalysisConfig(use_cache=False, per_rank=True))
    for name in off.steps.column_names:
        np.testing.assert_allclose(off.steps.column(name).to_numpy(zero_copy_only=False).astype(float),
                                   on.steps.column(name).to_numpy(zero_copy_only=False).astype(float),
                                   rtol=1e-12, err_msg=name)
    assert on.steps_by_rank is not None and on.steps_by_rank.num_rows == 12
