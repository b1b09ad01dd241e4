"""`kldiag report`'s headline is the verdict's principal cause, not the earliest episode: on a run whose
engine mismatch moves at step 0 and whose K3 weight blows up later, the K3 blow-up heads the summary."""

from __future__ import annotations

from kldiag.analysis.rules.episodes import Episode
from kldiag.diagnosis.types import Cause, Diagnosis
from kldiag.report import build as R
from kldiag.report.render import format_text, render_html


def _diagnosis() -> Diagnosis:
    causes = [Cause("k3_weight_blowup", 36, "critical", {}, "multiply by rho",
                    "K3's gradient weight reaches 939 at step 86 (above 100 from step 43); flagged tokens carry 91%"),
              Cause("engine_temperature_mismatch", 0, "warning", {}, "divide the logits", "temperature 1.2"),
              Cause("engine_mismatch", 0, "info", {}, "match the engine", "a small mismatch")]
    eps = [Episode("mismatch", 0, 0, 0, 0.0126, "warning", "mismatch msg", metric="mismatch_kl"),
           Episode("blowup", 43, 94, 86, 939.0, "critical", "blowup msg", metric="weight_k3_abs_max")]
    return Diagnosis("unstable", causes, eps)


def test_principal_is_the_worst_cause_up_to_its_first_clause():
    assert R.principal(_diagnosis()) == ("k3_weight_blowup (critical, from step 36): K3's gradient weight reaches "
                                         "939 at step 86 (above 100 from step 43)")
    only_info = Diagnosis("healthy", [Cause("engine_mismatch", None, "info", {}, "x", "small")])
    assert R.principal(only_info) is None and R.principal(Diagnosis("healthy")) is None


def test_text_and_html_lead_with_the_principal_cause(tmp_path):
    from kldiag.analysis.pipeline import analyze
    from kldiag.tools.synth import SynthConfig, make_run

    make_run(tmp_path / "r", SynthConfig(steps=3, seqs_per_step=4, seq_len=(4, 8), vocab_size=0))
    rep = R.build_report(analyze(tmp_path / "r", reducers=R.reducers()), diagnosis=_diagnosis())
    lines = format_text(rep).splitlines()
    assert lines[2].startswith("principal cause: k3_weight_blowup (critical, from step 36)")
    assert lines[3].startswith("flagged: ") and lines[4].startswith("first to move: mismatch_kl at step 0")
    page = render_html(rep)
    assert page.index("Principal cause: <b>k3_weight_blowup") < page.index("First to move")


def test_a_summary_ending_in_an_ellipsis_keeps_it():
    """Issue 47 edge 5: "at steps 0, 1, 2, 3, 4, 5, ..." printed as "5, . Fix:" and the principal line as "5,"."""
    c = Cause("routing_replay_broken", 0, "critical", {}, "patch the router",
              "replay is on but did not take (limit 1%), at steps 0, 1, 2, 3, 4, 5, ...")
    dg = Diagnosis("unstable", [c])
    assert R.principal(dg).endswith("at steps 0, 1, 2, 3, 4, 5, ...")
    assert "5, ... Fix: patch the router" in R.fixes(dg)[0]
    plain = Diagnosis("unstable", [Cause("x", 1, "warning", {}, "do y", "it moved.")])
    assert R.fixes(plain)[0] == "x (warning, from step 1): it moved. Fix: do y"
