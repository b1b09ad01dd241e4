"""Top-k distribution-level mismatch (kldiag/analysis/reducers/topk.py): the bounds against the exact KL of
full categorical distributions, the rank figures, the reducer (merge equals one pass), and
`kldiag analyze --json`'s "topk" key (null for a run without top-k lists)."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

import kldiag
from kldiag.analysis.reducers import topk as T
from kldiag.analysis.runtime import part_fold, runner
from kldiag.cli import main
from kldiag.format import list_parts


def full_pair(rng, n: int, vocab: int, scale: float, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Log-probs [n, vocab] of a trainer pi and an engine mu = pi perturbed by noise, renormalised."""
    z = rng.normal(size=(n, vocab)) * scale
    lp_t = z - np.log(np.exp(z).sum(1, keepdims=True))
    z = lp_t + rng.normal(size=lp_t.shape) * noise
    return z - np.log(np.exp(z).sum(1, keepdims=True)), lp_t


def exact_kl(lp_s: np.ndarray, lp_t: np.ndarray) -> np.ndarray:
    return (np.exp(lp_s) * (lp_s - lp_t)).sum(1)


@pytest.mark.parametrize(("vocab", "k", "scale", "noise"),
                         [(50, 5, 3.0, 0.1), (50, 20, 1.0, 1.0), (400, 20, 3.0, 0.3), (200, 8, 4.0, 2.0),
                          (10, 1, 1.0, 0.5), (30, 29, 2.0, 0.5)])
def test_bounds_hold_against_the_exact_kl(vocab, k, scale, noise):
    rng = np.random.default_rng(vocab + k)
    lp_s, lp_t = full_pair(rng, 1500, vocab, scale, noise)
    exact = exact_kl(lp_s, lp_t)
    ids_s, top_s = T.top_k_of(lp_s, k)
    ids_t, top_t = T.top_k_of(lp_t, k)
    floored = T.kl_topk(ids_s, top_s, ids_t, top_t, logp_floor=float(lp_t.min()))  # a floor that holds
    free = T.kl_topk(ids_s, top_s, ids_t, top_t)  # no floor: the upper bound is infinite
    for r in (floored, free):
        assert np.all(r["lower"] <= exact + 1e-12)
        assert np.all(exact <= r["upper"] + 1e-12)
        assert np.all((r["lower"] <= r["estimate"]) & (r["estimate"] <= r["upper"]))
    assert np.all(np.isfinite(floored["upper"])) and np.all(np.isinf(free["upper"]))
    assert np.all(floored["lower"] >= 0)
    if k < 5:  # a list of 1 to 4 ids says little about a distribution: the bounds may be loose
        return
    assert np.mean(floored["lower"]) > 0.3 * np.mean(exact)  # the lower bound is not trivially 0
    # the estimate is nearer the truth than the coarsened KL (shared ids + one bucket) it starts from
    j = T.align(ids_s, ids_s >= 0, ids_t, ids_t >= 0)
    m = np.where(j >= 0, np.exp(top_s), 0.0)
    p = np.where(j >= 0, np.exp(np.take_along_axis(top_t, np.maximum(j, 0), axis=1)), 0.0)
    coarse = T.xlogx_over(m, p).sum(1) + T.xlogx_over(1 - m.sum(1), 1 - p.sum(1))
    assert np.all(coarse <= exact + 1e-12)
    assert np.mean(np.abs(floored["estimate"] - exact)) <= np.mean(np.abs(coarse - exact))


