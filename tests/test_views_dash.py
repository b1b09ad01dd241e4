"""Dashboard helpers: W&B/TensorBoard EMA smoothing, log ticks, onset lanes, downloads,
deep links, GRPO group views."""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pyarrow.parquet as pq

from kldiag.views import dash as VD
from kldiag.views import groups as VG


def _tensorboard_ema(y, w):
    """TensorBoard's scalar smoothing (vz_line_chart2/line-chart.ts): debiased EMA."""
    last, out, n = 0.0, [], 0
    for v in y:
        n += 1
        last = last * w + (1 - w) * v
        out.append(last / (1 - w ** n))
    return np.array(out)


def test_ema_equals_tensorboard_on_even_steps_and_starts_at_first_point():
    rng = np.random.default_rng(0)
    y = rng.normal(5.0, 1.0, 200)
    for w in (0.3, 0.6, 0.95):
        np.testing.assert_allclose(VD.ema(y, np.arange(0, 400, 2), w), _tensorboard_ema(y, w), rtol=1e-12)
    assert VD.ema(y, weight=0.9)[0] == y[0]  # debiased: no pull towards 0
    np.testing.assert_array_equal(VD.ema(y, weight=0.0), y)


def test_ema_is_time_weighted_and_skips_gaps():
    x = np.array([0, 1, 2, 12])
    y = np.array([0.0, 0.0, 0.0, 1.0])
    s = VD.ema(y, x, 0.5)
    assert s[3] > 0.99  # ten missing steps decay the old points like ten steps
    z = VD.ema(np.array([1.0, np.nan, np.inf, 1.0]), weight=0.8)
    assert np.isnan(z[1]) and np.isnan(z[2]) and z[3] == 1.0


def test_onset_lanes():
    lanes = VD.onset_lanes([(10, "weight_blowup"), (11, "blame_share"), (60, "nonfinite")], 0, 100)
    assert lanes == [0, 1, 0]


def test_table_bytes_round_trip():
    df = pd.DataFrame({"step": [1, 2], "k3_mean": [0.5, np.nan], "kind": ["a", "b"]})
    assert VD.table_bytes(df, "csv").decode().splitlines()[0] == "step,k3_mean,kind"
    back = pq.read_table(io.BytesIO(VD.table_bytes(df, "parquet"))).to_pandas()
    pd.testing.assert_frame_equal(back, df)


def test_deep_link_params_parse_and_url():
    p = VD.link_params("demo_k3", step=8, seq=130, pos=None)
    assert p == {"run": "demo_k3", "step": "8", "seq": "130"}
    assert VD.parse_link({**p, "pos": "x", "other": "1"}) == {"run": "demo_k3", "step": 8, "seq": 130}
    url = VD.link_url("http://127.0.0.1:8501/sequence?old=1", p)
    assert url == "http://127.0.0.1:8501/sequence?run=demo_k3&step=8&seq=130"


def _seqs() -> pd.DataFrame:
    return pd.DataFrame({"step": [0, 0, 0, 0, 0, 0, 1], "seq": [0, 1, 2, 3, 4, 5, 6],
                         "group": [0, 0, 0, 1, 1, 2, 3], "rank": 0, "length": 5,
                         "advantage": [1.0, -0.5, -0.5, 0.0, 0.0, 0.0, 0.3],
                         "k3_mean": 0.1, "k3_is_mean": 0.1, "weight_k3_abs_max": [1, 2, 30, 4, 5, 6, 7],
                         "flagged_count": 0})


def test_group_spread_marks_zero_spread_groups():
    g = VG.group_spread(_seqs())
    zero = set(g.loc[g["zero_spread"], "group"])
    assert zero == {1}  # group 2 has one completion: nothing to judge


def test_siblings_put_self_first():
    s = VG.siblings(_seqs(), 0, 2)
    assert s["seq"].tolist() == [2, 0, 1] and s["self"].tolist() == [True, False, False]
    assert not s["zero_spread"].any()
    assert VG.siblings(_seqs(), 0, 4)["zero_spread"].all()
    assert VG.siblings(_seqs(), 5, 2).empty


def test_read_group_reads_siblings_in_one_pass(tmp_path):
    from kldiag.tools.synth import SynthConfig, make_run
    from kldiag.views import pages as V

    make_run(tmp_path / "run", SynthConfig(steps=2, seqs_per_step=8, seq_len=(4, 9), vocab_size=16, seed=4))
    got = VG.read_group(tmp_path / "run", 1, [8, 9, 10])
    assert sorted(got) == [8, 9, 10]
    one = V.read_sequence(tmp_path / "run", 1, 9)
    pd.testing.assert_frame_equal(got[9][one.columns], one)
    worst = VG.worst_tokens(got[9], 2)
    assert len(worst) == 2 and worst["weight_k3"].abs().iloc[0] == one["weight_k3_abs"].max()
    assert VG.text_of(got[9], 5).endswith("…")


