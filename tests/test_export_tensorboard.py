"""`kldiag export tensorboard`: read back with TensorBoard's own EventAccumulator, scalars and
histograms at every step; a second export appends only the new steps; errors name the fix."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import kldiag  # noqa: E402
from kldiag.analysis.types import ABS_EDGES, D_EDGES  # noqa: E402
from kldiag.cli import main  # noqa: E402
from kldiag.export.tensorboard import STATE_FILE, histogram_fields, scalar_columns  # noqa: E402
from kldiag.tools.synth import SynthConfig, make_run  # noqa: E402

CFG = SynthConfig(steps=6, seqs_per_step=8, seq_len=(8, 16), vocab_size=32, blowup_step=4, blowup_frac=0.05, seed=3)
HISTS = ("d", "weight_k3_abs", "weight_k3_is_abs", "rho")


def _read(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_export_reads_back_every_scalar_and_histogram(tmp_path, capsys):
    run, logdir = tmp_path / "run", tmp_path / "tb"
    make_run(run, CFG)
    assert main(["export", "tensorboard", str(run), str(logdir)]) == 0
    assert "wrote steps 0..5" in capsys.readouterr().err
    acc = _read(logdir)
    steps = kldiag.analyze(run).steps.to_pandas()
    tags = acc.Tags()
    for col in scalar_columns(steps):
        events = acc.Scalars(f"kldiag/{col}")
        assert [e.step for e in events] == list(range(CFG.steps))
        want = steps[col].to_numpy(dtype=np.float64, na_value=np.nan)
        got = np.array([e.value for e in events])
        np.testing.assert_allclose(got, want.astype(np.float32), rtol=1e-6, equal_nan=True)
    for name in HISTS:
        assert f"kldiag/{name}" in tags["histograms"]
        events = acc.Histograms(f"kldiag/{name}")
        assert [e.step for e in events] == list(range(CFG.steps))
        # every token in the loss with a finite value is counted once
        nums = np.array([e.histogram_value.num for e in events])
        if name != "rho":
            np.testing.assert_array_equal(nums, steps["tokens"].to_numpy())
    # the blow-up from step 4 on reaches |k3 weight| > 10 only there
    top = [e.histogram_value.max for e in acc.Histograms("kldiag/weight_k3_abs")]
    assert max(top[:4]) < 10 < min(top[4:])


def test_second_export_appends_only_new_steps(tmp_path, capsys):
    run, logdir = tmp_path / "run", tmp_path / "tb"
    make_run(run, SynthConfig(**{**CFG.__dict__, "steps": 4}))
    assert main(["export", "tensorboard", str(run), str(logdir)]) == 0
    assert main(["export", "tensorboard", str(run), str(logdir)]) == 0
    assert "up to date" in capsys.readouterr().err
    make_run(run, CFG, steps=range(4, 6), manifest=False)
    assert main(["export", "tensorboard", str(run), str(logdir), "--hold-last"]) == 0
    assert "wrote steps 4..4" in capsys.readouterr().err
    assert main(["export", "tensorboard", str(run), str(logdir)]) == 0
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 3
    acc = _read(logdir)
    assert [e.step for e in acc.Scalars("kldiag/k3_mean")] == list(range(6))  # each step once
    assert [e.step for e in acc.Histograms("kldiag/d")] == list(range(6))
    assert (logdir / STATE_FILE).is_file()


def test_logdir_of_another_run_is_refused(tmp_path, capsys):
    a, b, logdir = tmp_path / "a", tmp_path / "b", tmp_path / "tb"
    make_run(a, CFG)
    make_run(b, CFG)
    assert main(["export", "tensorboard", str(a), str(logdir)]) == 0
    assert main(["export", "tensorboard", str(b), str(logdir)]) == 2
    err = capsys.readouterr().err
    assert "another run" in err and "own LOGDIR" in err
    assert main(["export", "tensorboard", str(tmp_path / "missing"), str(tmp_path / "tb2")]) == 2


def test_same_run_from_another_directory_is_the_same_run(tmp_path, capsys, monkeypatch):
    """LOGDIR remembers the run by its resolved path: typed relative from elsewhere, or through a
    symlink, it is the same run and the export goes on."""
    run, logdir = tmp_path / "runs" / "a", tmp_path / "tb"
    make_run(run, CFG, steps=range(0, 3))
    monkeypatch.chdir(tmp_path)
    assert main(["export", "tensorboard", "runs/a", str(logdir)]) == 0
    make_run(run, CFG, steps=range(3, 5), manifest=False)
    monkeypatch.chdir(tmp_path / "runs")
    (tmp_path / "link").symlink_to(run)
    assert main(["export", "tensorboard", "../link", str(logdir)]) == 0
    assert "wrote steps 3..4" in capsys.readouterr().err
    assert main(["export", "tensorboard", "a", "../tb"]) == 0
    assert "up to date" in capsys.readouterr().err


def test_histogram_fields_keep_counts_and_bounds():
    counts = np.zeros(len(D_EDGES) + 1)
    counts[[3, 80, 81]] = [1, 5, 2]
    f = histogram_fields(counts, D_EDGES)
    assert f["num"] == 8 and f["bucket"][0] == 1 and f["bucket"][-1] == 2
    assert f["min"] == D_EDGES[2] and f["max"] == D_EDGES[81]
    assert f["bucket_limit"] == sorted(f["bucket_limit"])
    # log-spaced |weight| bins: zeros (bin 0) and +inf (overflow) still get finite limits
    w = np.zeros(len(ABS_EDGES) + 1)
    w[[0, -1]] = [3, 1]
    g = histogram_fields(w, ABS_EDGES)
    assert g["min"] == 0.0 and np.isfinite(g["max"]) and g["max"] > ABS_EDGES[-1]
    assert histogram_fields(np.zeros(5), np.array([1.0, 2.0, 4.0, 8.0])) is None


def test_missing_tensorboard_names_the_extra(tmp_path, monkeypatch, capsys):
    import sys

    run = tmp_path / "run"
    make_run(run, CFG)
    for name in [m for m in sys.modules if m == "tensorboard" or m.startswith("tensorboard.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard raises ImportError
    assert main(["export", "tensorboard", str(run), str(tmp_path / "tb")]) == 2
    assert "pip install 'kldiag[tensorboard]'" in capsys.readouterr().err
    assert not (tmp_path / "tb").exists()
