""""Flagged" is one number: the kernel's per-step counts, the run figure of `kldiag analyze` (text and
--json) and `kldiag report` all equal kldiag.estimators.flagged over the run's tokens."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kldiag import estimators as E
from kldiag.analysis.core.flagged import flagged_text, run_flagged, subset_text
from kldiag.cli import main
from kldiag.tools.synth import SynthConfig, make_run


def _by_definition(run) -> tuple[int, int]:
    t = pa.concat_tables([pq.read_table(f) for f in sorted((run / "tokens").rglob("*.parquet"))])
    col = {c: t.column(c).to_numpy(zero_copy_only=False).astype(np.float64) for c in
           ("logp", "logp_ref", "logp_old", "logp_sampler")}
    mask = t.column("mask").to_numpy(zero_copy_only=False).astype(bool)
    fl = E.flags(col["logp"], col["logp_ref"], col["logp_old"], col["logp_sampler"])
    return int(E.flagged(fl, mask).sum()), int(mask.sum())


def test_every_face_shows_the_one_flagged_number(tmp_path, capsys):
    run = tmp_path / "r"
    make_run(run, SynthConfig(steps=6, seqs_per_step=8, seq_len=(8, 16), vocab_size=0, blowup_step=3,
                              blowup_frac=0.05, nonfinite=((1, "logp"), (4, "logp_ref")), positive=(2,)))
    count, tokens = _by_definition(run)
    assert count >= 10
    line = f"flagged: {flagged_text(count, tokens)}"
    assert main(["analyze", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["flagged"] == {"count": count, "tokens": tokens}
    assert main(["analyze", str(run)]) == 0
    assert line in capsys.readouterr().out.splitlines()
    main(["report", str(run), "-o", str(tmp_path / "r.html")])
    assert line in capsys.readouterr().out.splitlines()
    assert f"Flagged: {flagged_text(count, tokens)}" in (tmp_path / "r.html").read_text()


def test_run_flagged_from_either_table_and_the_subset_wording():
    steps = pa.table({"tokens": [100, 50, 0], "flagged_frac": [0.03, 0.5, None]})
    assert run_flagged(steps) == (28, 150) == run_flagged(steps.to_pandas())
    assert flagged_text(28, 150) == "28 of 150 tokens in the loss (18.667%)"
    assert subset_text(1000, 6229) == "the 1,000 worst of 6,229 flagged" and subset_text(12, 12) == "all 12 flagged"


def test_an_infinite_log_prob_is_nonfinite_not_invalid(tmp_path):
    """One +inf logp_ref and one logp of 0.5: the flags table, the steps' counts and the episodes call the
    first non-finite only and the second invalid only."""
    import kldiag

    run = tmp_path / "r"
    make_run(run, SynthConfig(steps=3, seqs_per_step=4, seq_len=(6, 10), vocab_size=0, positive=(1,)))
    part = sorted((run / "tokens").rglob("*.parquet"))[0]
    t = pq.read_table(part)
    d = t.to_pydict()
    at = next(i for i, (st, m) in enumerate(zip(d["step"], d["mask"], strict=True)) if st == 2 and m)
    d["logp_ref"][at] = float("inf")
    pq.write_table(pa.table(d, schema=t.schema), part)
    a = kldiag.analyze(run)
    steps = a.steps.to_pylist()
    assert [(s["nonfinite_count"], s["invalid_count"]) for s in steps] == [(0, 0), (0, 1), (1, 0)]
    flags = [r for r in a.flags.to_pylist() if r["nonfinite"] or r["invalid"]]
    assert sorted((r["step"], r["nonfinite"], r["invalid"]) for r in flags) == [(1, False, True), (2, True, False)]