def test_whole_vocabulary_lists_give_the_exact_kl():
    rng = np.random.default_rng(3)
    lp_s, lp_t = full_pair(rng, 400, 40, 2.0, 0.5)
    exact = exact_kl(lp_s, lp_t)
    ids_s, top_s = T.top_k_of(lp_s, 40)
    ids_t, top_t = T.top_k_of(lp_t, 40)
    r = T.kl_topk(ids_s, top_s, ids_t, top_t, logp_floor=float(lp_t.min()))
    np.testing.assert_allclose(r["estimate"], exact, rtol=0, atol=1e-12)
    np.testing.assert_allclose(r["lower"], exact, rtol=0, atol=1e-9)
    np.testing.assert_allclose(r["upper"], exact, rtol=0, atol=1e-4)  # tol of unlisted mass x the log gap
    # float32 on disk: the lists sum to 1 only to ~1e-7, and nothing becomes infinite
    r32 = T.kl_topk(ids_s, top_s.astype(np.float32), ids_t, top_t.astype(np.float32))
    np.testing.assert_allclose(r32["estimate"], exact, rtol=0, atol=1e-5)


def test_padding_other_k_and_empty_lists():
    ids_s = np.array([[3, 1, -1], [2, 0, 1], [-1, -1, -1]])
    lp_s = np.log(np.array([[0.6, 0.3, np.nan], [0.5, 0.3, 0.2], [np.nan] * 3]))
    ids_t = np.array([[3, 2], [2, 0], [1, 0]])
    lp_t = np.log(np.array([[0.5, 0.4], [0.5, 0.3], [0.5, 0.5]]))
    r = T.compare(ids_s, lp_s, ids_t, lp_t, token=np.array([1, 1, 0]))
    assert list(r["shared"]) == [1, 2, 0]
    assert np.isnan(r["estimate"][2]) and not r["top1_agree"][2] and not r["rank_disagree"][2]
    assert list(r["rank_sampler"]) == [2, 3, 0] and list(r["rank"]) == [0, 0, 1]
    # row 1: exact on {2, 0} and the trainer's 0.2 tail against the engine's id 1 (0.2)
    assert r["lower"][1] == pytest.approx(0.0, abs=1e-5) and r["estimate"][1] == pytest.approx(0.0, abs=1e-5)


def test_top1_discordance_and_ranks():
    ids_s = np.array([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    lp_s = np.log(np.array([[0.4, 0.3, 0.2, 0.1]] * 3))
    ids_t = np.array([[5, 6, 7, 8], [6, 5, 8, 7], [5, 6, 7, 9]])
    lp_t = np.log(np.array([[0.4, 0.3, 0.2, 0.1]] * 3))
    r = T.compare(ids_s, lp_s, ids_t, lp_t, token=np.array([7, 7, 9]))
    assert list(r["top1_agree"]) == [True, False, True]
    assert list(r["discordant"]) == [0, 2, 0]  # (5,6) and (7,8) swapped
    assert list(r["rank_disagree"]) == [False, True, False]
    assert list(r["rank_sampler"]) == [3, 3, 0] and list(r["rank"]) == [3, 4, 4]
    swap_top = T.compare(ids_s[:1], lp_s[:1], np.array([[9, 6, 7, 8]]), lp_t[:1])
    assert swap_top["rank_disagree"][0]  # the engine's top id is missing from the trainer's list


def test_padded_lists_from_arrow():
    col = pa.array([[1, 2, 3], None, [4], []], pa.list_(pa.int32()))
    out = T.padded(col.slice(0, 4), -1, np.int64)
    assert out.tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1], [-1, -1, -1]]
    assert T.padded(col.slice(1, 1), -1, np.int64) is None
    assert T.padded(col.slice(2, 2), -1, np.int64).tolist() == [[4], [-1]]


# ---- the reducer and the faces ------------------------------------------------------------

B, L, V, K = 3, 5, 30, 4


