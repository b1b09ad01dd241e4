"""`kldiag report RUN_DIR`: a post-mortem of one run, as one offline HTML file and a text summary.

Built on `kldiag.analyze`. The verdict comes from small rules (pure functions of per-step
arrays), each with a name that `--fail-on` accepts, so a CI job or a cron can gate on them:

  blowup      the gradient weight of the KL loss the run uses exceeds --blowup-weight (default
              100: ten times the per-token flag limit) on some token: K3's 1 - pi_ref/pi_theta
              (DeepSeek-V3.2 section 3.1), or rho * log(pi_theta/pi_ref) for k3_is (eq. 9)
  nonfinite   a NaN/inf log-prob, or a log-prob above 0, was recorded
  blame       under a K3 loss, a step where flagged tokens carry over half of the |k3 weight|
  latent      K3's weight on this run's own tokens exceeds --blowup-weight, whatever loss the run
              uses (a K3 run would blow up on these tokens; K3 *values* logged here are huge)
  mismatch    sampler/trainer mismatch dominates: the mean of log(pi_old/mu) KL exceeds the
              policy drift |log pi_theta - log pi_old| and --mismatch-kl (default 0.01)

Verdict: "unstable" when blowup or nonfinite fires, "warning" when blame or mismatch fires,
"healthy" otherwise (latent is a note). `--fail-on blowup,nonfinite` (or `all`) exits 1 when any named rule fires.
Token text is model output, hence untrusted: every piece goes through html.escape.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kldiag import estimators as E

# The per-step column holding the max |gradient weight| of each KL loss a trainer uses.
LOSS_WEIGHT_COLUMN = {"k3": "weight_k3_abs_max", "k3_is": "weight_k3_is_abs_max"}
DEFAULT_ESTIMATOR = "k3"  # what TRL (before use_bias_correction_kl), verl and OpenRLHF use


@dataclass(frozen=True)
class ReportConfig:
    """Thresholds of the verdict rules and what the report shows."""

    blowup_weight: float = 100.0  # |loss weight| beyond this: blow-up (10x the flag limit W)
    blame_share: float = 0.5  # share of |k3 weight| carried by flagged tokens
    mismatch_kl: float = 0.01  # mean KL(pi_old || mu) per token
    top_tokens: int = 10  # offending tokens listed
    context: int = 5  # tokens shown on each side of an offending token


@dataclass
class RuleResult:
    name: str
    fired: bool
    step: int | None  # the first step where it fired
    message: str


@dataclass
class Offender:
    """One offending token, in context."""

    step: int
    seq: int
    pos: int
    piece: str
    before: list[str]
    after: list[str]
    weight_k3: float
    weight_k3_is: float
    d: float  # log(pi_ref / pi_theta)


@dataclass
class Report:
    run_dir: Path
    estimator: str
    estimator_assumed: bool  # the manifest did not say; DEFAULT_ESTIMATOR assumed
    verdict: str  # "healthy" | "warning" | "unstable"
    rules: list[RuleResult]
    onset_step: int | None
    first_moved: tuple[int, str, str] | None  # (step, metric, message) of the earliest alert
    offenders: list[Offender]
    comparison: list[dict[str, Any]]
    recommendations: list[str]
    facts: dict[str, Any] = field(default_factory=dict)
    analysis: Any = None

    def fired(self) -> set[str]:
        return {r.name for r in self.rules if r.fired}


# ---- rules: pure functions of per-step arrays ---------------------------------------------


def first_step(steps: np.ndarray, condition: np.ndarray) -> int | None:
    """The first step where `condition` holds (NaN-safe: pass a boolean array), or None."""
    hit = np.flatnonzero(condition)
    return int(steps[hit[0]]) if len(hit) else None


def rule_blowup(steps, loss_weight_max, estimator: str, limit: float) -> RuleResult:
    """The KL loss's own per-token |gradient weight| beyond `limit` at some step."""
    w = np.nan_to_num(np.asarray(loss_weight_max, dtype=np.float64), nan=0.0)
    step = first_step(steps, w > limit)
    if step is None:
        return RuleResult("blowup", False, None, f"max |{estimator} weight| {_num(w.max(initial=0))} "
                          f"stays below {_num(limit)}")
    peak = int(np.argmax(w))
    return RuleResult("blowup", True, step, f"|{estimator} weight| exceeds {_num(limit)} from step {step}, "
                      f"up to {_num(w[peak])} at step {int(steps[peak])}")