# ---- the chart rules every chart shares (kldiag.views.charts) ----------------------------------


def test_with_breaks_breaks_lines_over_missing_steps_only():
    import pandas as pd

    df = pd.DataFrame({"step": [0, 1, 2, 10, 11, 12], "v": [1.0, 2, 3, 4, 5, 6]})
    out = VD.with_breaks(df)
    assert out["step"].tolist() == [0, 1, 2, 6, 10, 11, 12] and np.isnan(out["v"].iloc[3])
    every5 = pd.DataFrame({"step": [0, 5, 10, 15], "v": [1.0, 2, 3, 4]})  # a recorder's every_n_steps: no gap
    assert len(VD.with_breaks(every5)) == 4 and VD.step_stride(every5["step"]) == 5


def test_log_axis_labels_two_decades_and_clips_a_far_lower_tail():
    import plotly.graph_objects as go

    from kldiag.views import charts as VC

    fig = go.Figure()
    assert VC.log_axis(fig, np.array([0.02, 0.05])) == ""  # less than a decade: still two labelled decades
    lo, hi = fig.layout.yaxis.range
    assert lo <= -2 and hi >= -1 and fig.layout.yaxis.dtick == 1 and fig.layout.yaxis.tick0 == -2
    fig = go.Figure()
    values = np.concatenate([np.geomspace(0.1, 1e3, 500), [0.0, 1e-8]])
    note = VC.log_axis(fig, values)
    assert fig.layout.yaxis.range[0] > -8 and note == "2 points below 1e-3 not drawn"
    fig = go.Figure()
    VC.log_axis(fig, np.geomspace(1e-12, 1e12, 50))
    assert fig.layout.yaxis.dtick == 6  # at most about four labels (five here), all at decades


def test_titles_fit_and_step_charts_title_every_axis():
    import pandas as pd

    from kldiag.views import charts as VC

    title, sub = VC.fit_title("Mismatch against the sampler's token probability (the low-probability-token pitfall)")
    assert len(title) <= VC.TITLE_CHARS and sub.endswith("pitfall)")
    steps = pd.DataFrame({"step": np.arange(6), **{c: np.linspace(0.1, 1, 6) for s in VC.STEP_TRENDS
                                                    for c in s.columns}})
    for fig in VC.step_trends(steps, [(2, "k3_weight_blowup")]):
        assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text
        assert len(fig.layout.title.text) <= VC.TITLE_CHARS
        spec = next(s for s in VC.STEP_TRENDS if s.title == fig.layout.title.text)
        assert [t.name for t in fig.data] == [VC.name_of(c) for c in spec.columns]
        assert all(t.name not in steps.columns for t in fig.data)  # series named in words
        assert fig.layout.legend.yref == "container" and fig.layout.legend.y == 0  # under the x title


def test_numbers_flagged_total_faults_first_and_own_loss_weight():
    import pandas as pd

    from kldiag.views import numbers as VN

    steps = pd.DataFrame({"step": [0, 1], "tokens": [100, 300], "flagged_frac": [0.01, 0.1]})
    assert VN.flagged_total(steps) == (31, 400)
    seqs = pd.DataFrame({"step": [0, 0, 1], "seq": [0, 1, 2], "weight_k3_abs_max": [5.0, 900.0, np.nan],
                         "nonfinite_count": [0, 0, 1]})
    assert VN.fault_first(seqs)["seq"].tolist() == [2, 1, 0]
    assert VN.loss_weight_column({"estimator": "k3_is"}) == ("weight_k3_is_abs_max", "k3_is")
    assert VN.loss_weight_column({}, "p99") == ("weight_k3_abs_p99", "k3")
    runs = {"a": pd.DataFrame({"step": [0], "weight_k3_abs_max": [9.0]}),
            "b": pd.DataFrame({"step": [0], "weight_k3_is_abs_max": [2.0]})}
    long = VN.compare_own(runs, {"a": "weight_k3_abs_max", "b": "weight_k3_is_abs_max"})
    assert long[["run", "value", "column"]].values.tolist() == [["a", 9.0, "weight_k3_abs_max"],
                                                                ["b", 2.0, "weight_k3_is_abs_max"]]
