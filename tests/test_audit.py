"""kldiag audit: logged metrics against the recomputation from the tokens.

Planted disagreements: a synthetic run (varied lengths, a sampler, one NaN logp at step 4), and one
metric log per kind whose planted values are computed here the wrong way with pandas from the raw
token rows, independently of kldiag.crosswalk.audit.reasons; the audit must name exactly that kind
at exactly the planted steps. The real TRL run is in test_audit_trl.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import kldiag
import kldiag.crosswalk as X
from kldiag.cli import main
from kldiag.crosswalk.audit import AuditError, audit
from kldiag.crosswalk.audit.logs import LogsError
from kldiag.tools.synth import SynthConfig, make_run

DIFF = "sampling/sampling_logp_difference/mean"
NAN_STEP = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("audit") / "run"
    make_run(path, SynthConfig(steps=6, seqs_per_step=8, seq_len=(4, 12), unmasked_frac=0.0, vocab_size=0,
                               nonfinite=((NAN_STEP, "logp"),), seed=3))
    return path


@pytest.fixture(scope="module")
def tokens(run):
    """The masked token rows, float64, with |old - sampler| and TRL's per-token k3."""
    t = kldiag.open_run(run).read().to_pandas()
    t = t[t["mask"]].astype({c: np.float64 for c in ("logp", "logp_old", "logp_ref", "logp_sampler")})
    d = t["logp_ref"] - t["logp"]
    return t.assign(delta=(t["logp_old"] - t["logp_sampler"]).abs(), k3=np.exp(d) - d - 1)


@pytest.fixture(scope="module")
def truth(run):
    """The crosswalk's own records: the correct log, step -> {name: value}."""
    return {r["step"]: r for r in X.records(X.crosswalk(run, "trl"), reasons=False)}


def write_log(path, truth, planted: dict[str, dict[int, float]]):
    """A W&B-style JSON-lines log of every metric ("train/" prefix), `planted` overriding values."""
    with open(path, "w") as f:
        for step, row in truth.items():
            out = {"_step": 100 + step, "train/global_step": step}
            for name, value in row.items():
                v = planted.get(name, {}).get(step, value)
                if name != "step" and v is not None:
                    out[f"train/{name}"] = v
            f.write(json.dumps(out) + "\n")
    return path


def test_independent_truth_matches_the_crosswalk(tokens, truth):
    mean = tokens.groupby("step")["delta"].mean()
    for step, row in truth.items():
        assert row[DIFF] == pytest.approx(mean[step], rel=1e-12)
    nanmean = lambda x: x.to_numpy().mean()  # noqa: E731 - pandas' mean would skip the NaN
    kl = tokens.groupby(["step", "micro"])["k3"].agg(nanmean).groupby("step").agg(nanmean)
    assert truth[NAN_STEP]["kl"] is None and np.isnan(kl[NAN_STEP])  # the NaN token poisons the step
    assert truth[1]["kl"] == pytest.approx(kl[1], rel=1e-12)


def test_a_correct_log_agrees(run, truth, tmp_path):
    truth = {s: {**r, "kl": r["kl"] if s != NAN_STEP else float("nan")} for s, r in truth.items()}
    res = audit(run, write_log(tmp_path / "ok.jsonl", truth, {}), "trl")
    assert [m.verdict for m in res.metrics] == ["agree"] * 6, res.metrics
    assert all(m.steps == 6 for m in res.metrics)
    assert res.metrics[1].max_rel_diff == 0.0 and res.unmatched == ()


def planted_logs(tokens) -> dict[str, tuple[str, dict[int, float]]]:
    """kind -> (metric, {step: the value computed the wrong way}), planted at steps 1 and 2 (kl: 4)."""
    t12 = tokens[tokens["step"].isin([1, 2])]
    lengths = t12.groupby(["step", "seq"]).size()
    grid = lengths.groupby("step").agg(lambda n: len(n) * n.max())  # B x T of the padded batch
    finite = tokens[np.isfinite(tokens["k3"])]
    p_delta = (np.exp(t12["logp_old"]) - np.exp(t12["logp_sampler"])).abs()
    return {
        "nan_filtered": ("kl", {NAN_STEP: finite.groupby(["step", "micro"])["k3"].mean()
                                .groupby("step").mean()[NAN_STEP]}),
        "padding_included": (DIFF, (t12.groupby("step")["delta"].sum() / grid).to_dict()),
        "per_sample_vs_per_token": (DIFF, t12.groupby(["step", "seq"])["delta"].mean().groupby("step").mean()
                                    .to_dict()),
        "probabilities": (DIFF, p_delta.groupby(t12["step"]).mean().to_dict()),
        "unexplained": (DIFF, t12.groupby("step")["delta"].median().to_dict()),
    }


@pytest.mark.parametrize("kind", ["nan_filtered", "padding_included", "per_sample_vs_per_token", "probabilities",
                                  "unexplained"])
