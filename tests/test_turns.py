"""Turn index per token and the per-turn figures (kldiag/analysis/reducers/turns.py): the derivation's edge cases, the
reducer's merge against one pass, `kldiag analyze --json`'s "turns", the recorded turn column, the report's section."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from kldiag import estimators as E
from kldiag.analysis.reducers import turns as TU
from kldiag.format.schema import RUN_SCHEMA

# Rows are built with the recorded columns' own types (RUN_SCHEMA: int16 iteration and turn, int32 pos, float32
# log-probs), as a run's parts hold them: every array type the fold is called with is one numba compiles anew (11
# signatures, 10-20 s each on a clean checkout, when these rows were int64 and float64), and these are the ones
# every run compiles anyway.

pytestmark = pytest.mark.filterwarnings("ignore:kldiag.*placeholder")


def _derive(seqs: list[list[int]]):
    """turn_index over sequences given as lists of mask bits."""
    mask = np.concatenate([np.array(s, bool) for s in seqs])
    new = np.concatenate([np.eye(1, len(s), 0, dtype=bool)[0] for s in seqs])
    return TU.turn_index(new, mask)


def test_turn_index_edge_cases():
    turn, pit = _derive([
        [0, 0, 1, 1, 0, 1, 1, 1, 0],  # leading prompt masked, two turns, trailing tool span
        [1, 1, 1],  # a single span
        [0, 0, 0],  # all masked
        [1, 0, 1, 0, 1],  # three one-token turns
    ])
    assert turn.tolist() == [-1, -1, 0, 0, -1, 1, 1, 1, -1, 0, 0, 0, -1, -1, -1, 0, -1, 1, -1, 2]
    assert pit.tolist() == [-1, -1, 0, 1, -1, 0, 1, 2, -1, 0, 1, 2, -1, -1, -1, 0, -1, 0, -1, 0]


def test_turn_index_restarts_at_each_sequence_even_when_spans_touch():
    # a sequence that ends inside a span and the next that starts inside one: two separate turn 0s
    turn, pit = _derive([[0, 1, 1], [1, 1, 0, 1]])
    assert turn.tolist() == [-1, 0, 0, 0, 0, -1, 1]
    assert pit.tolist() == [-1, 0, 1, 0, 1, -1, 0]


def test_recorded_turns_win_and_split_spans():
    new = np.array([1, 0, 0, 0, 0, 0], bool)
    mask = np.array([0, 1, 1, 1, 1, 0], bool)
    recorded = np.array([-1, 0, 0, 1, 1, -1])  # one mask span holding two recorded turns
    turn, pit = TU.turn_index(new, mask, recorded)
    assert turn.tolist() == [-1, 0, 0, 1, 1, -1]
    assert pit.tolist() == [-1, 0, 1, 0, 1, -1]


def test_pos_bins_and_overflow_bucket():
    assert TU.pos_bin(np.array([-1, 0, 1, 2, 3, 7, 8, 31, 32, 500])).tolist() == [-1, 0, 1, 2, 3, 3, 4, 4, 5, 5]
    assert TU.turn_bucket(np.array([0, 15, 16, 40])).tolist() == [0, 15, 16, 16]


DRIFT = 2.0**-7  # logp - logp_old of every row; a binary fraction, exact in float32 like the 1/64 grid of logp_old


def _batch(seqs, rng, step=0, mm_turn_start=0.0):
    """Rows of sequences given as mask lists; logp_sampler off by mm_turn_start at later turns' first token. The
    log-probs lie on a grid of 1/64, so that float32 holds them and their differences exactly."""
    cols = {k: [] for k in ("step", "iteration", "seq", "pos", "mask", "logp", "logp_old", "logp_ref", "logp_sampler")}
    for i, m in enumerate(seqs):
        n = len(m)
        old = -rng.integers(1, 128, n) / 64.0
        t, p = TU.turn_index(np.eye(1, n, 0, dtype=bool)[0], np.array(m, bool))
        samp = old + np.where((t >= 1) & (p == 0), mm_turn_start, 0.0)
        samp = np.where(np.array(m, bool), samp, 0.0)  # a dump's placeholder on tool tokens
        cols["step"] += [step] * n
        cols["iteration"] += [0] * n
        cols["seq"] += [i] * n
        cols["pos"] += list(range(n))
        cols["mask"] += list(map(bool, m))
        cols["logp"] += list(old - DRIFT)
        cols["logp_old"] += list(old)
        cols["logp_ref"] += list(old - 0.1)
        cols["logp_sampler"] += list(samp)
    return pa.RecordBatch.from_pydict({k: pa.array(v, RUN_SCHEMA.field(k).type) for k, v in cols.items()})


def _fold(reducer, batches, rank=0):
    state = reducer.start(SimpleNamespace(rank=rank))
    for b in batches:
        reducer.add(state, b)
    return reducer.finish(state, 0)


SEQS = [[0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1], [0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1]]


def _same(a, b):
    """Equal up to float rounding (sums taken in another order)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12)
    else:
        assert a == b


