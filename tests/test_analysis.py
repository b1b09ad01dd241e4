"""kldiag.analyze end to end on small synthetic runs, against a plain numpy reference."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pytest

import kldiag
from kldiag import estimators as E
from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.types import ABS_EDGES, ALERT_COLUMNS, FLAG_COLUMNS, SEQUENCE_COLUMNS, STEP_COLUMNS
from kldiag.cli import main
from kldiag.errors import CorruptPartError, EmptyRunError, NotARunError, UnsupportedFormatVersionError
from kldiag.format import open_run, write_manifest
from kldiag.tools.synth import SynthConfig, make_manifest, make_run

SMALL = dict(steps=12, seqs_per_step=12, seq_len=(8, 40), rows_per_file=1500, micro_batches=3)
NOCACHE = AnalysisConfig(use_cache=False)


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    """Blow-ups from step 6, a NaN logp_ref at step 4, a positive logp at step 9, two ranks."""
    path = tmp_path_factory.mktemp("runs") / "bad"
    make_run(path, SynthConfig(**SMALL, ranks=2, blowup_step=6, blowup_frac=0.03,
                               nonfinite=((4, "logp_ref"),), positive=(9,)))
    return path


def reference_steps(run_dir, tau=20.0, limit=10.0, clamp=10.0) -> dict[int, dict]:
    """Per-step metrics computed directly from all rows with kldiag.estimators."""
    t = open_run(run_dir).read().to_pydict()
    cols = {k: np.array([np.nan if v is None else v for v in t[k]], np.float64) for k in
            ("logp", "logp_old", "logp_ref", "logp_sampler")}
    step, mask = np.array(t["step"]), np.array(t["mask"])
    s, r = cols["logp"], cols["logp_ref"]
    o = np.where(np.isnan(cols["logp_old"]) & np.array([v is None for v in t["logp_old"]]), s, cols["logp_old"])
    out = {}
    with np.errstate(all="ignore"):
        vals = {"k1": E.k1(s, r), "k2": E.k2(s, r), "k3": E.k3(s, r), "k3_is": E.k3_is(s, r, o),
                "w": np.abs(E.weight_k3(s, r)), "w_is": np.abs(E.weight_k3_is(s, r, o)), "rho": E.rho(s, o)}
        fl = E.flags(s, r, o, None, tau, limit, clamp)
        nonfinite = np.zeros(len(s), bool)
        for k, v in cols.items():
            nonfinite |= ~np.isfinite(v) & np.array([x is not None for x in t[k]])
        invalid = np.logical_or.reduce([np.nan_to_num(v, nan=-1) > 0 for v in cols.values()])
    for st in np.unique(step):
        sel, m = step == st, (step == st) & mask
        row = {"tokens": int(m.sum()), "nonfinite_count": int((sel & nonfinite).sum()),
               "invalid_count": int((sel & invalid).sum())}
        for k in ("k1", "k2", "k3", "k3_is"):
            v = vals[k][m]
            row[f"{k}_mean"] = v[np.isfinite(v)].mean()
        w = vals["w"][m]
        row["weight_k3_abs_max"] = np.nanmax(w)
        row["weight_k3_is_abs_max"] = np.nanmax(vals["w_is"][m])
        row["rho_mean"] = vals["rho"][m][np.isfinite(vals["rho"][m])].mean()
        row["theta_ll_ref_count"] = int((fl.theta_ll_ref & m).sum())
        row["weight_blowup_count"] = int((fl.weight_blowup & m).sum())
        row["clamp_saturated_count"] = int((fl.clamp_saturated & m).sum())
        flagged = (fl.theta_ll_ref | fl.weight_blowup | fl.clamp_saturated | nonfinite | invalid) & m
        fw = np.isfinite(w)
        row["blame_share"] = w[flagged[m] & fw].sum() / w[fw].sum()
        row["h_w"] = np.bincount(np.searchsorted(ABS_EDGES, w[~np.isnan(w)], side="right"),
                                 minlength=len(ABS_EDGES) + 1)
        out[int(st)] = row
    return out


def same(a: pa.Table, b: pa.Table) -> bool:
    """Exact equality, NaN equal to NaN (a NaN log-prob is data here, not a missing value)."""
    return a.schema.equals(b.schema) and a.to_pandas().equals(b.to_pandas())


def test_steps_equal_reference(bad_run):
    a = analyze(bad_run, NOCACHE)
    assert list(a.steps.column_names[: len(STEP_COLUMNS)]) == list(STEP_COLUMNS)
    ref = reference_steps(bad_run)
    got = {r["step"]: r for r in a.steps.to_pylist()}
    assert sorted(got) == sorted(ref)
    for st, want in ref.items():
        for k, v in want.items():
            if k == "h_w":
                i = list(a.histograms.steps).index(st)
                np.testing.assert_array_equal(a.histograms.counts["weight_k3_abs"][i], v)
            elif isinstance(v, int):
                assert got[st][k] == v, (st, k)
            else:
                assert got[st][k] == pytest.approx(v, rel=1e-9), (st, k)
    assert not any(np.isnan(x) for x in a.steps.column("k3_mean").to_pylist())


def test_flags_alerts_and_sequences(bad_run):
    a = analyze(bad_run, AnalysisConfig(use_cache=False, top_k=50))
    assert a.flags.column_names == list(FLAG_COLUMNS)
    assert a.alerts.column_names == list(ALERT_COLUMNS)
    assert a.sequences.column_names[: len(SEQUENCE_COLUMNS)] == list(SEQUENCE_COLUMNS)
    flags = a.flags.to_pylist()
    assert len(flags) <= 2 * 50
    bad = [f for f in flags if f["nonfinite"]]
    assert [(f["step"], f["logp_ref"] is None or np.isnan(f["logp_ref"])) for f in bad] == [(4, True)]
    assert any(f["invalid"] and f["step"] == 9 for f in flags)
    worst = [f for f in flags if not (f["nonfinite"] or f["invalid"])]
    assert worst[0]["step"] >= 6 and worst[0]["weight_blowup"] and worst[0]["piece"].startswith("tok")
    kinds = {(r["kind"], r["step"]) for r in a.alerts.to_pylist()}
    assert ("weight_blowup_onset", 6) in kinds and ("nonfinite", 4) in kinds and ("invalid", 9) in kinds
    assert all(r["step"] >= 6 for r in a.alerts.to_pylist() if r["kind"] == "blame_share")
    seqs = a.sequences.to_pandas()
    blowups = a.steps.column("weight_blowup_count").to_numpy().sum()
    assert len(seqs) == 12 * 12 * 2 and seqs["flagged_count"].sum() >= blowups
    per_step = seqs.groupby("step")["length"].sum().to_numpy()
    np.testing.assert_array_equal(per_step, a.steps.column("rows").to_numpy())


@pytest.mark.parametrize("top_k,batch_size", [(7, 1 << 20), (60, 500)])
def test_top_flags_are_the_exact_top_k(bad_run, top_k, batch_size):
    """Rows are preselected by a histogram threshold and an earlier batch's k-th weight: none may be lost."""
    a = analyze(bad_run, AnalysisConfig(use_cache=False, top_k=top_k, batch_size=batch_size))
    t = open_run(bad_run).read().to_pandas()
    t = t[t["mask"]]
    with np.errstate(all="ignore"):
        w = np.abs(np.expm1(t["logp_ref"].to_numpy(np.float64) - t["logp"].to_numpy(np.float64)))
    t = t.assign(w=w)[np.isfinite(w)].sort_values(["w", "step", "rank", "seq", "pos"],
                                                  ascending=[False, True, True, True, True])
    flags = a.flags.to_pandas()
    flags = flags[~(flags["nonfinite"] | flags["invalid"])].assign(w=lambda f: f["weight_k3"].abs())
    flags = flags.sort_values(["w", "step", "rank", "seq", "pos"], ascending=[False, True, True, True, True])
    want = list(t[["step", "rank", "seq", "pos"]].head(top_k).itertuples(index=False, name=None))
    assert list(flags[["step", "rank", "seq", "pos"]].itertuples(index=False, name=None)) == want
    np.testing.assert_allclose(flags["w"], t["w"].head(top_k), rtol=1e-12)