def test_planted_disagreement_is_named(run, tokens, truth, tmp_path, kind):
    metric, values = planted_logs(tokens)[kind]
    res = audit(run, write_log(tmp_path / f"{kind}.jsonl", truth, {metric: values}), "trl")
    by = {m.name: m for m in res.metrics}
    m = by[metric]
    print(f"planted {kind} in {metric} at steps {sorted(values)}: verdict {m.verdict}, reason {m.reason}, "
          f"step reasons {m.step_reasons}, max rel diff {m.max_rel_diff:.3g}")
    assert m.verdict == "disagree" and m.reason == kind
    assert m.differing_steps == tuple(sorted(values))
    assert all(r[0] == kind for r in m.step_reasons.values())
    others = [x for x in res.metrics if x.name != metric]
    assert all(x.verdict == "agree" for x in others if x.name != "kl"), others
    if metric != "kl":  # the correct log leaves out the NaN step's kl: the trainer hid it
        assert by["kl"].reason == "nan_filtered" and by["kl"].differing_steps == (NAN_STEP,)


def test_a_dropped_nan_step_is_nan_filtered(run, truth, tmp_path):
    res = audit(run, write_log(tmp_path / "drop.jsonl", truth, {}), "trl")  # kl of step 4 is absent
    kl = res.metrics[0]
    assert kl.name == "kl" and kl.verdict == "disagree" and kl.reason == "nan_filtered"
    assert kl.steps == 5 and kl.step_reasons == {NAN_STEP: ("nan_filtered",)}


def test_a_log_every_third_step_is_a_logging_window(run, tokens, truth, tmp_path):
    """logging_steps=3: the trainer logs at steps 2 and 5 the mean of its per-step values since the last log."""
    mean = tokens.groupby("step")["delta"].mean()
    p = tmp_path / "window.jsonl"
    p.write_text("\n".join(json.dumps({"step": s, f"train/{DIFF}": mean.loc[s - 2:s].mean()}) for s in (2, 5)))
    m = audit(run, p, "trl").metrics[0]
    assert m.name == DIFF and m.steps == 2 and m.reason == "logging_window" and m.differing_steps == (2, 5)


def test_cli_table_json_and_exit_codes(run, tokens, truth, tmp_path, capsys):
    metric, values = planted_logs(tokens)["padding_included"]
    log = write_log(tmp_path / "pad.jsonl", truth, {metric: values})
    assert main(["audit", str(run), "--logs", str(log), "-f", "trl"]) == 0
    out = capsys.readouterr().out
    assert "padding_included" in out and "verdict" in out
    assert main(["audit", str(run), "--logs", str(log), "-f", "trl", "--fail-on", "disagreement"]) == 1
    assert "failing on" in capsys.readouterr().err
    assert main(["audit", str(run), "--logs", str(log), "-f", "trl", "--fail-on", "unexplained"]) == 0
    capsys.readouterr()
    assert main(["audit", str(run), "--logs", str(log), "-f", "trl", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"run", "logs", "logs_kind", "framework", "step_offset", "rtol", "atol", "metrics", "unmatched"}
    m = next(x for x in doc["metrics"] if x["name"] == metric)
    assert m["verdict"] == "disagree" and m["reason"] == "padding_included" and m["logged_name"] == f"train/{metric}"
    assert m["step_reasons"] == {"1": ["padding_included"], "2": ["padding_included"]}
    assert {"step", "logged", "recomputed"} == set(m["series"][0])
    metric, values = planted_logs(tokens)["unexplained"]
    odd = write_log(tmp_path / "odd.jsonl", truth, {metric: values})
    assert main(["audit", str(run), "--logs", str(odd), "-f", "trl", "--fail-on", "unexplained"]) == 1
    assert "sampling/sampling_logp_difference/mean disagrees (unexplained)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["audit", str(run), "--logs", str(odd), "--fail-on", "bogus"])
    assert e.value.code == 2 and "choose from disagreement, unexplained, any" in capsys.readouterr().err


def test_bad_input_exits_2_naming_the_fix(run, truth, tmp_path, capsys):
    log = write_log(tmp_path / "ok.jsonl", truth, {})
    (tmp_path / "x.txt").write_text("hello")
    assert main(["audit", str(run), "--logs", str(tmp_path / "x.txt"), "-f", "trl"]) == 2
    assert "unknown log format" in capsys.readouterr().err
    assert main(["audit", str(run), "--logs", str(log), "-f", "nope"]) == 2
    assert "unknown framework" in capsys.readouterr().err
    assert main(["audit", str(run), "--logs", str(log)]) == 2  # a synthetic run has no framework of its own
    assert "--framework" in capsys.readouterr().err
    with pytest.raises(AuditError, match="step-offset 0 aligns 6 step"):
        audit(run, log, "trl", step_offset=10)
    with pytest.raises(AuditError, match="is --framework right"):
        audit(run, log, "verl")
    with pytest.raises(LogsError):
        audit(run, tmp_path / "missing.jsonl", "trl")