def test_reducer_merge_equals_one_pass_and_batch_cuts_do_not_split_sequences():
    rng = np.random.default_rng(0)
    red = TU.TurnReducer()
    batches = [_batch(SEQS, rng, step=s, mm_turn_start=0.5) for s in range(4)]
    one = _fold(red, [pa.Table.from_batches(batches).combine_chunks().to_batches()[0]])
    def pieces(bs):  # record batches of 7 rows: cuts inside sequences
        t = pa.Table.from_batches(bs).combine_chunks()
        return [t.slice(o, 7).to_batches()[0] for o in range(0, t.num_rows, 7)]

    by_part = red.merge([_fold(red, pieces(batches[:1])), _fold(red, pieces(batches[1:]))])  # parts hold whole steps
    _same(TU.summary(by_part), TU.summary(one))
    _same(TU.summary(_fold(red, pieces(batches))), TU.summary(one))
    for k in TU.SUMS:
        np.testing.assert_allclose(by_part[k], one[k])


def test_figures_by_turn_and_position():
    rng = np.random.default_rng(1)
    m = _fold(TU.TurnReducer(), [_batch(SEQS, rng, step=s, mm_turn_start=0.5) for s in range(3)])
    s = TU.summary(m)
    assert s["turns"] == 3 and s["multi_turn"] and s["sequences"] == {"single_turn": 3, "multi_turn": 6}  # per step
    by = {r["turn"]: r for r in s["by_turn"]}
    assert by["0"]["mismatch_abs_mean"] == 0.0 and by["0"]["start_mismatch_abs_mean"] == 0.0
    assert by["1"]["start_mismatch_abs_mean"] == pytest.approx(0.5) and by["1"]["body_mismatch_abs_mean"] == 0.0
    assert by["1"]["tokens"] == 3 * (3 + 9)  # 3 steps x (turn 1 of seq 0, turn 1 of seq 2)
    assert sum(r["tokens"] for r in s["by_turn"]) == 3 * sum(sum(x) for x in SEQS)
    assert by["0"]["drift_abs_mean"] == pytest.approx(DRIFT, rel=1e-6)
    assert s["single_turn_mismatch_abs_mean"] == 0.0  # tool tokens' 0.0 placeholders never count
    pos0 = next(r for r in s["by_position"] if r["pos"] == "0")
    assert pos0["mismatch_abs_max"] == pytest.approx(0.5)
    assert [len(r["mismatch_abs_mean"]) for r in s["steps"]] == [3, 3, 3]
    assert s["examples"][0]["turn"] >= 1 and s["examples"][0]["start_mismatch_abs"] == pytest.approx(0.5)
    json.dumps(s)  # JSON-ready


def test_single_turn_run_has_one_turn():
    rng = np.random.default_rng(2)
    s = TU.summary(_fold(TU.TurnReducer(), [_batch([[1] * 6, [0, 1, 1, 1]], rng)]))
    assert s["turns"] == 1 and not s["multi_turn"] and s["sequences"] == {"single_turn": 2, "multi_turn": 0}