def test_per_rank_rows_add_up(bad_run):
    a = analyze(bad_run, AnalysisConfig(use_cache=False, per_rank=True))
    by_rank = a.steps_by_rank.to_pandas()
    assert set(by_rank["rank"]) == {0, 1}
    tokens = by_rank.groupby("step")["tokens"].sum().to_numpy()
    np.testing.assert_array_equal(tokens, a.steps.column("tokens").to_numpy())


def test_incremental_equals_full_recompute(tmp_path):
    cfg = SynthConfig(**SMALL, blowup_step=8)
    make_run(tmp_path / "run", cfg, steps=range(0, 8))
    first = analyze(tmp_path / "run")
    assert first.files_new == first.files
    make_run(tmp_path / "run", cfg, steps=range(8, 12), manifest=False)
    again = analyze(tmp_path / "run")
    assert again.files > first.files and again.files_new == again.files - first.files
    full = analyze(tmp_path / "run", NOCACHE)
    for name in ("steps", "sequences", "flags", "alerts"):
        assert same(getattr(again, name), getattr(full, name)), name
    for k, v in full.histograms.counts.items():
        np.testing.assert_array_equal(again.histograms.counts[k], v)


def test_threads_give_identical_results(bad_run):
    one = analyze(bad_run, AnalysisConfig(use_cache=False, threads=1))  # a reader thread decodes ahead
    three = analyze(bad_run, AnalysisConfig(use_cache=False, threads=3))  # three threads take whole parts
    for name in ("steps", "sequences", "flags", "alerts"):
        assert same(getattr(one, name), getattr(three, name)), name