def rule_nonfinite(steps, nonfinite_count, invalid_count) -> RuleResult:
    bad = np.asarray(nonfinite_count) + np.asarray(invalid_count)
    step = first_step(steps, bad > 0)
    if step is None:
        return RuleResult("nonfinite", False, None, "every log-prob is finite and <= 0")
    return RuleResult("nonfinite", True, step, f"{int(np.sum(nonfinite_count))} non-finite and "
                      f"{int(np.sum(invalid_count))} positive log-probs, the first at step {step}")


def rule_blame(steps, blame_share, estimator: str, limit: float) -> RuleResult:
    share = np.nan_to_num(np.asarray(blame_share, dtype=np.float64), nan=0.0)
    step = first_step(steps, share > limit) if estimator == "k3" else None
    if step is None:
        why = "" if estimator == "k3" else f" (the loss is {estimator}, not K3)"
        return RuleResult("blame", False, None, f"no step where flagged tokens carry over {limit:.0%} "
                          f"of the K3 gradient{why}")
    n = int(np.sum(share > limit))
    return RuleResult("blame", True, step, f"in {n} steps, from step {step}, flagged tokens carry over "
                      f"{limit:.0%} of the K3 gradient (max {share.max():.0%})")


def rule_latent(steps, weight_k3_max, estimator: str, limit: float) -> RuleResult:
    w = np.nan_to_num(np.asarray(weight_k3_max, dtype=np.float64), nan=0.0)
    step = first_step(steps, w > limit)
    if step is None:
        return RuleResult("latent", False, None, f"K3's weights stay below {_num(limit)} on this run's tokens")
    whose = "this run's loss" if estimator == "k3" else f"K3 (not this run's loss, {estimator})"
    return RuleResult("latent", True, step, f"the weight of {whose} reaches {_num(w.max())} on this run's "
                      f"tokens, from step {step}")


def rule_mismatch(steps, mismatch_kl, drift_abs_mean, limit: float) -> RuleResult:
    kl = np.asarray(mismatch_kl, dtype=np.float64)
    drift = np.asarray(drift_abs_mean, dtype=np.float64)
    if not np.any(np.isfinite(kl)):
        return RuleResult("mismatch", False, None, "no sampler log-probs recorded (logp_sampler): "
                          "mismatch unknown")
    mean_kl, mean_drift = float(np.nanmean(kl)), float(np.nanmean(drift)) if np.any(np.isfinite(drift)) else 0.0
    fired = mean_kl > limit and mean_kl > mean_drift
    step = first_step(steps, np.nan_to_num(kl) > limit) if fired else None
    verb = "dominates" if fired else "does not dominate"
    return RuleResult("mismatch", fired, step, f"sampler/trainer mismatch {verb}: mean KL(pi_old||mu) "
                      f"{mean_kl:.3g} per token vs policy drift {mean_drift:.3g} (limit {limit:g})")


RULE_NAMES = ("blowup", "nonfinite", "blame", "latent", "mismatch")
FAILING = ("blowup", "nonfinite")  # rules that make the verdict "unstable"
NOTES = ("latent",)  # facts worth knowing that leave a healthy run healthy


def verdict(rules: list[RuleResult]) -> str:
    fired = {r.name for r in rules if r.fired}
    if fired & set(FAILING):
        return "unstable"
    return "warning" if fired - set(NOTES) else "healthy"