def test_empty_partial():
    s = TU.summary(TU.TurnReducer().merge([]))
    assert s["turns"] == 0 and s["by_turn"] == [] and s["steps"] == []


@pytest.fixture(scope="module")
def agentic(tmp_path_factory):
    from kldiag.tools.agentic_runs import AgenticRun, make_run

    root = tmp_path_factory.mktemp("agentic")
    return {"retok": make_run(root / "retok", AgenticRun(steps=6, retokenize=True)),
            "recorded": make_run(root / "recorded", AgenticRun(steps=3, record_turns=True, placeholder=None))}


def test_analyze_json_has_turns(agentic, capsys):
    from kldiag.cli import main

    assert main(["analyze", str(agentic["retok"]), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    t = out["turns"]
    assert t["turns"] == 3 and t["multi_turn"]
    by = {r["turn"]: r for r in t["by_turn"]}
    assert by["1"]["start_mismatch_abs_mean"] > 5 * max(by["0"]["mismatch_abs_mean"], 1e-3)
    assert len(t["steps"]) == 6


def test_multi_turn_is_summarys_flag(agentic, tmp_path):
    from kldiag.analysis.pipeline import analyze
    from kldiag.analysis.types import AnalysisConfig
    from kldiag.tools.synth import SynthConfig, make_run

    single = tmp_path / "single"
    make_run(single, SynthConfig(steps=3, seqs_per_step=4, seq_len=(5, 30), vocab_size=0))
    for run in (agentic["retok"], agentic["recorded"], single):
        a = analyze(run, AnalysisConfig())
        assert TU.multi_turn(a) is TU.turns_of(a)["multi_turn"]
    assert TU.multi_turn(analyze(agentic["retok"], AnalysisConfig()))


def test_recorded_turn_column_is_read(agentic):
    from kldiag.analysis.pipeline import analyze
    from kldiag.analysis.types import AnalysisConfig
    from kldiag.format import open_run

    col = open_run(agentic["recorded"]).read(columns=["turn", "mask"]).to_pandas()
    assert set(col.loc[col["mask"], "turn"]) == {0, 1, 2}  # the generator passed turn= to record()
    a = analyze(agentic["recorded"], AnalysisConfig(), [TU.TurnReducer()])
    s = TU.summary(a.reduced["turns"])
    assert [r["turn"] for r in s["by_turn"]] == ["0", "1", "2"] and s["sequences"]["multi_turn"] == 48


def test_report_has_a_turn_section_for_multi_turn_runs(agentic, tmp_path):
    from kldiag.analysis.pipeline import analyze
    from kldiag.analysis.types import AnalysisConfig
    from kldiag.report import turns as RT
    from kldiag.report.build import reducers

    a = analyze(agentic["retok"], AnalysisConfig(), reducers())
    lines = RT.text_lines(a)
    assert lines[0].startswith("turns: 3 turn(s)") and any("turn 1:" in x and "first token" in x for x in lines)
    assert "<h2>Turns" in RT.section_html(a)
    from kldiag.tools.agentic_runs import AgenticRun, make_run

    single = make_run(tmp_path / "single", AgenticRun(steps=2, turns=1))
    b = analyze(single, AnalysisConfig(), reducers())
    assert RT.text_lines(b) == [] and RT.section_html(b) == ""


def _reference_grid(t):
    """SUMS and the max |m - o| per (turn bucket, position bin), computed with numpy from turn_index and
    kldiag.estimators: what the compiled fold must give. t: sorted columns with validity masks."""
    from kldiag import estimators as E

    new = TU.sequence_starts(t["step"], t["iteration"], t["seq"])
    turn, pit = TU.turn_index(new, t["mask"], t["turn"])
    s, r, m = (t[k].astype(np.float64) for k in ("logp", "logp_ref", "logp_sampler"))
    o = np.where(t["valid_logp_old"], t["logp_old"].astype(np.float64), s)
    vr, vm, vo = t["valid_logp_ref"], t["valid_logp_sampler"], t["valid_logp_old"]
    with np.errstate(all="ignore"):
        mm, x = np.where(vm, m - o, np.nan), s - o
        k3x, w = np.expm1(-x) + x, np.where(vr, np.abs(E.weight_k3(s, r)), np.nan)
        bad = lambda v, ok: ok & (~np.isfinite(v) | (v > 0))  # noqa: E731 - present, non-finite or > 0
        flagged = (bad(s, True) | bad(o, vo) | bad(m, vm) | bad(r, vr)
                   | (vr & (E.flag_theta_ll_ref(s, r) | E.flag_weight_blowup(s, r) | E.flag_clamp_saturated(s, r))))
    keep = turn >= 0
    cell = (TU.turn_bucket(turn) * TU.N_POS + TU.pos_bin(pit))[keep]

    def add(v, ok=None):
        ok = (np.ones(len(turn), bool) if ok is None else ok)[keep]
        return np.bincount(cell[ok], np.asarray(v, np.float64)[keep][ok], TU.N_TURN * TU.N_POS).reshape(TU.N_TURN, -1)

    one, ok_m, ok_d = np.ones(len(turn)), np.isfinite(mm), np.isfinite(x) & np.isfinite(k3x)
    ok_w = np.isfinite(w)
    return {"tokens": add(one), "n_mismatch": add(one, ok_m), "mismatch_abs": add(np.abs(mm), ok_m),
            "mismatch": add(mm, ok_m), "n_drift": add(one, ok_d), "drift_abs": add(np.abs(x), ok_d),
            "drift_k3": add(k3x, ok_d), "n_weight": add(one, ok_w), "weight_k3_abs": add(w, ok_w),
            "flagged": add(flagged.astype(float))}


@pytest.mark.parametrize("n_seqs, p_mask", [(100, 0.7), (10, 0.995)])
def test_compiled_fold_matches_numpy_reference(n_seqs, p_mask):
    """Many short turns with holes everywhere; or long turns, whose rows past 3, 8 and 32 tokens take the
    fold's fast path (their cell's sums only)."""
    rng = np.random.default_rng(3)
    n, cols = 4000, {}
    cols["step"] = np.repeat(np.arange(4), n // 4)
    cols["iteration"] = np.zeros(n, np.int16)
    cols["seq"] = np.repeat(np.arange(n_seqs), n // n_seqs)
    cols["pos"] = np.tile(np.arange(n // n_seqs), n_seqs).astype(np.int32)
    cols["mask"] = rng.random(n) < p_mask
    logp = {k: -rng.exponential(1.0, n).astype(np.float32) for k in ("logp", "logp_old", "logp_ref", "logp_sampler")}
    logp["logp_ref"][rng.random(n) < 0.05] -= 8  # some flagged tokens
    logp["logp_sampler"][::97] = np.nan  # a non-finite sampler value in the loss
    logp["logp_old"][::89] = 0.5  # an invalid probability
    nulls = {k: rng.random(n) < 0.1 for k in logp}  # nulls in every log-prob column
    if n_seqs == 100:  # recorded on half the rows
        turn = np.where(rng.random(n) < 0.5, -1, rng.integers(0, 20, n)).astype(np.int16)
    else:  # recorded in runs of 50 rows (-1: derived from the mask there)
        turn = np.repeat(rng.integers(-1, 20, n // 50), 50).astype(np.int16)
    arrays = {k: pa.array(v) for k, v in cols.items()}
    arrays.update({k: pa.array(v, mask=nulls[k]) for k, v in logp.items()})
    arrays["turn"] = pa.array(turn)
    batch = pa.RecordBatch.from_pydict(arrays)
    got = _fold(TU.TurnReducer(), [batch.slice(o, 333) for o in range(0, n, 333)])
    t = TU._columns(batch)
    want = _reference_grid(t)
    for k in TU.SUMS:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12, err_msg=k)
    assert got["tokens"][TU.MAX_TURN].sum() > 0  # recorded turns past 15 land in the overflow bucket


def test_fold_checks_the_recorders_order():
    """batch_partial(check=True) folds rows in the recorder's order (each sequence once, keys rising, pos rising
    inside one) and gives None otherwise, so that the reducer sorts them: the same figures either way."""
    step, it = np.repeat([0, 0, 1, 1, 2], 4), np.zeros(20, np.int16)
    seq, pos = np.repeat([3, 5, 0, 9, 1], 4), np.tile(np.arange(4), 5)
    rng = np.random.default_rng(4)
    th, red = (TU.E.TAU, TU.E.WEIGHT_LIMIT, TU.E.CLAMP), TU.TurnReducer()
    for st, sq, ps, want in ((step, seq, pos, True),
                             (step, np.repeat([3, 5, 0, 0, 1], 4), np.r_[0:4, 0:4, 0:8, 0:4], True),  # one of 8 rows
                             (step, np.repeat([3, 5, 9, 0, 1], 4), pos, False),  # seq falls within step 1
                             (step, seq, np.tile([0, 1, 1, 2], 5), False),  # pos repeats
                             (np.repeat([0, 1, 0, 1, 2], 4), seq, pos, False),  # a step comes back
                             (np.repeat([0, 3, 1, 1, 2], 4), seq, pos, False)):  # a step past the last row's
        lp = -rng.random(20).astype(np.float32)
        batch = pa.RecordBatch.from_pydict({"step": st, "iteration": it, "seq": sq, "pos": ps.astype(np.int32),
                                            "mask": rng.random(20) < 0.8, "logp": lp, "logp_old": lp - 0.01,
                                            "logp_ref": lp - 0.1, "logp_sampler": lp + 0.02})
        t = TU._columns(batch)
        got = TU.batch_partial(t, 0, th, 8, check=True)
        assert (got is not None) == want
        sorted_ = TU.batch_partial(TU._sorted(t), 0, th, 8)
        _same(TU.summary(_fold(red, [batch])), TU.summary(sorted_))
        if want:
            _same(TU.summary(got), TU.summary(sorted_))


def _reference(t, rank, keep):
    """Every figure of the partial in numpy (turn_index and kldiag.estimators): the grid, its max, the per-step
    sums, the sequence counts and the examples. t: rows grouped by sequence, pos rising, with validity masks."""
    new = TU.sequence_starts(t["step"], t["iteration"], t["seq"])
    turn, pit = TU.turn_index(new, t["mask"], t["turn"])
    s, m = t["logp"].astype(np.float64), t["logp_sampler"].astype(np.float64)
    o = np.where(t["valid_logp_old"], t["logp_old"].astype(np.float64), s)
    with np.errstate(all="ignore"):
        mm = np.where(t["valid_logp_sampler"], m - o, np.nan)
    a, ok = np.abs(mm), np.isfinite(mm)
    out = _reference_grid(t)
    cell = (TU.turn_bucket(turn) * TU.N_POS + TU.pos_bin(pit))
    gmax = np.full(TU.N_TURN * TU.N_POS, -np.inf)
    np.maximum.at(gmax, cell[(turn >= 0) & ok], a[(turn >= 0) & ok])
    out["mismatch_abs_max"] = gmax.reshape(TU.N_TURN, TU.N_POS)
    held = np.flatnonzero(out["tokens"].sum(1) > 0)
    out["turn_max"] = np.array([held[-1] if len(held) else -1])
    seq_id = np.cumsum(new) - 1
    in_turn = turn >= 0
    seq_max = np.full(seq_id[-1] + 1, -1)
    np.maximum.at(seq_max, seq_id[in_turn], turn[in_turn])
    single = (seq_max == 0)[seq_id] & in_turn & ok
    out.update(seq_single=(seq_max == 0).sum(), seq_multi=(seq_max > 0).sum(), single_n=single.sum(),
               single_abs=a[single].sum())
    steps = np.unique(t["step"][in_turn & ok])
    for k, sel in (("step", in_turn & ok), ("step_start", in_turn & ok & (pit == 0))):
        acc_a, acc_n = np.zeros((len(steps), TU.N_TURN)), np.zeros((len(steps), TU.N_TURN))
        at = (np.searchsorted(steps, t["step"][sel]), TU.turn_bucket(turn[sel]))
        np.add.at(acc_a, at, a[sel])
        np.add.at(acc_n, at, 1.0)
        out[f"{k}_abs"], out[f"{k}_n"] = acc_a, acc_n
    out["step"] = steps
    heads = np.flatnonzero((turn >= 1) & (pit == 0) & ok)
    span = np.cumsum((pit == 0) & in_turn)  # one id per turn
    ex = {"step": t["step"][heads], "rank": np.full(len(heads), rank), "seq": t["seq"][heads],
          "iteration": t["iteration"][heads], "turn": turn[heads], "start_abs": a[heads],
          "body_abs": np.array([np.mean(a[(span == span[h]) & (pit > 0) & ok]) if ((span == span[h]) & (pit > 0) & ok).any()
                                else np.nan for h in heads])}
    out.update({f"ex_{k}": v for k, v in TU.top_examples({k: np.asarray(v) for k, v in ex.items()}, keep).items()})
    return out


def _rows(rng, n_seqs, rank):
    """A rank's rows of two steps: random lengths, mask holes, a recorded turn with nulls, NaN, inf and
    positive log-probs, nulls in every log-prob column."""
    lens = rng.integers(1, 120, n_seqs)
    n = int(lens.sum())
    cols = {"step": np.repeat(np.arange(n_seqs) * 2 // n_seqs, lens), "iteration": np.zeros(n, np.int16),
            "seq": np.repeat(np.arange(n_seqs) * 2 + rank, lens),
            "pos": (np.arange(n) - np.repeat(np.cumsum(lens) - lens, lens)).astype(np.int32),
            "mask": rng.random(n) < 0.8}
    arrays = {k: pa.array(v) for k, v in cols.items()}
    for k in ("logp", "logp_old", "logp_ref", "logp_sampler"):
        v = -rng.exponential(1.0, n).astype(np.float32)
        v[rng.random(n) < 0.01] = rng.choice([np.nan, np.inf, -np.inf, 0.5], 1)[0]
        arrays[k] = pa.array(v, mask=(rng.random(n) < 0.1) if k != "logp" else None)
    arrays["turn"] = pa.array(rng.integers(0, 20, n).astype(np.int16), mask=rng.random(n) < 0.5)
    return pa.RecordBatch.from_pydict(arrays)


@pytest.mark.parametrize("shuffle", [False, True])
def test_reducer_equals_numpy_reference_over_ranks_batches_and_order(shuffle):
    """Two ranks' parts, each in the recorder's order and cut into batches that split sequences (the carry), or
    shuffled in one batch (the sort path): every figure of the merge equals the numpy reference's; counts, maxima and
    examples exactly."""
    rng = np.random.default_rng(5)
    red, parts, want = TU.TurnReducer(), [], []
    for rank in (0, 1):
        batch = _rows(rng, 60, rank)
        want.append(_reference(TU._columns(batch), rank, red.examples))
        if shuffle:  # every row but the last sequence's (carried to the next batch as they come: they stay last)
            last = int(np.flatnonzero(TU._columns(batch)["seq"] == TU._columns(batch)["seq"][-1])[0])
            batch = batch.take(pa.array(np.r_[rng.permutation(last), last:batch.num_rows]))
        cuts = [batch.slice(o, 97) for o in range(0, batch.num_rows, 97)]  # a shuffled part is sorted whole
        parts.append(_fold(red, [batch] if shuffle else cuts, rank))
    got, ref = red.merge(parts), TU.merge_partials(want, red.examples)
    assert got.keys() == ref.keys()
    for k in got:
        if k.startswith("ex_") or k in ("mismatch_abs_max", "step", "seq_single", "seq_multi", "turn_max") or \
                k in ("tokens", "n_mismatch", "n_drift", "n_weight", "flagged", "step_n", "step_start_n", "single_n"):
            np.testing.assert_array_equal(np.asarray(got[k]).reshape(-1), np.asarray(ref[k]).reshape(-1), err_msg=k)
        else:
            np.testing.assert_allclose(np.asarray(got[k]).reshape(-1), np.asarray(ref[k]).reshape(-1), rtol=1e-12,
                                       atol=1e-12, err_msg=k)
    assert got["ex_step"].size == red.examples and TU.scalar(got["seq_multi"]) > 0


@pytest.mark.parametrize("keep", [1, 3, 8])
def test_fold_keeps_only_spans_that_can_be_examples_and_the_examples_are_unchanged(keep):
    """The fold drops a turn's span once `keep` recorded ones have a larger first |m - o| (turn_kernel._compact):
    the examples equal the `keep` largest of every span (ties included: start |m - o| on a coarse grid)."""
    rng = np.random.default_rng(11)
    n, n_seqs = 60_000, 600
    cols = {"step": np.repeat(np.arange(6), n // 6), "iteration": np.zeros(n, np.int16),
            "seq": np.repeat(np.arange(n_seqs), n // n_seqs),
            "pos": np.tile(np.arange(n // n_seqs), n_seqs).astype(np.int32), "mask": rng.random(n) < 0.9}
    old = -np.round(rng.exponential(1.0, n) * 256) / 256  # on a grid of 1/256: old and old + k/8 exact in float32
    cols.update({k: v.astype(np.float32) for k, v in (("logp", old - 0.01), ("logp_old", old), ("logp_ref", old - 0.1),
                                                      ("logp_sampler", old + rng.integers(0, 40, n) / 8.0))})
    # ties in the first |m - o|
    t = TU._columns(pa.RecordBatch.from_pydict({k: pa.array(v) for k, v in cols.items()}))
    th = (E.TAU, E.WEIGHT_LIMIT, E.CLAMP)
    every = TU.batch_partial(t, 0, th, 10**6)  # no span dropped: all of them, in example order
    assert len(every["ex_step"]) > 40 * 8 * keep  # enough spans for several compactions
    want = TU.top_examples({k: every[f"ex_{k}"] for k in TU.EXAMPLE_COLS}, keep)
    got = TU.batch_partial(t, 0, th, keep)
    for k in TU.EXAMPLE_COLS:
        np.testing.assert_array_equal(got[f"ex_{k}"], want[k], err_msg=k)
    for k in TU.SUMS:
        np.testing.assert_array_equal(got[k], every[k], err_msg=k)


def test_turns_across_every_position_bin_edge_and_chunk_edge():
    """Turns of every length around the position bins' edges (3, 8, 32) and longer than a kernel chunk, some cut
    by the chunk's end, with nulls and NaN: the one-pass fold (turn_kernel._piece's runs of one cell) against
    the numpy reference; counts exactly, sums to float rounding (numpy adds in another order)."""
    from kldiag.analysis.kernels.turns import CHUNK

    rng = np.random.default_rng(8)
    lengths = [1, 2, 3, 4, 5, 7, 8, 9, 10, 31, 32, 33, 34, CHUNK + 40, 2, 3, 9, 33]
    mask, seq = [], []
    for q in range(3):  # three sequences, each every length once (the last cut from the first by an offset)
        for length in lengths[q:] + lengths[:q]:
            mask += [False] * int(rng.integers(1, 3)) + [True] * length
            seq += [q] * (len(mask) - len(seq))
    n = len(mask)
    cols = {"step": np.zeros(n, np.int64), "iteration": np.zeros(n, np.int16), "seq": np.array(seq),
            "pos": np.concatenate([np.arange(np.sum(np.array(seq) == q)) for q in range(3)]).astype(np.int32),
            "mask": np.array(mask)}
    logp = {k: -rng.exponential(1.0, n).astype(np.float32) for k in ("logp", "logp_old", "logp_ref", "logp_sampler")}
    logp["logp_sampler"][::41] = np.nan
    logp["logp_ref"][::13] -= 9  # flagged tokens
    arrays = {k: pa.array(v) for k, v in cols.items()}
    arrays.update({k: pa.array(v, mask=rng.random(n) < 0.1) for k, v in logp.items()})
    batch = pa.RecordBatch.from_pydict(arrays)
    t = TU._columns(batch)
    got = TU.batch_partial(t, 0, (E.TAU, E.WEIGHT_LIMIT, E.CLAMP), 8, check=True)
    assert got is not None and n > 2 * CHUNK
    want = _reference_grid({**t, "turn": None})
    assert want["tokens"][:, 3:].sum() > 0 and want["tokens"][:, 5].sum() > 0
    for k in TU.SUMS:
        if k in ("tokens", "n_mismatch", "n_drift", "n_weight", "flagged"):
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("absent", [("logp_ref",), ("logp_old",), ("logp_old", "logp_ref")])
def test_fold_without_a_columns_expm1_gives_the_same_partial(absent):
    """Where no row has logp_old (on-policy) or logp_ref, fold leaves out that column's expm1 (turn_kernel._tokens_of):
    the same sums, bit for bit, as the full computation, and as the reducer gives."""
    from kldiag.analysis.kernels.turns import fold

    rng = np.random.default_rng(9)
    n = 3000
    lp = {k: -rng.exponential(1.0, n).astype(np.float32) for k in ("logp", "logp_old", "logp_ref", "logp_sampler")}
    lp["logp"][::101] = np.nan  # a non-finite logp: its drift is not finite either way
    lp["logp"][::103] = 0.3
    arrays = {"step": pa.array(np.repeat(np.arange(3), n // 3)), "iteration": pa.array(np.zeros(n, np.int16)),
              "seq": pa.array(np.repeat(np.arange(30), n // 30)),
              "pos": pa.array(np.tile(np.arange(n // 30), 30).astype(np.int32)),
              "mask": pa.array(rng.random(n) < 0.9)}
    arrays.update({k: pa.nulls(n, pa.float32()) if k in absent else pa.array(v, mask=rng.random(n) < 0.1)
                   for k, v in lp.items()})
    t = TU._columns(pa.RecordBatch.from_pydict(arrays))
    th = (E.TAU, E.WEIGHT_LIMIT, E.CLAMP)

    def folded(has):
        grid, gmax = np.zeros((TU.N_TURN, TU.N_POS, len(TU.SUMS))), np.full((TU.N_TURN, TU.N_POS), -np.inf)
        steps, seqs = np.zeros((3, TU.N_TURN, 4)), np.zeros(4)
        params = np.array([np.log(E.TAU), E.WEIGHT_LIMIT, E.CLAMP, 0.0, -np.inf])
        spans, k = fold(t["step"], t["iteration"], t["seq"], t["pos"], t["step"], 0, t["mask"], np.zeros(0, np.int64),
                        t["logp"], t["logp_old"], t["valid_logp_old"], t["logp_ref"], t["valid_logp_ref"],
                        t["logp_sampler"], t["valid_logp_sampler"], np.array(has, np.int64), params, True, grid, gmax,
                        steps, seqs, 8)
        return grid, gmax, steps, seqs, spans[:k]

    full = folded([1, 1])
    skipped = folded(["logp_old" not in absent, "logp_ref" not in absent])
    for a, b in zip(full, skipped, strict=True):
        np.testing.assert_array_equal(a, b)
    got = TU.batch_partial(t, 0, th, 8)
    np.testing.assert_array_equal(got["drift_k3"], full[0][:, :, TU.SUMS.index("drift_k3")])
    assert got["n_drift"].sum() > 0 and (got["n_weight"].sum() > 0) == ("logp_ref" not in absent)
