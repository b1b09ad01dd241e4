"""kldiag audit on a real TRL GRPOTrainer run (tiny CPU model, 2 optimizer steps, logging_steps=1,
report_to tensorboard, a checkpoint at step 2): what TRL wrote to trainer_state.json and to
TensorBoard agrees with the recomputation from the recorded tokens at step offset 0 (the hook
records state.global_step + 1 during the loss, the step TRL then logs at). TRL logs sampling/*
only with vLLM, so on CPU `kl` is the metric both sides have. With logging_steps=2 the audit
names TRL's window mean."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kldiag.cli import main
from kldiag.crosswalk.audit import audit

pytest.importorskip("trl")
pytest.importorskip("tensorboard")
pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from test_integrations_trl import train_attached  # noqa: E402
from trl_grpo import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("audit_trl_model"), seed=0)


@pytest.fixture(scope="module")
def trl_run(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("audit_trl")
    trainer, run, _ = train_attached(model, tmp, report_to=["tensorboard"], max_steps=2, save_strategy="steps",
                                     save_steps=2)
    return trainer, run, tmp / "out"


def test_trl_logs_agree_with_the_tokens(trl_run, capsys):
    trainer, run, out = trl_run
    logged_kl = {h["step"]: h["kl"] for h in trainer.state.log_history if "kl" in h}
    assert sorted(logged_kl) == [1, 2] and logged_kl[2] > 1e-3  # the policy moved from the reference
    tb = next(out.rglob("events.out.tfevents*")).parent
    for src, kind in ((out / "checkpoint-2", "trainer_state"), (tb, "tensorboard")):
        res = audit(run, src)
        assert res.framework == "trl" and res.logs_kind == kind and res.step_offset == 0
        by = {m.name: m for m in res.metrics}
        assert list(by) == ["kl"]  # sampling/* need vLLM: TRL does not log them on CPU
        kl = by["kl"]
        with capsys.disabled():
            print(f"\n{kind}: kl steps {kl.steps}, max rel diff {kl.max_rel_diff:.3g}, "
                  f"max abs diff {kl.max_abs_diff:.3g}, {kl.verdict}")
        assert kl.verdict == "agree" and kl.steps == 2 and kl.max_rel_diff < 1e-6
        assert any(n.endswith("reward") for n in res.unmatched)  # reported, not audited
        assert main(["audit", str(run), "--logs", str(src), "--fail-on", "any"]) == 0


def test_trl_logging_steps_2_is_a_logging_window(model, tmp_path):
    """logging_steps=2: TRL logs at step 2 the mean of its per-step `kl` over steps 1 and 2."""
    trainer, run, _ = train_attached(model, tmp_path, logging_steps=2, max_steps=2)
    trainer.state.save_to_json(str(tmp_path / "trainer_state.json"))
    kl = audit(run, tmp_path / "trainer_state.json").metrics[0]
    assert kl.name == "kl" and kl.steps == 1 and kl.max_rel_diff > 1e-2
    assert kl.reason == "logging_window" and kl.step_reasons == {2: ("logging_window",)}