def parse_rules(text: str) -> tuple[str, ...]:
    """'blowup,nonfinite' -> ('blowup', 'nonfinite'); 'all' -> every rule."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names == ("all",):
        return RULE_NAMES
    unknown = [n for n in names if n not in RULE_NAMES]
    if unknown or not names:
        raise ValueError(f"unknown rule(s) {', '.join(unknown) or '(none given)'}; choose from "
                         f"{', '.join(RULE_NAMES)} or all")
    return names


def exit_code(report: Report, fail_on: tuple[str, ...]) -> int:
    """1 when a rule named in `fail_on` fired, else 0."""
    return 1 if report.fired() & set(fail_on) else 0


def recommendations(fired: set[str], estimator: str, facts: dict[str, Any]) -> list[str]:
    """Concrete next steps for the rules that fired."""
    out = []
    if "blowup" in fired and estimator == "k3":
        out.append("Switch the KL loss to the corrected estimator k3_is = rho * k3 (DeepSeek-V3.2 eq. 7): "
                   "in TRL `GRPOConfig(use_bias_correction_kl=True)`, in slime `--use-unbiased-kl`. Its weight "
                   "rho * log(pi_theta/pi_ref) grows like a log where K3's 1 - pi_ref/pi_theta explodes.")
    if "blowup" in fired and estimator != "k3":
        out.append(f"The {estimator} weights blow up through rho = pi_theta/pi_old (max rho "
                   f"{_num(facts.get('rho_max', math.nan))}): reduce staleness (fewer steps between "
                   "generation and training) or mask off-policy sequences (below).")
    if fired & {"blowup", "blame"}:
        out.append("Set an off-policy sequence mask: TRL `GRPOConfig(off_policy_mask_threshold=...)` "
                   "(DeepSeek-V3.2 eq. 9 delta; at kldiag's delta it would drop "
                   f"{facts.get('opsm_masked_frac', 0.0):.1%} of the sequences).")
    if "mismatch" in fired:
        out.append("Sampler/trainer mismatch dominates the off-policy gap: check that the inference engine "
                   "samples with the trainer's temperature, top-p and dtype; in TRL turn on "
                   "`vllm_importance_sampling_correction` (truncated importance sampling).")
    if "nonfinite" in fired:
        out.append(f"Non-finite or positive log-probs from step {facts.get('nonfinite_step')}: check for "
                   "fp16 overflow, -inf masking of sampled tokens, and logits/temperature scaling.")
    if "latent" in fired and estimator != "k3":
        out.append("K3 *values* on this run are huge (a trainer logging K3 shows an exploding 'KL') while "
                   f"the {estimator} gradient is healthy: read the k3_is column, and keep this estimator.")
    if "latent" in fired and estimator == "k3" and "blowup" not in fired:
        out.append("K3's weights are large but below the blow-up limit: consider k3_is before they grow.")
    return out or ["Nothing to fix: the KL term's gradient weights stay bounded and every value is finite."]


def _num(x: float) -> str:
    x = float(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.3e}"


# ---- building the report from an Analysis --------------------------------------------------


def _col(table, name: str, dtype=np.float64) -> np.ndarray:
    """A column as a numpy array with nulls as NaN (or zeros for counts); absent: all NaN."""
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    values = table.column(name).to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=dtype)


def evaluate_rules(steps_table, estimator: str, cfg: ReportConfig) -> list[RuleResult]:
    """Every rule of RULE_NAMES on the steps table of an Analysis."""
    s = _col(steps_table, "step", np.int64)
    column = LOSS_WEIGHT_COLUMN.get(estimator)
    blowup = (rule_blowup(s, _col(steps_table, column), estimator, cfg.blowup_weight) if column else
              RuleResult("blowup", False, None, f"not judged: kldiag tracks the weights of the k3 and k3_is "
                         f"losses, this run uses {estimator}"))
    return [
        blowup,
        rule_nonfinite(s, np.nan_to_num(_col(steps_table, "nonfinite_count")),
                       np.nan_to_num(_col(steps_table, "invalid_count"))),
        rule_blame(s, _col(steps_table, "blame_share"), estimator, cfg.blame_share),
        rule_latent(s, _col(steps_table, "weight_k3_abs_max"), estimator, cfg.blowup_weight),
        rule_mismatch(s, _col(steps_table, "mismatch_kl"), _col(steps_table, "drift_abs_mean"), cfg.mismatch_kl),
    ]


def first_alert(alerts_table) -> tuple[int, str, str] | None:
    """(step, metric, message) of the earliest alert: the metric that moved first."""
    if alerts_table is None or alerts_table.num_rows == 0:
        return None
    rows = alerts_table.select(["step", "metric", "message"]).to_pylist()
    first = min(rows, key=lambda r: r["step"])
    return int(first["step"]), str(first["metric"]), str(first["message"])


def _weighted_mean(values: np.ndarray, tokens: np.ndarray) -> float:
    ok = np.isfinite(values) & (tokens > 0)
    return float(np.sum(values[ok] * tokens[ok]) / np.sum(tokens[ok])) if ok.any() else math.nan


def comparison(steps_table) -> list[dict[str, Any]]:
    """The estimators on the run's own tokens: mean value, its worst step, and max |weight|."""
    tokens = _col(steps_table, "tokens")
    rows = []
    for name in ("k1", "k2", "k3", "k3_is"):
        mean = _col(steps_table, f"{name}_mean")
        row = {"estimator": name, "mean": _weighted_mean(mean, tokens),
               "worst_step_mean": float(np.nanmax(mean)) if np.isfinite(mean).any() else math.nan,
               "weight_max": math.nan, "weight_p99": math.nan, "target": E.ESTIMATORS[name].target}
        if name == "k1":
            row["weight_max"] = row["weight_p99"] = 1.0
        if name in LOSS_WEIGHT_COLUMN:
            row["weight_max"] = float(np.nanmax(_col(steps_table, f"weight_{name}_abs_max"), initial=0.0))
            row["weight_p99"] = float(np.nanmax(_col(steps_table, f"weight_{name}_abs_p99"), initial=0.0))
        rows.append(row)
    return rows


