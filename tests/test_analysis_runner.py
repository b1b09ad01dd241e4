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
