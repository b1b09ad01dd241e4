"""The report's content: the analysis, the diagnosis and the worst tokens of one run, as a `Report`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kldiag import estimators as E

# The per-step column holding the max |gradient weight| of each KL loss a trainer uses.
LOSS_WEIGHT_COLUMN = {"k3": "weight_k3_abs_max", "k3_is": "weight_k3_is_abs_max"}
DEFAULT_ESTIMATOR = "k3"  # verl's and OpenRLHF's, and TRL's with use_bias_correction_kl=False


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
    run_dir: Path | str  # a Path, or the URI of a remote run
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
    diagnosis: Any = None  # kldiag.diagnosis.Diagnosis: the verdict and the causes, with fixes

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
        return RuleResult("blowup", False, None, f"max |{estimator} weight| {fmt_num(w.max(initial=0))} "
                          f"stays below {fmt_num(limit)}")
    peak = int(np.argmax(w))
    return RuleResult("blowup", True, step, f"|{estimator} weight| exceeds {fmt_num(limit)} from step {step}, "
                      f"up to {fmt_num(w[peak])} at step {int(steps[peak])}")


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
        return RuleResult("latent", False, None, f"K3's weights stay below {fmt_num(limit)} on this run's tokens")
    whose = "this run's loss" if estimator == "k3" else f"K3 (not this run's loss, {estimator})"
    return RuleResult("latent", True, step, f"the weight of {whose} reaches {fmt_num(w.max())} on this run's "
                      f"tokens, from step {step}")


def rule_mismatch(steps, mismatch_kl, drift_abs_mean, limit: float) -> RuleResult:
    """Mismatch dominates when its KL passes `limit` and its typical log-ratio, sqrt(2 KL)
    (k3 ~ x^2/2 for small x), exceeds the policy drift mean |log pi_theta - log pi_old|."""
    kl = np.asarray(mismatch_kl, dtype=np.float64)
    drift = np.asarray(drift_abs_mean, dtype=np.float64)
    if not np.any(np.isfinite(kl) & (kl > 0)):
        return RuleResult("mismatch", False, None, "no sampler log-probs recorded (logp_sampler): "
                          "mismatch unknown")
    mean_kl = float(np.nanmean(kl))
    mean_drift = float(np.nanmean(drift)) if np.any(np.isfinite(drift)) else 0.0
    fired = mean_kl > limit and math.sqrt(2 * mean_kl) > mean_drift
    step = first_step(steps, np.nan_to_num(kl) > limit) if fired else None
    verb = "dominates" if fired else "does not dominate"
    return RuleResult("mismatch", fired, step, f"sampler/trainer mismatch {verb}: mean KL(mu||pi_old) "
                      f"{mean_kl:.3g} per token (|log ratio| ~ {math.sqrt(2 * mean_kl):.3g}) vs policy drift "
                      f"|log pi_theta/pi_old| {mean_drift:.3g} (limit {limit:g})")


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
                   f"{fmt_num(facts.get('rho_max', math.nan))}): reduce staleness (fewer steps between "
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


def fmt_weight_max(row: dict[str, Any]) -> str:
    return ("<= " if row.get("weight_bound") else "") + fmt_num(row["weight_max"])


def fmt_num(x: float) -> str:
    """3 significant digits; NaN (a metric the run cannot give) as n/a, infinities as inf."""
    x = float(x)
    if math.isnan(x):
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.3e}"


# ---- building the report from an Analysis --------------------------------------------------


def column(table, name: str, dtype=np.float64) -> np.ndarray:
    """A column as a numpy array with nulls as NaN (or zeros for counts); absent: all NaN."""
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    values = table.column(name).to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=dtype)


def evaluate_rules(steps_table, estimator: str, cfg: ReportConfig) -> list[RuleResult]:
    """Every rule of RULE_NAMES on the steps table of an Analysis."""
    s = column(steps_table, "step", np.int64)
    weight_col = LOSS_WEIGHT_COLUMN.get(estimator)
    kl_rules = [
        rule_blowup(s, column(steps_table, weight_col), estimator, cfg.blowup_weight) if weight_col else
        RuleResult("blowup", False, None, f"not judged: kldiag tracks the weights of the k3 and k3_is "
                   f"losses, this run uses {estimator}"),
        rule_blame(s, column(steps_table, "blame_share"), estimator, cfg.blame_share),
        rule_latent(s, column(steps_table, "weight_k3_abs_max"), estimator, cfg.blowup_weight),
    ]
    if not has_reference(steps_table):
        kl_rules = [RuleResult(r.name, False, None, "not judged: no reference log-probs (logp_ref) recorded, "
                               "so no KL term") for r in kl_rules]
    nonfinite = rule_nonfinite(s, np.nan_to_num(column(steps_table, "nonfinite_count")),
                               np.nan_to_num(column(steps_table, "invalid_count")))
    mismatch = rule_mismatch(s, column(steps_table, "mismatch_kl"), column(steps_table, "drift_abs_mean"),
                             cfg.mismatch_kl)
    return [kl_rules[0], nonfinite, *kl_rules[1:], mismatch]


def has_reference(steps_table) -> bool:
    """Whether any token had a reference log-prob (the KL means are null without one)."""
    return bool(np.isfinite(column(steps_table, "k3_mean")).any())


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


def abs_bound(edges: np.ndarray, counts: np.ndarray) -> float:
    """An upper bound of |v| over a histogram (Histograms layout: bin 0 below edges[0], bin i
    in [edges[i-1], edges[i]), the last one at or above edges[-1]); 0 when it is empty."""
    lo = np.concatenate([[-np.inf], edges])
    hi = np.concatenate([edges, [np.inf]])
    used = np.flatnonzero(np.asarray(counts).reshape(-1, len(edges) + 1).sum(0))
    return float(np.max(np.maximum(np.abs(lo[used]), np.abs(hi[used])))) if len(used) else 0.0


def comparison(steps_table, histograms=None) -> list[dict[str, Any]]:
    """The estimators on the run's own tokens: mean value, its worst step, and max |weight|.

    k2's weight is s - r = -d: bounded here from the run's histogram of d (bin precision).
    """
    tokens = column(steps_table, "tokens")
    rows = []
    for name in ("k1", "k2", "k3", "k3_is"):
        mean = column(steps_table, f"{name}_mean")
        row = {"estimator": name, "mean": _weighted_mean(mean, tokens),
               "worst_step_mean": float(np.nanmax(mean)) if np.isfinite(mean).any() else math.nan,
               "weight_max": math.nan, "weight_p99": math.nan, "target": E.ESTIMATORS[name].target}
        if name == "k1":
            row["weight_max"] = row["weight_p99"] = 1.0
        if name == "k2" and histograms is not None and "d" in histograms.counts:
            row["weight_max"] = abs_bound(histograms.edges["d"], histograms.counts["d"])
            row["weight_bound"] = True
        if name in LOSS_WEIGHT_COLUMN:
            row["weight_max"] = float(np.nanmax(column(steps_table, f"weight_{name}_abs_max"), initial=0.0))
            row["weight_p99"] = float(np.nanmax(column(steps_table, f"weight_{name}_abs_p99"), initial=0.0))
        rows.append(row)
    return rows


def _contexts(run_dir: Path, seqs: list[int]) -> dict[int, dict[int, int | None]]:
    """seq -> {pos: token_id} for the given sequences, streamed from the run's parts."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from kldiag.format import open_run

    out: dict[int, dict[int, int | None]] = {s: {} for s in seqs}
    wanted = pa.array(seqs, pa.int64())
    for batch in open_run(run_dir).iter_batches(columns=["seq", "pos", "token_id"]):
        hit = batch.filter(pc.is_in(batch.column(0), value_set=wanted))
        for seq, pos, tok in zip(*(hit.column(i).to_pylist() for i in range(3)), strict=True):
            out[seq][pos] = tok
    return out