def _contexts(run_dir: Path, seqs: list[int]) -> dict[int, dict[int, int | None]]:
    """seq -> {pos: token_id} for the given sequences, streamed from the run's parts."""
    import pyarrow.compute as pc

    from kldiag.format import open_run

    out: dict[int, dict[int, int | None]] = {s: {} for s in seqs}
    wanted = np.asarray(seqs, dtype=np.int64)
    for batch in open_run(run_dir).iter_batches(columns=["seq", "pos", "token_id"]):
        hit = batch.filter(pc.is_in(batch.column(0), value_set=wanted))
        for seq, pos, tok in zip(*(hit.column(i).to_pylist() for i in range(3))):
            out[seq][pos] = tok
    return out


def offenders(analysis, limit: int, context: int) -> list[Offender]:
    """The tokens with the largest |k3 weight|, with `context` tokens on each side."""
    flags = analysis.flags
    if flags.num_rows == 0:
        return []
    w = np.abs(np.nan_to_num(_col(flags, "weight_k3"), nan=0.0))
    order = np.argsort(-w, kind="stable")[:limit]
    rows = [flags.slice(int(i), 1).to_pylist()[0] for i in order]
    from kldiag.format import open_run

    vocab = open_run(analysis.run_dir).vocab() or {}
    seq_tokens = _contexts(analysis.run_dir, sorted({r["seq"] for r in rows}))
    piece = lambda t: "?" if t is None else vocab.get(t, f"<{t}>")
    out = []
    for r in rows:
        toks = seq_tokens.get(r["seq"], {})
        before = [piece(toks[p]) for p in range(r["pos"] - context, r["pos"]) if p in toks]
        after = [piece(toks[p]) for p in range(r["pos"] + 1, r["pos"] + 1 + context) if p in toks]
        text = r.get("piece") or piece(r.get("token_id"))
        out.append(Offender(int(r["step"]), int(r["seq"]), int(r["pos"]), text, before, after,
                            float(r["weight_k3"]), float(r["weight_k3_is"]), float(r["d"])))
    return out


def build_report(analysis, config: ReportConfig = ReportConfig()) -> Report:
    """The post-mortem of one analysed run (see the module docstring for the rules)."""
    manifest_cfg = analysis.manifest.config or {}
    estimator = manifest_cfg.get("estimator") or DEFAULT_ESTIMATOR
    steps = analysis.steps
    rules = evaluate_rules(steps, estimator, config)
    by_name = {r.name: r for r in rules}
    facts = {
        "steps": steps.num_rows, "tokens": int(np.nansum(_col(steps, "tokens"))),
        "beta": manifest_cfg.get("beta"), "rho_max": float(np.nanmax(_col(steps, "rho_max"), initial=0.0)),
        "opsm_masked_frac": float(np.nanmean(_col(steps, "opsm_masked_frac"))) if steps.num_rows else 0.0,
        "nonfinite_step": by_name["nonfinite"].step,
        "flagged_tokens": int(np.nansum(_col(steps, "weight_blowup_count"))),
        "blowup_weight": config.blowup_weight,
    }
    fired = {r.name for r in rules if r.fired}
    onset = by_name["blowup"].step if "blowup" in fired else by_name["nonfinite"].step
    return Report(Path(analysis.run_dir), estimator, not manifest_cfg.get("estimator"), verdict(rules), rules,
                  onset, first_alert(analysis.alerts), offenders(analysis, config.top_tokens, config.context),
                  comparison(steps), recommendations(fired, estimator, facts), facts, analysis)