def test_null_columns_give_null_metrics(tmp_path):
    make_run(tmp_path / "noref", SynthConfig(**SMALL, reference=False, on_policy=True, sampler=False))
    a = analyze(tmp_path / "noref", NOCACHE)
    row = a.steps.to_pylist()[0]
    assert row["k3_mean"] is None and row["weight_k3_abs_max"] is None and row["mismatch_kl"] is None
    assert row["rho_mean"] == 1.0 and row["rho_max"] == 1.0 and row["tokens"] > 0
    make_run(tmp_path / "onpol", SynthConfig(**SMALL, on_policy=True, sampler=False))
    row = analyze(tmp_path / "onpol", NOCACHE).steps.to_pylist()[0]
    assert row["k3_is_mean"] == pytest.approx(row["k3_mean"], rel=1e-12) and row["mismatch_kl"] is None


def test_trainer_kl_follows_trl_formula(tmp_path):
    """Per micro-batch sum(kl * mask) / clamp(sum(mask), 1) pooled over ranks, then mean over micro-batches."""
    for estimator in ("k3", "k3_is"):
        run = tmp_path / estimator
        make_run(run, SynthConfig(**SMALL, ranks=2, estimator=estimator))
        got = analyze(run, AnalysisConfig(use_cache=False, trainer_compatible=True)).trainer_kl.to_pylist()
        t = open_run(run).read().to_pandas()
        s, r, o = (t[c].to_numpy(np.float64) for c in ("logp", "logp_ref", "logp_old"))
        kl = np.exp(r - s) - (r - s) - 1
        if estimator == "k3_is":
            kl = kl * np.exp(s - o)
        t["num"], t["den"] = kl * t["mask"], t["mask"].astype(float)
        micro = t.groupby(["step", "micro", "iteration"])[["num", "den"]].sum()
        micro["kl"] = micro["num"] / micro["den"].clip(lower=1)
        want = micro.groupby("step")["kl"].mean()
        assert [g["step"] for g in got] == list(want.index)
        np.testing.assert_allclose([g["kl"] for g in got], want.to_numpy(), rtol=1e-9)


def test_bad_inputs(tmp_path, bad_run):
    run = tmp_path / "run"
    shutil.copytree(bad_run, run)
    (run / "tokens" / "rank-0" / "notes.txt").write_text("foreign")
    (run / "tokens" / "rank-0" / "part-000000099-000000099-000099.parquet").write_bytes(b"PAR1 truncated")
    with pytest.warns(UserWarning, match="part-000000099"):
        a = analyze(run, NOCACHE)
    assert len(a.skipped) == 1 and a.steps.num_rows == 12
    with pytest.raises(CorruptPartError, match="part-000000099"):
        analyze(run, AnalysisConfig(use_cache=False, strict=True))
    empty = tmp_path / "empty"
    write_manifest(empty, make_manifest(SynthConfig()))
    with pytest.raises(EmptyRunError, match="no published part"):
        analyze(empty)
    with pytest.raises(NotARunError):
        analyze(tmp_path / "nothing")
    future = tmp_path / "future"
    shutil.copytree(bad_run, future)
    d = json.loads((future / "run.json").read_text())
    (future / "run.json").write_text(json.dumps({**d, "format_version": 99}))
    with pytest.raises(UnsupportedFormatVersionError, match="version 99"):
        analyze(future)
    with pytest.raises(ValueError, match="tau"):
        analyze(bad_run, AnalysisConfig(tau=0.5))


