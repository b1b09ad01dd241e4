"""Format v1.1 interop: every Parquet tool reads a multi-rank run with the right ranks.

The snippets are the ones of docs/format.md's "Read a run without kldiag", executed as
written: the doc cannot drift from what works.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import kldiag
from kldiag import format as F
from kldiag.recorder import Recorder

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


def test_v1_runs_still_read() -> None:
    """sample_logs are v1 runs (tokens/rank=R/, no attempt column): kldiag reads them as attempt 0."""
    run = kldiag.open_run(SAMPLES / "demo_k3")
    assert run.manifest.format_version == 1
    parts = run.parts()
    assert parts and all(p.attempt == 0 and p.exclude == () for p in parts)
    t = run.read(columns=["step", "rank", "attempt"])
    assert t.num_rows > 0 and set(t.column("attempt").to_pylist()) == {0}
    assert kldiag.analyze(SAMPLES / "demo_k3", kldiag.AnalysisConfig(use_cache=False)).info["rows"] == t.num_rows