# ---- rendering -----------------------------------------------------------------------------


def printable(piece: str) -> str:
    """Token text safe for a terminal: control characters (ANSI escapes included) as \\x.. escapes."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in piece)


def format_text(rep: Report) -> str:
    """The short stdout summary."""
    f = rep.facts
    assumed = " (assumed: the manifest does not say)" if rep.estimator_assumed else ""
    lines = [(f"kldiag report: {rep.run_dir}  (loss {rep.estimator}{assumed}, beta {f['beta']}, "
              f"{f['steps']} steps, {f['tokens']} tokens)"),
             f"verdict: {rep.verdict.upper()}" + (f"  onset at step {rep.onset_step}" if rep.onset_step is not None
                                                  else "")]
    if rep.first_moved:
        lines.append(f"first to move: {rep.first_moved[1]} at step {rep.first_moved[0]} ({rep.first_moved[2]})")
    lines += [f"  [{'FIRED' if r.fired else 'ok':5s}] {r.name:9s} {r.message}" for r in rep.rules]
    if rep.offenders:
        lines.append("top offending tokens (largest |k3 weight|):")
    for o in rep.offenders[:5]:
        ctx = printable("".join(o.before)) + "[" + printable(o.piece) + "]" + printable("".join(o.after))
        lines.append(f"  step {o.step:5d} seq {o.seq} pos {o.pos}: |k3 w| {_num(abs(o.weight_k3))}  "
                     f"|k3_is w| {_num(abs(o.weight_k3_is))}  pi_ref/pi_theta = e^{o.d:.1f}  {ctx}")
    lines.append("estimators on this run's tokens: " + "; ".join(
        f"{c['estimator']} mean {_num(c['mean'])} max|w| {_num(c['weight_max'])}" for c in rep.comparison
        if c["estimator"] != "k1"))
    lines += ["recommendations:"] + [f"  - {r}" for r in rep.recommendations]
    return "\n".join(lines)


def figures(rep: Report) -> list[Any]:
    """Plotly figures: loss weights, flagged tokens, KL values, off-policy signals, per step."""
    import plotly.graph_objects as go

    s = rep.analysis.steps
    x = _col(s, "step", np.int64)

    def fig(title: str, names: list[str], log: bool, ytitle: str) -> Any:
        f = go.Figure([go.Scatter(x=x, y=_col(s, n), name=n, mode="lines") for n in names if n in s.column_names])
        f.update_layout(title=title, xaxis_title="step", yaxis_title=ytitle, height=340,
                        margin={"l": 60, "r": 20, "t": 50, "b": 40}, yaxis_type="log" if log else "linear")
        if rep.onset_step is not None:
            f.add_vline(x=rep.onset_step, line_dash="dash", line_color="red", annotation_text="onset")
        return f

    w = fig("Max |gradient weight| per step (K3: 1 - pi_ref/pi_theta; k3_is: rho log(pi_theta/pi_ref))",
            ["weight_k3_abs_max", "weight_k3_is_abs_max", "weight_k3_abs_p99"], True, "|weight|")
    w.add_hline(y=rep.facts["blowup_weight"], line_dash="dot", annotation_text="blow-up limit")
    return [w,
            fig("Flagged tokens per step", ["weight_blowup_count", "theta_ll_ref_count", "clamp_saturated_count",
                                            "nonfinite_count"], False, "tokens"),
            fig("KL estimates per step (token means)", ["k2_mean", "k3_mean", "k3_is_mean"], True, "value"),
            fig("Off-policy: rho and sampler mismatch", ["rho_max", "mismatch_kl", "drift_abs_mean",
                                                         "opsm_masked_frac"], True, "value")]


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
.v-healthy{color:#1a7f37}.v-warning{color:#9a6700}.v-unstable{color:#cf222e}code{background:#f4f4f4}
mark{background:#ffd7d5;font-weight:bold}.ctx{font-family:monospace;white-space:pre}"""


