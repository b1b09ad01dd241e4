"""Cause engine_retokenization (kldiag/diagnosis/retokenize.py) on tiny-model multi-turn runs
(kldiag/tools/agentic_runs.py): named at the right onset with its evidence on a re-tokenised run,
absorbing the generic engine mismatch; quiet on healthy multi-turn and single-turn runs and on a
mismatch present in every turn."""

from __future__ import annotations

import numpy as np
import pytest

from kldiag.analysis.pipeline import analyze
from kldiag.analysis.types import AnalysisConfig
from kldiag.diagnosis import diagnose
from kldiag.diagnosis import retokenize as RT
from kldiag.diagnosis.core import reducers
from kldiag.tools.agentic_runs import AgenticRun, make_run

STEPS = 20
pytestmark = pytest.mark.filterwarnings("ignore:kldiag.*placeholder")


def _diagnose(tmp_path, name, **kw):
    run = make_run(tmp_path / name, AgenticRun(steps=STEPS, **kw))
    return diagnose(analyze(run, AnalysisConfig(), reducers()))


def test_retokenised_run_names_the_cause_at_its_onset(tmp_path):
    dg = _diagnose(tmp_path, "retok", retokenize=True, retokenize_turns=(2,), retokenize_from=8, placeholder="nan")
    found = {c.cause: c for c in dg.causes}
    assert set(found) == {RT.NAME}, [(c.cause, c.onset, c.summary) for c in dg.causes]
    c = found[RT.NAME]
    assert c.onset == 8 and dg.verdict == "warning"
    ev = c.evidence
    per = {r["turn"]: r for r in ev["turn_start_vs_body"]}
    assert per["2"]["start_mismatch_abs_mean"] > 3 * per["2"]["body_mismatch_abs_mean"]
    assert per["0"]["start_mismatch_abs_mean"] == 0.0 and per["1"]["start_mismatch_abs_mean"] == 0.0
    assert ev["first_turn_mismatch_abs_mean"] == 0.0
    assert ev["examples"] and all(e["turn"] == 2 and e["step"] >= 8 for e in ev["examples"])
    prof = ev["later_turn_mismatch_by_position"]
    assert prof["0"] > prof["1"] > prof["3-7"]  # largest at the first token, fading along the turn
    assert ev["explained_mismatch"] is not None  # the generic rule fired, and is absorbed
    assert "token-in-token-out" in c.fix and "NaN" not in c.summary


def test_healthy_multi_turn_run_is_quiet_with_placeholders(tmp_path):
    for placeholder in ("0.0", "nan", None):
        dg = _diagnose(tmp_path, f"healthy-{placeholder}", placeholder=placeholder)
        assert dg.verdict == "healthy" and not dg.causes, (placeholder, [(c.cause, c.summary) for c in dg.causes])


def test_single_turn_run_is_quiet(tmp_path):
    dg = _diagnose(tmp_path, "single", turns=1, retokenize=True)
    assert RT.NAME not in {c.cause for c in dg.causes}


def test_mismatch_in_every_turn_is_not_a_retokenisation(tmp_path):
    dg = _diagnose(tmp_path, "temp", engine_temperature=1.3, placeholder=None)
    names = {c.cause for c in dg.causes}
    assert RT.NAME not in names and names & {"engine_mismatch", "engine_temperature_mismatch"}, names


def _fig(later_start, later_body=0.1, first=0.0, single=np.nan, starts=100, first_start=None):
    return {"later_start": later_start, "later_body": later_body, "later_starts": starts, "first_turn": first,
            "first_turn_start": first if first_start is None else first_start, "single_turn": single,
            "later_profile": np.zeros(6)}


@pytest.mark.parametrize("fig, expect", [
    (_fig(0.8), True),
    (_fig(0.8, first=0.3), False),  # present in first turns: not a boundary effect
    (_fig(0.08, later_body=0.02, first=0.015, first_start=0.07), False),  # every turn's start is harder
    (_fig(0.8, single=0.5), False),  # present in single-turn sequences
    (_fig(0.8, later_body=0.7), False),  # not largest at the turn's first token
    (_fig(0.02, later_body=0.0), False),  # float noise
    (_fig(0.8, starts=5), False),  # too few later turns
])
def test_holds(fig, expect):
    assert RT.holds(fig, RT.RetokenizeConfig()) is expect


@pytest.mark.parametrize("trainer, names", [
    ("verl", "ct_merge_assistant_token"), ("slime", "--custom-generate-function-path"),
    ("miles", "TrajectoryManager"), ("skyrl_train", "custom_chat_template"), ("trl", "rollout_func"),
    ("openrlhf", "token-in-token-out"), ("my_loop", "token-in-token-out"),
])
def test_fix_names_each_frameworks_own_path(trainer, names):
    from kldiag.format import Manifest
    from kldiag.frameworks.turns import retokenize_fix

    assert names in retokenize_fix(Manifest(trainer={"name": trainer}))