def record_run(path, topk: bool, steps: int = 4, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    rec = kldiag.Recorder(path, rotate_steps=1)
    for step in range(steps):
        lp_s, lp_t = full_pair(rng, B * L, V, 2.0, 0.3 + 0.3 * step)
        tok = lp_s.argmax(1)
        mask = np.ones((B, L), bool)
        mask[0, -1] = False  # out of the loss: never counted
        kw = {}
        if topk:
            ids_t, top_t = T.top_k_of(lp_t, K)
            ids_s, top_s = T.top_k_of(lp_s, K)
            kw = {"topk_ids": ids_t.reshape(B, L, K), "topk_logp": top_t.reshape(B, L, K).astype(np.float32),
                  "topk_ids_sampler": ids_s.reshape(B, L, K),
                  "topk_logp_sampler": top_s.reshape(B, L, K).astype(np.float32)}
        rows = np.arange(B * L)
        rec.record(step=step, logp=lp_t[rows, tok].reshape(B, L).astype(np.float32),
                   logp_sampler=lp_s[rows, tok].reshape(B, L).astype(np.float32),
                   token_ids=tok.reshape(B, L), mask=mask, **kw)
    rec.close()


def one_pass(reducer, parts):
    """Every part's batches folded into one state: the single-pass reference for merge."""
    state = reducer.start(parts[0])
    for part in parts:
        for batch in part_fold.part_batches(part, part_fold.union_columns([reducer]), batch_size=7):
            reducer.add(state, batch)
    return reducer.finish(state, 0)


def test_reducer_merge_equals_one_pass(tmp_path):
    record_run(tmp_path / "run", topk=True)
    parts = list_parts(tmp_path / "run")
    assert len(parts) == 4
    r = T.TopkReducer(keep=5)
    merged = r.result(runner.Pass(tmp_path / "cache", parts, [r], kldiag.AnalysisConfig()).merged(r))
    single = r.result(one_pass(r, parts))
    assert merged["tokens_both"] == 4 * (B * L - 1) == single["tokens_both"]
    assert merged["offenders"] == single["offenders"]  # per-token values: equal to the bit
    for a, b in zip([merged, *merged["steps"]], [single, *single["steps"]], strict=True):  # sums: to rounding
        assert {k: v for k, v in a.items() if k not in ("steps", "offenders")} == pytest.approx(
            {k: v for k, v in b.items() if k not in ("steps", "offenders")}, rel=1e-12)
    assert [o["kl"] for o in merged["offenders"]] == sorted((o["kl"] for o in merged["offenders"]), reverse=True)
    assert merged["kl_mean"] > 0 and merged["lower_mean"] <= merged["kl_mean"] <= merged["upper_mean"]


def test_analyze_json_topk_key_and_null_without_columns(tmp_path, capsys):
    record_run(tmp_path / "with", topk=True)
    record_run(tmp_path / "without", topk=False)
    assert main(["analyze", str(tmp_path / "with"), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["topk"]
    assert got["tokens_both"] == 4 * (B * L - 1) and len(got["steps"]) == 4 and got["offenders"]
    assert 0 <= got["top1_agree"] <= 1 and got["logp_floor"] == T.TopkReducer().logp_floor
    assert main(["analyze", str(tmp_path / "without"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["topk"] is None


def test_one_side_only(tmp_path):
    """The TRL hook records the trainer's lists only: no KL, but the sampled token's rank."""
    rng = np.random.default_rng(1)
    lp_s, lp_t = full_pair(rng, B * L, V, 2.0, 0.5)
    tok = lp_s.argmax(1)
    ids_t, top_t = T.top_k_of(lp_t, K)
    rec = kldiag.Recorder(tmp_path / "run")
    rec.record(step=0, logp=lp_t[np.arange(B * L), tok].reshape(B, L).astype(np.float32), token_ids=tok.reshape(B, L),
               topk_ids=ids_t.reshape(B, L, K), topk_logp=top_t.reshape(B, L, K).astype(np.float32))
    rec.close()
    a = kldiag.analyze(tmp_path / "run", None, [T.TopkReducer()])
    got = T.TopkReducer().result(runner.reduced(a, T.TopkReducer()))
    assert got["tokens_trainer"] == B * L and got["tokens_both"] == 0 and got["kl_mean"] is None
    unlisted = np.mean(T.rank_of(ids_t, top_t, tok) == 0)
    assert got["sampled_unlisted"] == pytest.approx(unlisted)