def _table(header: list[str], rows: list[list[str]]) -> str:
    """An HTML table; every cell is escaped here (cells are plain text)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _offender_rows(rep: Report) -> str:
    rows = []
    for o in rep.offenders:
        ctx = (html.escape("".join(o.before)) + "<mark>" + html.escape(o.piece) + "</mark>"
               + html.escape("".join(o.after)))
        cells = [str(o.step), str(o.seq), str(o.pos), _num(o.weight_k3), _num(o.weight_k3_is), f"{o.d:.2f}"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + f"<td class=ctx>{ctx}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("step", "seq", "pos", "k3 weight", "k3_is weight",
                                             "d = log(pi_ref/pi_theta)", "in context"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def render_html(rep: Report) -> str:
    """One self-contained HTML page: Plotly's JavaScript is embedded once, with the first figure."""
    import plotly.io as pio

    figs = figures(rep) if rep.analysis is not None and rep.analysis.steps.num_rows else []
    plots = "".join(pio.to_html(f, full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs))
    e, f = html.escape, rep.facts
    first = (f"<p>First metric to leave its recent range: <b>{e(rep.first_moved[1])}</b> at step "
             f"{rep.first_moved[0]}: {e(rep.first_moved[2])}</p>" if rep.first_moved else "")
    onset = f" &middot; onset at step <b>{rep.onset_step}</b>" if rep.onset_step is not None else ""
    comp = _table(["estimator", "mean value", "worst step mean", "max |weight|", "p99 |weight| (worst step)",
                   "expected gradient"], [[c["estimator"], _num(c["mean"]), _num(c["worst_step_mean"]),
                                           _num(c["weight_max"]), _num(c["weight_p99"]), c["target"]]
                                          for c in rep.comparison])
    rules = _table(["rule", "fired", "first step", "finding"],
                   [[r.name, "yes" if r.fired else "no", "" if r.step is None else r.step, r.message]
                    for r in rep.rules])
    recs = "".join(f"<li>{e(r)}</li>" for r in rep.recommendations)
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kldiag report: {e(rep.run_dir.name)}"
            f"</title><style>{_CSS}</style></head><body><h1>kldiag report: {e(str(rep.run_dir))}</h1>"
            f"<p>KL loss <code>{e(rep.estimator)}</code>{' (assumed)' if rep.estimator_assumed else ''}, beta "
            f"{e(str(f['beta']))}, {f['steps']} steps, {f['tokens']} tokens</p>"
            f"<h2 class='v-{e(rep.verdict)}'>Verdict: {e(rep.verdict.upper())}{onset}</h2>{first}{rules}"
            f"<h2>Recommendations</h2><ul>{recs}</ul><h2>Per step</h2>{plots}"
            f"<h2>Top offending tokens</h2>{_offender_rows(rep)}"
            f"<h2>Estimators on this run's tokens</h2>{comp}</body></html>")


def write_html(rep: Report, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(rep), encoding="utf-8")
    return path


# ---- command line --------------------------------------------------------------------------


def _rules_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_rules(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run(args: argparse.Namespace, analyze: Callable[..., Any] | None = None) -> int:
    import kldiag

    analysis = (analyze or kldiag.analyze)(args.run_dir)
    cfg = ReportConfig(blowup_weight=args.blowup_weight, mismatch_kl=args.mismatch_kl)
    rep = build_report(analysis, cfg)
    path = write_html(rep, args.output)
    print(format_text(rep))
    print(f"report: {path}")
    code = exit_code(rep, args.fail_on)
    if code:
        print(f"kldiag report: failing on {', '.join(sorted(rep.fired() & set(args.fail_on)))}", file=sys.stderr)
    return code


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="post-mortem of a run: HTML report, verdict, exit code for CI",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by kldiag.Recorder")
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default ./report.html)")
    p.add_argument("--fail-on", type=_rules_arg, default=(), metavar="RULES",
                   help=f"comma list of rules ({', '.join(RULE_NAMES)}) or 'all': exit 1 when one fires")
    p.add_argument("--blowup-weight", type=float, default=ReportConfig.blowup_weight,
                   help="|gradient weight| of the loss beyond which a token is a blow-up (default 100)")
    p.add_argument("--mismatch-kl", type=float, default=ReportConfig.mismatch_kl,
                   help="mean KL(pi_old||mu) per token above which mismatch can dominate (default 0.01)")
    p.set_defaults(func=run)
