"""The sequence table on disk (kldiag/analysis/core/seqrows.py): what a face's query costs through
`Analysis.sequence_rows` against pyarrow.dataset and DuckDB (one thread) on the same Parquet file.

    .venv/bin/python bench/sequence_query.py RUN     # e.g. bench/dashboard.py's 100M-row run

The run is analysed (its cache warm or not), its sequence table written once more to a named file
with the same row groups, and each query timed, best of 5: the 50 worst sequences by
|k3 weight| (SequenceRows reads the ranking column, then only the row groups holding them; pyarrow:
the column, then a take on the whole table; DuckDB: ORDER BY ... LIMIT), one sequence, ten steps.
"""

from __future__ import annotations

import sys
import tempfile
import time

import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

import kldiag
from kldiag.analysis.core import seqrows


def best(fn, k: int = 5):
    times, out = [], None
    for _ in range(k):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3, out


def main() -> None:
    import duckdb  # pip install 'kldiag[bench]'

    a = kldiag.analyze(sys.argv[1])
    rows = a.sequence_rows
    if rows is None:
        raise SystemExit(f"{sys.argv[1]}: {a.sequences.num_rows} sequences, below seqrows.SPILL_ROWS: kept in memory")
    t = rows.table()
    path = tempfile.mkdtemp() + "/sequences.parquet"
    pq.write_table(t, path, compression="lz4", use_dictionary=False, row_group_size=seqrows.ROW_GROUP)
    n = t.num_rows
    step, seq = t.column("step")[n // 2].as_py(), t.column("seq")[n // 2].as_py()
    lo = t.column("step")[n // 2].as_py()
    del t
    dset = ds.dataset(path, format="parquet")
    con = duckdb.connect()
    con.execute("SET threads=1")
    sql = lambda q: lambda: con.execute(q.replace("{T}", f"'{path}'")).to_arrow_table()  # noqa: E731

    def pa_worst():
        col = dset.to_table(columns=["weight_k3_abs_max"])
        return dset.to_table().take(pc.select_k_unstable(col, 50, [("weight_k3_abs_max", "descending")]))

    queries = {
        "worst 50": (lambda: rows.worst(50), pa_worst,
                     sql("SELECT * FROM {T} ORDER BY weight_k3_abs_max DESC NULLS LAST LIMIT 50")),
        "one sequence": (lambda: rows.sequence(step, seq),
                         lambda: dset.to_table(filter=(pc.field("step") == step) & (pc.field("seq") == seq)),
                         sql(f"SELECT * FROM {{T}} WHERE step = {step} AND seq = {seq}")),
        "ten steps": (lambda: rows.steps(lo, lo + 9),
                      lambda: dset.to_table(filter=(pc.field("step") >= lo) & (pc.field("step") <= lo + 9)),
                      sql(f"SELECT * FROM {{T}} WHERE step BETWEEN {lo} AND {lo + 9}")),
    }
    print(f"{n:,} sequence rows, {pq.ParquetFile(path).num_row_groups} row groups; ms, best of 5; "
          f"DuckDB {duckdb.__version__}, one thread")
    for name, fns in queries.items():
        (a1, r1), (a2, r2), (a3, r3) = (best(f) for f in fns)
        print(f"  {name:13s} SequenceRows {a1:7.1f} ({r1.num_rows} rows)  pyarrow.dataset {a2:7.1f} ({r2.num_rows})  "
              f"DuckDB {a3:7.1f} ({r3.num_rows})")


if __name__ == "__main__":
    main()
