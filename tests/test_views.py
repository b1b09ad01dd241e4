"""kldiag.views.pages and kldiag.views.estimators: the dashboard's package-side data."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from conftest import APP_EVIL_PIECE

from kldiag import estimators as E
from kldiag import format as F
from kldiag.analysis.types import ABS_EDGES, D_EDGES, AnalysisConfig, Histograms
from kldiag.errors import NotARunError
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import estimators as VE
from kldiag.views import hists as H
from kldiag.views import pages as V


def _cols(**kw):
    n = len(kw["logp"])
    base = {c: np.full(n, np.nan) for c in V.LOGP_COLUMNS}
    return {**base, **{k: np.asarray(v, dtype=np.float64) for k, v in kw.items()}}


# ---- runs ----------------------------------------------------------------------------


def test_check_run_dirs_accepts_runs_and_names_the_bad_path(app_runs):
    assert V.check_run_dirs([app_runs["k3"], app_runs["empty"]]) == [app_runs["k3"].resolve(),
                                                                     app_runs["empty"].resolve()]
    with pytest.raises(NotARunError, match="notarun"):
        V.check_run_dirs([app_runs["k3"], app_runs["notarun"]])


def test_part_keys_change_when_a_part_is_published(tmp_path):
    cfg = SynthConfig(steps=2, seqs_per_step=4)
    make_run(tmp_path, cfg)
    before = V.part_keys(tmp_path)
    make_run(tmp_path, cfg, steps=range(2, 3), manifest=False)
    after = V.part_keys(tmp_path)
    assert len(after) == len(before) + 1 and set(before) < set(after)


def test_columns_present(app_runs):
    assert all(V.columns_present(app_runs["k3"]).values())
    noref = V.columns_present(app_runs["noref"])
    assert noref["logp"] and not noref["logp_ref"] and not noref["logp_old"]
    assert not any(V.columns_present(app_runs["empty"]).values())


def test_run_label_disambiguates_same_names(tmp_path):
    a, b = tmp_path / "x" / "run", tmp_path / "y" / "run"
    assert V.run_label(a, [a, b]) == "x/run"
    assert V.run_label(tmp_path / "solo", [a, b]) == "solo"


# ---- per-token quantities ------------------------------------------------------------


def test_derive_matches_estimators_and_handles_absent_columns():
    s, r, o = np.array([-1.0, -9.0, -0.5]), np.array([-1.2, -0.1, -0.5]), np.array([-1.1, -8.0, -0.4])
    q = V.derive(_cols(logp=s, logp_ref=r, logp_old=o))
    np.testing.assert_allclose(q["weight_k3"], E.weight_k3(s, r))
    np.testing.assert_allclose(q["weight_k3_is"], E.weight_k3_is(s, r, o))
    np.testing.assert_allclose(q["k3_is"], E.k3_is(s, r, o))
    assert q["flagged"].tolist() == [False, True, False]
    assert not q["nonfinite"].any()  # null logp_sampler is absent, not non-finite
    on_policy = V.derive(_cols(logp=s, logp_ref=r))  # logp_old null: rho = 1
    np.testing.assert_allclose(on_policy["rho"], 1.0)
    np.testing.assert_allclose(on_policy["k3_is"], on_policy["k3"])
    np.testing.assert_allclose(on_policy["weight_k3_is"], on_policy["weight_k2"])
    no_ref = V.derive(_cols(logp=s))
    assert np.isnan(no_ref["k3"]).all() and not no_ref["flagged"].any()


def test_derive_reports_nonfinite_and_invalid():
    q = V.derive(_cols(logp=[np.nan, -1.0, 0.5], logp_ref=[-1.0, -np.inf, -1.0]))
    assert q["nonfinite"].tolist() == [True, True, False]
    assert q["invalid"].tolist() == [False, False, True]
    # With null masks, a NaN *value* of a present column is a finding, a null is not.
    cols = _cols(logp=[-1.0, -1.0], logp_ref=[np.nan, np.nan])
    absent = {c: np.array([False, True]) if c == "logp_ref" else np.isnan(v) for c, v in cols.items()}
    assert V.derive(cols, absent=absent)["nonfinite"].tolist() == [True, False]


# ---- one sequence --------------------------------------------------------------------


def test_read_sequence_returns_one_sorted_sequence_with_text(app_runs):
    run = F.open_run(app_runs["k3"])
    table = run.read(["step", "seq", "pos"]).to_pandas()
    step, seq = 9, int(table[table["step"] == 9]["seq"].iloc[0])
    df = V.read_sequence(app_runs["k3"], step, seq, vocab=run.vocab())
    want = table[(table["step"] == step) & (table["seq"] == seq)]
    assert len(df) == len(want) > 0
    assert df["pos"].tolist() == sorted(want["pos"].tolist())
    assert {"d", "rho", "weight_k3", "weight_k3_is", "piece", "flagged"} <= set(df.columns)
    assert df["piece"].iloc[0] == run.vocab()[int(df["token_id"].iloc[0])]
    assert V.read_sequence(app_runs["k3"], step, 10**9).empty


def test_decode_without_vocab_shows_ids():
    assert V.decode([3, None], None) == ["<3>", "<?>"]
    assert V.decode([1, 7], {1: "a"}) == ["a", "<7>"]


def test_sequence_html_escapes_untrusted_text():
    df = pd.DataFrame({"pos": [0, 1], "token_id": [0, 1], "piece": [APP_EVIL_PIECE, 'say "hi" & <b>'],
                       "logp": [-9.0, -0.1], "logp_ref": [-0.1, -0.1]})
    for name, values in V.derive(_cols(logp=df["logp"], logp_ref=df["logp_ref"])).items():
        df[name] = values
    out = V.sequence_html(df, "weight_k3_abs")
    assert "&lt;img src=x onerror=alert(1)&gt;" in out
    assert "<img" not in out and "<b>" not in out
    assert "&quot;hi&quot; &amp; &lt;b&gt;" in out
    assert out.count('class="kldiag-tok"') == 2
    assert "flags: theta_ll_ref, weight_blowup, clamp_saturated" in out  # hover text of the bad token
    with pytest.raises(ValueError, match="unknown quantity"):
        V.sequence_html(df, "nope")


# ---- analysis tables -----------------------------------------------------------------


def _flags_frame():
    rows = []
    for i, (step, w) in enumerate([(1, -50.0), (2, -5.0), (3, -500.0), (4, np.nan)]):
        rows.append({"step": step, "seq": i, "pos": 0, "weight_k3": w, "theta_ll_ref": step != 2,
                     "weight_blowup": abs(w) > 10, "clamp_saturated": False, "nonfinite": step == 4,
                     "invalid": False})
    return pd.DataFrame(rows)


def test_filter_flags_by_step_flag_threshold_and_sort():
    flags = _flags_frame()
    assert V.filter_flags(flags)["step"].tolist() == [4, 3, 1, 2]  # the non-finite row first, then |weight| descending
    assert V.filter_flags(flags, descending=False)["step"].tolist() == [4, 2, 1, 3]  # first in either order
    assert V.filter_flags(flags, (2, 3))["step"].tolist() == [3, 2]
    assert V.filter_flags(flags, kinds=["nonfinite"])["step"].tolist() == [4]
    assert V.filter_flags(flags, min_abs_weight=40)["step"].tolist() == [4, 3, 1]  # non-finite kept
    assert V.filter_flags(flags, sort_by="step", descending=False)["step"].tolist() == [4, 1, 2, 3]
    with pytest.raises(ValueError, match="unknown flags"):
        V.filter_flags(flags, kinds=["bogus"])


def test_headline_onsets_and_compare():
    steps = pd.DataFrame({"step": [0, 1], "tokens": [100, 300], "k3_mean": [0.1, 5.0], "k3_is_mean": [0.1, 0.2],
                          "weight_k3_abs_max": [2.0, 900.0], "weight_k3_is_abs_max": [1.0, 3.0],
                          "flagged_frac": [0.0, 0.1]})
    h = V.headline(steps)
    assert h["steps"] == 2 and h["tokens"] == 400 and h["k3_mean"] == 5.0
    assert h["weight_k3_abs_max"] == 900.0 and h["flagged_frac"] == pytest.approx(30 / 400)
    assert V.headline(steps.iloc[:0]) == {"steps": 0, "tokens": 0}
    alerts = pd.DataFrame({"step": [7, 5, 9, 5, 6], "kind": ["jump", "jump", "nonfinite", "blame", "blame"],
                           "metric": ["weight_k3_abs_max"] * 2 + ["logp", "blame_share", "blame_share"]})
    assert V.onset_steps(alerts) == [(5, "jump, blame"), (9, "nonfinite")]
    assert V.onset_steps(alerts.iloc[:0]) == []
    long = V.compare_steps({"a": steps, "b": steps.assign(k3_mean=[1.0, 2.0])}, "k3_mean")
    assert long.groupby("run")["value"].sum().to_dict() == {"a": 5.1, "b": 3.0}
    assert V.compare_steps({"a": steps}, "missing").empty
    assert "k3_mean" in V.numeric_metrics([steps, steps]) and "step" not in V.numeric_metrics([steps])


# ---- histograms ----------------------------------------------------------------------


def _hist(name, edges, samples_per_step):
    counts = np.stack([np.bincount(np.where(v <= 0, 0, np.searchsorted(edges, v, side="right"))
                                   if edges[0] > 0 else np.searchsorted(edges, v, side="right"),
                                   minlength=len(edges) + 1) for v in samples_per_step])
    return Histograms(np.arange(len(samples_per_step)), {name: edges}, {name: counts})


def test_hist_quantiles_recover_sample_quantiles():
    rng = np.random.default_rng(0)
    d = [rng.normal(m, 2.0, 20000) for m in (0.0, 5.0)]
    h = _hist("d", D_EDGES, d)
    q = H.hist_quantiles(h.counts["d"], D_EDGES, [0.1, 0.5, 0.9])
    want = np.stack([np.quantile(x, [0.1, 0.5, 0.9]) for x in d])
    np.testing.assert_allclose(q, want, atol=0.5)  # D_EDGES bins are 0.5 wide
    w = [np.exp(rng.normal(0, 3, 20000))]
    hw = _hist("w", ABS_EDGES, w)
    qw = H.hist_quantiles(hw.counts["w"], ABS_EDGES, [0.5, 0.99])[0]
    np.testing.assert_allclose(np.log10(qw), np.log10(np.quantile(w[0], [0.5, 0.99])), atol=0.25)
    assert np.isnan(H.hist_quantiles(np.zeros((1, len(D_EDGES) + 1)), D_EDGES, [0.5])).all()


def test_heatmap_fractions_and_coarsening():
    rng = np.random.default_rng(1)
    h = _hist("d", D_EDGES, [rng.normal(0, 1, 500) for _ in range(10)])
    hm = H.heatmap(h, "d")
    np.testing.assert_allclose(hm["z"].sum(axis=0), 1.0)
    assert len(hm["labels"]) == hm["z"].shape[0] < len(D_EDGES) + 1  # empty bins cut
    steps, counts = H.coarsen_steps(h.steps, h.counts["d"], max_rows=3)
    assert len(steps) == 3 and counts.sum() == h.counts["d"].sum() and steps[0] == 0
    bands = H.percentile_bands(h, "d")
    assert list(bands.columns[:3]) == ["step", "p1", "p10"] and len(bands) == 10
    assert (bands["p1"] <= bands["p50"]).all() and (bands["p50"] <= bands["p99"]).all()


# ---- estimator comparison ------------------------------------------------------------


def test_partials_merge_exactly_and_samples_are_bounded(tmp_path):
    make_run(tmp_path, SynthConfig(steps=6, seqs_per_step=16, blowup_step=3, blowup_frac=0.05, rows_per_file=800))
    parts = F.list_parts(tmp_path)
    assert len(parts) > 2
    merged = VE.merge_partials([VE.part_partial(p, sample_size=50) for p in parts], sample_size=100)
    whole = VE._batch_partial(F.open_run(tmp_path).read(VE.READ_COLUMNS), AnalysisConfig(), 10**9, 0)
    assert merged.tokens == whole.tokens and merged.flagged == whole.flagged > 0
    for name in VE.COMPARED:
        assert merged.value_sum[name] == pytest.approx(whole.value_sum[name], rel=1e-9)
        assert merged.weight_abs_max[name] == whole.weight_abs_max[name]
        assert (merged.weight_hist[name] == whole.weight_hist[name]).all()
    kinds = merged.sample["kind"].value_counts()
    assert kinds[VE.SAMPLED] == 100  # the random part stays bounded
    # ... and the tokens that matter are always in: every flagged one, the largest |k3 weight| first
    assert kinds["flagged"] == merged.flagged <= VE.KEEP_FLAGGED
    assert merged.sample["weight_k3"].abs().max() == merged.weight_abs_max["k3"]
    assert (merged.sample.loc[merged.sample["kind"] == "flagged", "flagged"]).all()


def test_estimator_table_shows_the_k3_blowup_and_the_clamp(app_runs):
    p = VE.merge_partials([VE.part_partial(x) for x in F.list_parts(app_runs["k3"])])
    t = VE.estimator_table(p).set_index("estimator")
    assert t.loc["k3", "|weight| max"] > 1000 > t.loc["k3_is", "|weight| max"]
    assert t.loc["k1", "|weight| p99"] == 1.0
    # 2% of tokens carry nearly all of K3's gradient; k3_is's weight there is only logarithmic.
    assert t.loc["k3", "flagged share of |weight|"] > 0.99 > t.loc["k3_is", "flagged share of |weight|"]
    assert t.loc["k3_clamped", "|weight| max"] < 10
    cs = VE.clamp_summary(p)
    assert 0 < cs["clamp_saturated_frac"] < 0.1 and cs["k3_weight_lost_share"] > 0.5
    empty = VE.merge_partials([VE.part_partial(x) for x in F.list_parts(app_runs["noref"])])
    assert empty.tokens == 0 and VE.estimator_table(empty)["|weight| mean"].eq(0).all()


def test_corrupt_part_is_skipped_by_name(tmp_path):
    make_run(tmp_path, SynthConfig(steps=2, seqs_per_step=4))
    bad = F.rank_dir(tmp_path, 0) / F.part_name(5, 5, 9)
    bad.write_bytes(b"not parquet")
    part = next(p for p in F.list_parts(tmp_path) if p.path == str(bad))
    with pytest.warns(UserWarning, match="skipping"):
        p = VE.part_partial(part)
    assert p.skipped == [str(bad)] and p.tokens == 0
    with pytest.raises(Exception, match="unreadable"):
        VE.part_partial(part, AnalysisConfig(strict=True))


def test_batch_partial_accepts_tables_with_nulls():
    t = pa.table({"step": [0, 0], "seq": [1, 1], "advantage": pa.array([-1.0, -1.0], pa.float32()),
                  "mask": [True, False], "logp": pa.array([-1.0, -2.0], pa.float32()),
                  "logp_old": pa.nulls(2, pa.float32()), "logp_ref": pa.array([-0.5, None], pa.float32()),
                  "logp_sampler": pa.nulls(2, pa.float32())})
    p = VE._batch_partial(t, AnalysisConfig(), 10, 0)
    assert p.tokens == 1 and p.rows == 2


def test_sequence_and_columns_skip_a_corrupt_part_by_name(tmp_path):
    make_run(tmp_path, SynthConfig(steps=2, seqs_per_step=4, seq_len=(4, 6), seed=5))
    good = V.read_sequence(tmp_path, 0, int(F.open_run(tmp_path).read(["seq"]).column("seq")[0].as_py()))
    bad = F.rank_dir(tmp_path, 0) / F.part_name(0, 9, 99)
    bad.write_bytes(b"PAR1 not really parquet")
    with pytest.warns(UserWarning, match=bad.name):
        again = V.read_sequence(tmp_path, 0, int(good["seq"].iloc[0]))
    assert len(again) == len(good) > 0
    with pytest.warns(UserWarning, match=bad.name):
        present = V.columns_present(tmp_path)
    assert present["logp"] and present["logp_ref"]  # judged on the newest part that reads