def offenders(analysis, limit: int, context: int) -> list[Offender]:
    """The tokens with the largest |k3 weight|, with `context` tokens on each side."""
    flags = analysis.flags
    if flags.num_rows == 0:
        return []
    w = np.abs(np.nan_to_num(column(flags, "weight_k3"), nan=0.0))
    order = np.argsort(-w, kind="stable")[:limit]
    rows = [flags.slice(int(i), 1).to_pylist()[0] for i in order]
    from kldiag.format import open_run

    vocab = open_run(analysis.run_dir).vocab() or {}
    seq_tokens = _contexts(analysis.run_dir, sorted({r["seq"] for r in rows}))

    def piece(t: int | None) -> str:
        return "?" if t is None else vocab.get(t, f"<{t}>")

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
        "steps": steps.num_rows, "tokens": int(np.nansum(column(steps, "tokens"))),
        "beta": manifest_cfg.get("beta"), "rho_max": float(np.nanmax(column(steps, "rho_max"), initial=0.0)),
        "opsm_masked_frac": float(np.nanmean(column(steps, "opsm_masked_frac"))) if steps.num_rows else 0.0,
        "nonfinite_step": by_name["nonfinite"].step,
        "flagged_tokens": int(np.nansum(column(steps, "weight_blowup_count"))),
        "blowup_weight": config.blowup_weight,
    }
    fired = {r.name for r in rules if r.fired}
    onset = by_name["blowup"].step if "blowup" in fired else by_name["nonfinite"].step
    from kldiag.diagnosis import DiagnosisConfig, diagnose  # the verdict of analyze, watch and the dashboard

    dg = diagnose(analysis, DiagnosisConfig(blowup_weight=config.blowup_weight, blame_share=config.blame_share,
                                            mismatch_kl=config.mismatch_kl))
    return Report(analysis.run_dir, estimator, not manifest_cfg.get("estimator"), dg.verdict, rules,
                  onset, first_alert(analysis.alerts), offenders(analysis, config.top_tokens, config.context),
                  comparison(steps, analysis.histograms), recommendations(fired, estimator, facts), facts, analysis,
                  dg)


# ---- command line --------------------------------------------------------------------------