def test_cli(bad_run, tmp_path, capsys):
    assert main(["analyze", str(bad_run), "--no-cache", "--top-k", "20", "--out", str(tmp_path / "o")]) == 0
    text = capsys.readouterr().out
    assert "weight_k3_abs_max" in text and "step 6" in text and "alerts" in text
    for name in ("steps", "sequences", "flags", "alerts"):
        assert (tmp_path / "o" / f"{name}.parquet").is_file() and (tmp_path / "o" / f"{name}.csv").is_file()
    assert main(["analyze", str(bad_run), "--json", "--trainer-compatible", "--tau", "50"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert len(summary["steps"]) == 12 and summary["trainer_kl"] and summary["alerts"]
    assert main(["analyze", str(tmp_path / "missing")]) == 2


def test_lazy_top_level_export(bad_run):
    assert kldiag.analyze is analyze and kldiag.AnalysisConfig is AnalysisConfig
    assert isinstance(kldiag.analyze(bad_run, NOCACHE).steps, pa.Table)


def test_trainer_kl_logging_windows_match_trl_log(tmp_path):
    """logging_steps = 4: TRL logs at steps 4, 8, ... the mean of every micro-batch kl since its last log."""
    run = tmp_path / "w"
    make_run(run, SynthConfig(**SMALL, extra_config={"logging_steps": 4}))
    got = analyze(run, AnalysisConfig(use_cache=False, trainer_compatible=True)).trainer_kl.to_pandas()
    t = open_run(run).read().to_pandas()
    s, r = (t[c].to_numpy(np.float64) for c in ("logp", "logp_ref"))
    t["num"], t["den"] = (np.exp(r - s) - (r - s) - 1) * t["mask"], t["mask"].astype(float)
    micro = t.groupby(["step", "micro", "iteration"])[["num", "den"]].sum().reset_index()
    micro["kl"] = micro["num"] / micro["den"].clip(lower=1)
    micro["end"] = -(-micro["step"] // 4) * 4
    want = micro.groupby("end")["kl"].mean()  # TRL: one list of micro-batch values per window
    logged = got.dropna(subset=["logged_kl"])
    assert list(logged["window_end"]) == list(want.index) == [0, 4, 8, 12]
    assert list(logged["step"]) == [0, 4, 8, 11]  # the last window is logged with the final metrics
    np.testing.assert_allclose(logged["logged_kl"], want.to_numpy(), rtol=1e-9)
    assert got["logged_kl"].isna().sum() == len(got) - 4


def test_opsm_delta_defaults_to_the_manifest_threshold(tmp_path):
    run = tmp_path / "o"
    make_run(run, SynthConfig(**SMALL, extra_config={"off_policy_mask_threshold": 1e9}))
    a = analyze(run, NOCACHE)
    assert a.config.opsm_delta == 1e9 and a.steps.column("opsm_masked_frac").to_pylist() == [0.0] * 12
    explicit = analyze(run, AnalysisConfig(use_cache=False, opsm_delta=1e-4))
    assert explicit.config.opsm_delta == 1e-4 and max(explicit.steps.column("opsm_masked_frac").to_pylist()) > 0
    shutil.rmtree(run)
    make_run(run, SynthConfig(**SMALL))
    assert analyze(run, NOCACHE).config.opsm_delta == 1e-4  # no threshold in the manifest: TRL's default
    with pytest.raises(ValueError, match="opsm_delta"):
        analyze(run, AnalysisConfig(opsm_delta=float("nan")))


def test_blame_share_is_zero_without_weight():
    """Policy equal to the reference: no |k3 weight| at all, so none on flagged tokens (not null)."""
    from kldiag.analysis.core.tables import blame_share

    got = blame_share(np.array([0.0, 1.0, 0.0]), np.array([0.0, 4.0, 0.0]), np.array([5, 5, 0]))
    assert got[0] == 0.0 and got[1] == 0.25 and np.isnan(got[2])


def test_policy_equal_to_reference_gives_no_silent_null(tmp_path):
    run = tmp_path / "eq"
    make_run(run, SynthConfig(**SMALL))
    table = open_run(run).read()
    path = next((run / "tokens").rglob("*.parquet"))
    import pyarrow.parquet as pq

    part = pq.read_table(path)
    pq.write_table(part.set_column(part.schema.get_field_index("logp_ref"), "logp_ref", part.column("logp")), path)
    row = analyze(run, NOCACHE).steps.to_pylist()[int(pq.read_table(path).column("step")[0].as_py())]
    assert table.num_rows > 0 and row["blame_share"] == 0.0 and row["k3_mean"] == 0.0
    assert all(v is not None for k, v in row.items() if k not in ("mismatch_kl",)), row
