"""Format v1.1 interop: every Parquet tool reads a multi-rank run with the right ranks.

The snippets are the ones of docs/format.md's "Read a run without kldiag", executed as
written: the doc cannot drift from what works.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kldiag
from kldiag import format as F
from kldiag.record.recorder import Recorder

DOC = Path(__file__).resolve().parent.parent / "docs" / "format.md"
SAMPLES = Path(__file__).resolve().parent.parent / "sample_logs"


def doc_snippets() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## Read a run without kldiag"):]
    section = section[: section.index("\n## ", 5)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, int]]:
    """Ranks 0 and 1, several parts each, different row counts per rank."""
    run = tmp_path_factory.mktemp("interop") / "run"
    rows = {}
    for rank, batch in ((0, 3), (1, 5)):
        with Recorder(run, rank=rank, world_size=2, rotate_rows=40, beta=0.04, estimator="k3") as rec:
            for step in range(6):
                logp = -np.random.default_rng([rank, step]).exponential(1.0, (batch, 7)).astype(np.float32)
                rec.record(step=step, logp=logp, logp_ref=logp - 0.1, advantages=np.ones(batch, np.float32))
        rows[rank] = rec.stats["rows"]
    assert len(F.list_parts(run)) > 2 and rows == {0: 3 * 7 * 6, 1: 5 * 7 * 6}
    return run, rows


def _rank_counts(obj: object) -> dict[int, int]:
    """rank -> rows of a pyarrow Table or a pandas / Polars DataFrame."""
    if isinstance(obj, pa.Table):
        values = obj.column("rank").to_numpy()
    elif hasattr(obj, "to_pandas") and not hasattr(obj, "iloc"):  # polars
        values = obj["rank"].to_numpy()
    else:
        values = np.asarray(obj["rank"])
    ranks, counts = np.unique(values.astype(np.int64), return_counts=True)
    return dict(zip(ranks.tolist(), counts.tolist(), strict=True))


def test_the_doc_has_one_snippet_per_reader() -> None:
    code = "\n".join(doc_snippets())
    for reader in ("pq.read_table", "pd.read_parquet", "ds.dataset", "duckdb.sql", "pl.scan_parquet"):
        assert reader in code


@pytest.mark.parametrize("snippet", doc_snippets(), ids=lambda s: s.strip().splitlines()[-1][:40])
def test_doc_snippet_reads_every_row_with_its_rank(snippet: str, two_rank_run) -> None:
    run, rows = two_rank_run
    scope: dict = {"RUN": str(run)}
    exec(compile(snippet, str(DOC), "exec"), scope)  # noqa: S102 - our own documentation
    if "manifest" in scope:
        assert scope["manifest"]["format_version"] == F.FORMAT_VERSION
        return
    got = scope.get("table", scope.get("df"))
    assert _rank_counts(got) == rows


def test_token_tree_holds_only_parquet(two_rank_run) -> None:
    run, _ = two_rank_run
    files = [p for p in (run / "tokens").rglob("*") if p.is_file()]
    assert files and all(p.suffix == ".parquet" and p.name.startswith("part-") for p in files)
    assert sorted(p.name for p in (run / "writers").iterdir()) == ["rank-0-a0000.json", "rank-1-a0000.json"]


def test_attempt_column_and_name_agree(two_rank_run) -> None:
    run, _ = two_rank_run
    t = kldiag.open_run(run).read(columns=["rank", "attempt"])
    assert set(t.column("attempt").to_pylist()) == {0}
    assert all(p.attempt == 0 and "-a0000-" in p.name for p in F.list_parts(run))


def _v1_run(root: Path) -> Path:
    """A run as the v1 writer left it: tokens/rank=0/ (Hive name), no attempt column, writer.json inside."""
    run = root / "v1"
    with Recorder(run) as rec:
        for step in range(3):
            rec.record(step=step, logp=-np.ones((2, 4), np.float32), logp_ref=-np.full((2, 4), 2.0, np.float32))
    t = kldiag.open_run(run).read().drop_columns(["attempt"])
    old = run / "tokens" / "rank=0"
    old.mkdir()
    pq.write_table(t, old / F.part_name(0, 2, 0, None))
    (old / F.WRITER_STATS).write_text(json.dumps({"rank": 0, "rows": t.num_rows}))
    shutil.rmtree(run / "tokens" / "rank-0")
    shutil.rmtree(run / "writers")
    m = json.loads((run / F.MANIFEST).read_text())
    (run / F.MANIFEST).write_text(json.dumps({**m, "format_version": 1}))
    return run


def test_v1_runs_still_read(tmp_path: Path) -> None:
    """kldiag reads a v1 run (tokens/rank=R/, no attempt column) as attempt 0."""
    run = kldiag.open_run(_v1_run(tmp_path))
    assert run.manifest.format_version == 1
    parts = run.parts()
    assert len(parts) == 1 and parts[0].attempt == 0 and parts[0].exclude == ()
    t = run.read(columns=["step", "rank", "attempt"])
    assert t.num_rows == 24 and set(t.column("attempt").to_pylist()) == {0}
    assert kldiag.analyze(run.path, kldiag.AnalysisConfig(use_cache=False)).info["rows"] == 24
    assert F.read_rank_stats(run.path) == {(0, 0): {"rank": 0, "rows": 24}}


def test_upgrade_v1_makes_a_run_every_reader_reads(tmp_path: Path) -> None:
    run = _v1_run(tmp_path)
    before = kldiag.analyze(run, kldiag.AnalysisConfig(use_cache=False)).steps
    assert F.upgrade_v1(run) == 1
    assert not (run / "tokens" / "rank=0").exists() and (run / "writers" / "rank-0-a0000.json").exists()
    assert pq.read_table(run / "tokens").num_rows == 24  # v1's Hive directory made this fail
    assert kldiag.open_run(run).manifest.format_version == F.FORMAT_VERSION
    assert kldiag.analyze(run, kldiag.AnalysisConfig(use_cache=False)).steps.equals(before)


@pytest.mark.parametrize("name", ["demo_k3", "demo_k3_is", "trl_grpo_tiny"])
def test_shipped_samples_read_with_plain_pyarrow_and_pandas(name: str) -> None:
    import pandas as pd

    n = pq.read_table(SAMPLES / name / "tokens").num_rows
    assert n == len(pd.read_parquet(SAMPLES / name / "tokens")) == kldiag.open_run(SAMPLES / name).read().num_rows
