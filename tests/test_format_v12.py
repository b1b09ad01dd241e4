"""Format v1.2: the optional `turn` and top-k list columns, written by the Recorder, read by
kldiag and by plain pyarrow, pandas and DuckDB (docs/format.md's snippets, executed as written);
v1.1 runs, and runs mixing v1.1 and v1.2 parts, still read."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kldiag
from kldiag import format as F
from kldiag.record.recorder import Recorder

DOC = Path(__file__).resolve().parent.parent / "docs" / "format.md"
B, T, K, K_SAMPLER = 3, 6, 4, 2


def doc_snippets() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## Optional columns (v1.2)"):]
    section = section[: section.index("\n## ", 5)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def batch(step: int, seed: int = 0) -> dict[str, np.ndarray]:
    """One [B, T] micro-batch with turns and both top-k sides; row b has T - b completion tokens."""
    rng = np.random.default_rng([step, seed])
    logp = -rng.exponential(1.0, (B, T)).astype(np.float32)
    comp = np.arange(T)[None, :] < (T - np.arange(B))[:, None]
    return {"logp": logp, "logp_sampler": logp - 0.01, "completion_mask": comp, "mask": comp,
            "turn": np.tile(np.arange(T) // 2, (B, 1)),
            "topk_ids": rng.integers(0, 1000, (B, T, K)), "topk_logp": -rng.exponential(1.0, (B, T, K)),
            "topk_ids_sampler": rng.integers(0, 1000, (B, T, K_SAMPLER)),
            "topk_logp_sampler": -rng.exponential(1.0, (B, T, K_SAMPLER)).astype(np.float32)}


def expected(b: dict[str, np.ndarray], name: str) -> list:
    keep = b["completion_mask"]
    return [x.tolist() for x in b[name][keep]]


def record_v11(run: Path, steps: range) -> None:
    """A run as a v1.1 writer leaves it: no optional column in any part, format_version 1.1."""
    with Recorder(run, rotate_seconds=None) as rec:
        for step in steps:
            b = batch(step)
            rec.record(step=step, logp=b["logp"], logp_sampler=b["logp_sampler"], mask=b["mask"])
    m = json.loads((run / F.MANIFEST).read_text())
    (run / F.MANIFEST).write_text(json.dumps({**m, "format_version": 1.1}))


@pytest.fixture()
def mixed_run(tmp_path: Path) -> Path:
    """Steps 0-1 by a v1.1 writer (attempt 0), steps 2-3 by a v1.2 writer with every optional column."""
    run = tmp_path / "mixed"
    record_v11(run, range(2))
    with Recorder(run, rotate_seconds=None) as rec:
        for step in (2, 3):
            rec.record(step=step, **batch(step))
    return run


def test_round_trip_through_the_recorder(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    b = batch(0)
    args = {**b, "topk_ids": torch.from_numpy(b["topk_ids"]),  # int64 tensor -> int32 column
            "topk_logp": torch.from_numpy(b["topk_logp"]).to(torch.bfloat16)}  # bf16 widened on the host
    with Recorder(tmp_path, rotate_seconds=None) as rec:
        rec.record(step=0, **args)
    run = kldiag.open_run(tmp_path)
    assert run.manifest.format_version == F.FORMAT_VERSION >= 1.3
    t = run.read(columns=F.RUN_SCHEMA.names)
    assert t.schema.equals(F.RUN_SCHEMA) and t.num_rows == int(b["completion_mask"].sum())
    assert t.column("turn").to_pylist() == b["turn"][b["completion_mask"]].tolist()
    assert t.column("topk_ids").to_pylist() == expected(b, "topk_ids")
    bf16 = torch.from_numpy(b["topk_logp"]).to(torch.bfloat16).float().numpy()
    assert t.column("topk_logp").to_pylist() == [x.tolist() for x in bf16[b["completion_mask"]]]
    assert t.column("topk_ids_sampler").to_pylist() == expected(b, "topk_ids_sampler")
    assert t.column("topk_logp_sampler").to_pylist() == expected(b, "topk_logp_sampler")
    physical = pq.read_schema(run.parts()[0].path)
    assert physical.field("topk_ids").type == pa.list_(pa.int32())  # a list, not a fixed_size_list


def test_unused_optional_columns_leave_the_part_a_v11_part(tmp_path: Path) -> None:
    """No turn, no top-k: the part holds TOKEN_SCHEMA only (an all-null column costs ~1.4 kB a part)."""
    with Recorder(tmp_path, rotate_seconds=None) as rec:
        rec.record(step=0, logp=batch(0)["logp"])
    part = F.list_parts(tmp_path)[0]
    assert pq.read_schema(part.path).names == F.TOKEN_SCHEMA.names
    t = kldiag.open_run(tmp_path).read(columns=["step", *F.OPTIONAL_SCHEMA.names])
    assert all(t.column(c).null_count == t.num_rows for c in F.OPTIONAL_SCHEMA.names)


def test_one_part_with_and_without_topk_holds_nulls_where_absent(tmp_path: Path) -> None:
    b = batch(0)
    with Recorder(tmp_path, rotate_seconds=None) as rec:
        rec.record(step=0, logp=b["logp"], completion_mask=b["completion_mask"], turn=b["turn"])
        rec.record(step=0, micro=1, **b)
        rec.record(step=0, micro=2, **{**b, "topk_ids": b["topk_ids"][..., :1], "topk_logp": b["topk_logp"][..., :1]})
    assert len(F.list_parts(tmp_path)) == 1
    t = kldiag.open_run(tmp_path).read(columns=["micro", "turn", "topk_ids", "topk_ids_sampler"]).to_pydict()
    n = int(b["completion_mask"].sum())
    assert t["micro"] == [0] * n + [1] * n + [2] * n
    assert t["topk_ids"] == [None] * n + expected(b, "topk_ids") + [x[:1] for x in expected(b, "topk_ids")]
    assert t["turn"] == b["turn"][b["completion_mask"]].tolist() * 3
    assert t["topk_ids_sampler"][:n] == [None] * n


def test_v11_run_reads_with_null_optional_columns(tmp_path: Path) -> None:
    run_dir = tmp_path / "v11"
    record_v11(run_dir, range(3))
    run = kldiag.open_run(run_dir)
    assert run.manifest.format_version == 1.1
    t = run.read(columns=F.RUN_SCHEMA.names)
    assert t.num_rows == 3 * int(batch(0)["completion_mask"].sum())
    assert all(t.column(c).null_count == t.num_rows for c in F.OPTIONAL_SCHEMA.names)
    assert kldiag.analyze(run_dir, kldiag.AnalysisConfig(use_cache=False)).info["rows"] == t.num_rows


def test_mixed_v11_and_v12_parts_read_as_one_table(mixed_run: Path) -> None:
    t = kldiag.open_run(mixed_run).read(columns=["step", "attempt", "turn", "topk_ids", "topk_logp_sampler"])
    n = int(batch(0)["completion_mask"].sum())
    assert t.column("step").to_pylist() == [0] * n + [1] * n + [2] * n + [3] * n
    assert t.column("attempt").to_pylist() == [0] * 2 * n + [1] * 2 * n
    assert t.column("turn").to_pylist()[: 2 * n] == [None] * 2 * n
    assert t.column("topk_ids").to_pylist()[2 * n:] == expected(batch(2), "topk_ids") + expected(batch(3), "topk_ids")
    assert t.column("topk_logp_sampler").to_pylist()[3 * n:] == expected(batch(3), "topk_logp_sampler")
    assert kldiag.analyze(mixed_run, kldiag.AnalysisConfig(use_cache=False)).info["rows"] == 4 * n


def test_the_doc_has_a_snippet_per_reader() -> None:
    code = "\n".join(doc_snippets())
    for reader in ("ds.dataset", "pd.read_parquet", "duckdb.sql"):
        assert reader in code


def test_doc_snippets_read_the_optional_columns(mixed_run: Path) -> None:
    """pyarrow, pandas and DuckDB, as docs/format.md tells them, on a run mixing v1.1 and v1.2 parts."""
    scope: dict = {"RUN": str(mixed_run)}
    n = int(batch(0)["completion_mask"].sum())
    want_ids = expected(batch(2), "topk_ids") + expected(batch(3), "topk_ids")
    for snippet in doc_snippets():
        scope.pop("table", None), scope.pop("df", None)
        exec(compile(snippet, str(DOC), "exec"), scope)  # noqa: S102 - our own documentation
        got = scope.get("table", scope.get("df"))
        df = got.to_pandas() if isinstance(got, pa.Table) else got
        df = df.sort_values(["step", "seq", "pos"], kind="stable").reset_index(drop=True)
        assert len(df) == 4 * n
        assert df["turn"].isna().sum() == 2 * n  # the v1.1 parts
        assert df["turn"][2 * n:].astype(int).tolist() == batch(2)["turn"][batch(2)["completion_mask"]].tolist() * 2
        ids = [[int(v) for v in x] if hasattr(x, "__len__") else None  # null: None, NaN or pd.NA by reader
               for x in df["topk_ids"]]
        assert ids[: 2 * n] == [None] * 2 * n and ids[2 * n:] == want_ids
        if "top1" in df:  # DuckDB's 1-based list index
            assert df["top1"][2 * n:].astype(int).tolist() == [x[0] for x in want_ids]


@pytest.mark.parametrize(("change", "fragment"), [
    ({"topk_ids": np.zeros((B, T), np.int64)}, "topk_ids has shape (3, 6), but logp has shape (3, 6); pass "
                                               "topk_ids with shape (3, 6, K)"),
    ({"topk_logp": None}, "topk_ids was passed without topk_logp; pass both"),
    ({"topk_logp_sampler": np.zeros((B, T, K_SAMPLER + 1))}, "pass one log-prob per top-k id (same K)"),
    ({"turn": np.zeros((B, T + 1), np.int64)}, "pass turn with shape (3, 6)"),
    ({"topk_ids": np.zeros((B, T, 0), np.int64), "topk_logp": np.zeros((B, T, 0))}, "with shape (3, 6, K)"),
])
def test_bad_shapes_are_refused_before_anything_is_queued(tmp_path: Path, change: dict, fragment: str) -> None:
    with Recorder(tmp_path, rotate_seconds=None) as rec:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            rec.record(step=0, **{**batch(0), **change})
    assert rec.stats["rows"] == 0 and F.list_parts(tmp_path) == []


def test_the_flight_ring_carries_the_new_inputs(tmp_path: Path) -> None:
    with Recorder(tmp_path, every_n_steps=2, flight_steps=2, rotate_seconds=None) as rec:
        for step in range(3):
            rec.record(step=step, **batch(step))
        bundle = rec.dump_flight({"kind": "manual"})
    t = kldiag.open_run(bundle).read(columns=["step", "turn", "topk_ids_sampler"])
    assert sorted(set(t.column("step").to_pylist())) == [1, 2]
    assert t.column("topk_ids_sampler").to_pylist()[-int(batch(2)["completion_mask"].sum()):] == expected(
        batch(2), "topk_ids_sampler")


def _large_topk(torch, device: str) -> dict:
    """A micro-batch whose top-k arrays exceed the Stager's small-copy size: pooled (pinned on CUDA) buffers."""
    g = torch.Generator().manual_seed(0)
    b, t, k = 8, 512, 20
    logp = -torch.rand(b, t, generator=g)
    comp = torch.arange(t)[None, :] < torch.tensor([t - 7 * i for i in range(b)])[:, None]
    return {"logp": logp.to(device), "completion_mask": comp.to(device), "turn": (torch.arange(t) // 100).repeat(b, 1)
            .to(device), "topk_ids": torch.randint(0, 150_000, (b, t, k), generator=g).to(device),
            "topk_logp": (-torch.rand(b, t, k, generator=g)).to(torch.bfloat16).to(device)}


def _check_large(run: Path, torch, args: dict) -> None:
    comp = args["completion_mask"].cpu().numpy()
    t = kldiag.open_run(run).read(columns=["step", "turn", "topk_ids", "topk_logp"])
    assert t.num_rows == 2 * int(comp.sum())
    ids = args["topk_ids"].cpu().numpy()[comp]
    lp = args["topk_logp"].float().cpu().numpy()[comp]
    got_ids = np.asarray(t.column("topk_ids").combine_chunks().flatten()).reshape(-1, ids.shape[1])
    got_lp = np.asarray(t.column("topk_logp").combine_chunks().flatten()).reshape(-1, lp.shape[1])
    np.testing.assert_array_equal(got_ids, np.concatenate([ids, ids]))
    np.testing.assert_array_equal(got_lp, np.concatenate([lp, lp]))


def test_large_topk_batches_go_through_pooled_buffers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    args = _large_topk(torch, "cpu")
    with Recorder(tmp_path, rotate_seconds=None) as rec:
        for step in range(2):  # the second reuses the first's pooled buffers
            rec.record(step=step, **args)
    _check_large(tmp_path, torch, args)


def test_topk_from_cuda_tensors(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    args = _large_topk(torch, "cuda")
    with Recorder(tmp_path, rotate_seconds=None) as rec:
        for step in range(2):
            rec.record(step=step, **args)
    _check_large(tmp_path, torch, args)
