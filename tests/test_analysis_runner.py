"""kldiag.analysis.runtime.runner: the lazily merged Reduced mapping (the passes themselves: test_part_opens.py,
test_reducer_prefix.py)."""

from __future__ import annotations

from kldiag.analysis.runtime.runner import Reduced


def test_reduced_answers_membership_without_merging():
    """`name in analysis.reduced` (runner.reduced and read_along ask it) merges nothing; a read merges once."""
    made = []
    r = Reduced({"a": lambda: made.append("a") or {"x": 1}, "b": lambda: made.append("b") or {"y": 2}})
    assert "a" in r and "c" not in r and made == []
    assert r["a"] == {"x": 1} and r["a"] == {"x": 1} and made == ["a"]
    assert sorted(r) == ["a", "b"] and len(r) == 2 and made == ["a"]


def test_a_part_that_cannot_be_read_is_not_counted_as_analysed(tmp_path):
    import warnings

    from kldiag.analysis.pipeline import analyze
    from kldiag.tools.synth import SynthConfig, make_run

    cfg = SynthConfig(steps=4, seqs_per_step=4, seq_len=(4, 8), vocab_size=0)
    for k in range(4):
        make_run(tmp_path, cfg, steps=range(k, k + 1), manifest=(k == 0))
    part = sorted((tmp_path / "tokens").rglob("*.parquet"))[1]
    part.write_bytes(part.read_bytes()[:300])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = analyze(tmp_path)
        assert (a.files, a.files_new, len(a.skipped)) == (4, 3, 1)
        again = analyze(tmp_path)  # the others come from the cache; the bad one is tried again and fails
        assert (again.files_new, len(again.skipped)) == (0, 1)
