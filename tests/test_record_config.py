"""RecorderConfig: the Recorder's options as one dataclass, every keyword still accepted."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

import kldiag
from kldiag.record.config import RecorderConfig


def test_every_option_is_a_field_with_a_default_and_the_keywords_still_work(tmp_path):
    assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(RecorderConfig))
    with kldiag.Recorder(tmp_path / "kw", beta=0.04, estimator="k3", rotate_seconds=None, every_n_steps=2) as rec:
        rec.record(step=0, logp=np.full((2, 3), -1.0, np.float32))
    assert rec.options.every_n_steps == 2 and rec.manifest.config["beta"] == 0.04
    opts = RecorderConfig(beta=0.04, estimator="k3", rotate_seconds=None, every_n_steps=2)
    with kldiag.Recorder(tmp_path / "cfg", opts, seq_fraction=0.5) as rec2:  # a keyword overrides the config
        rec2.record(step=0, logp=np.full((2, 3), -1.0, np.float32))
    assert rec2.options == dataclasses.replace(opts, seq_fraction=0.5)
    assert rec2.manifest.sampling["seq_fraction"] == 0.5 and kldiag.RecorderConfig is RecorderConfig


@pytest.mark.parametrize("bad, match", [
    ({"backpressure": "wait"}, "backpressure"), ({"every_n_steps": 0}, "every_n_steps"),
    ({"seq_fraction": 1.5}, "seq_fraction"), ({"rotate_rows": 0}, "rotate_rows"),
])
def test_bad_options_name_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        RecorderConfig(**bad)


def test_an_unknown_keyword_lists_the_valid_ones(tmp_path):
    with pytest.raises(TypeError, match="rotate_rows"):
        kldiag.Recorder(tmp_path / "x", rotate_row=10)
    assert not (tmp_path / "x").exists()  # refused before anything is written


def test_old_module_paths_alias_the_moved_modules():
    import kldiag.guard
    import kldiag.recorder
    from kldiag.synth import make_run  # noqa: F401

    import kldiag.live.guard
    import kldiag.record.recorder
    from kldiag import _compat

    assert kldiag.recorder is kldiag.record.recorder and kldiag.guard is kldiag.live.guard
    assert "Recorder" in inspect.signature(kldiag.recorder.Recorder).parameters["options"].annotation
    for old in _compat.MOVED:
        __import__(old)
