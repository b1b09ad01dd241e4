"""What a page leads with, and what it says instead of a figure the run did not measure.

A run without logp_ref, sampler log-probs, routes of one side, advantages, versions or top-k lists must
never show 0, 100%, nan or a green all-clear for what it did not record: the faces (dashboard pages, the
report) ask here for the sentence that names the missing column and how to record it, and for whether a
green "all is well" may be shown next to the run's verdict. No Streamlit.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from kldiag.analysis.reducers.mismatch_tokens import MismatchTokensReducer
from kldiag.analysis.runtime.runner import reduced

# column -> how to record it (what a face says after "needs <column>")
HOW_TO_RECORD = {
    "logp_ref": "record the reference model's log-probs (logp_ref= in Recorder.record; the TRL hook records "
                "them when beta > 0)",
    "logp_sampler": "record the inference engine's log-probs of the sampled tokens (logp_sampler=; vLLM and "
                    "SGLang return them with the completion)",
    "logp_old": "record the behaviour policy's log-probs (logp_old=)",
    "advantage": "record the per-token advantages (advantage= in Recorder.record)",
    "policy_version": "record the weight version that generated each sequence (policy_version=)",
    "topk": "record both sides' top-k lists (topk_ids=, topk_logp= and their _sampler twins)",
    "turn": "record each token's turn index (turn=)",
    "entropy": "record each token's entropy under the policy (entropy=)",
    "task": "record each sequence's task label (task=)",
    "routes_engine": "record the engine's routes too (experts_sampler= in Recorder.record)",
    "routes_trainer": "record the trainer's routes (experts= in Recorder.record; the TRL hook captures them)",
}
# the coverage table's inputs (kldiag.analysis.reducers.coverage_table) in words, and the HOW_TO_RECORD key of each
INPUT_NAMES = {"logp_sampler": "engine log-probs (logp_sampler)", "logp_ref": "reference log-probs (logp_ref)",
               "logp_old": "behaviour log-probs (logp_old)", "routes_trainer": "trainer routes",
               "routes_engine": "engine routes", "policy_version": "weight versions (policy_version)",
               "advantage": "advantages", "entropy": "entropy", "turn": "turns", "task": "task labels",
               "topk_trainer": "trainer top-k lists", "topk_engine": "engine top-k lists"}
HOW = {"routes_trainer": "routes_trainer", "routes_engine": "routes_engine", "topk_trainer": "topk",
       "topk_engine": "topk"}
ROUTING_CAUSES = ("routing_replay_broken", "moe_routing_mismatch")
ENGINE_PREFIX = "engine_"


def needs(what: str, column: str, plural: bool = False) -> str:
    """'<what> needs <column>, which this run did not record: <how>.' ('need' for a plural `what`)."""
    how = HOW_TO_RECORD.get(column, f"record {column}")
    return f"{what} {'need' if plural else 'needs'} {column}, which this run did not record: {how}."


def shown(value: Any, spec: str = ".3g") -> str:
    """A tile's text: the value formatted, or 'n/a' for None, NaN or inf (never the word nan)."""
    if value is None:
        return "n/a"
    try:
        v = float(value)
    except (TypeError, ValueError):
        return str(value)
    return format(v, spec) if math.isfinite(v) else "n/a"


def routing_causes(diagnosis) -> list:
    """The verdict's routing causes (most severe first, as the diagnosis orders them)."""
    return [c for c in diagnosis.causes if c.cause in ROUTING_CAUSES]


def engine_causes(diagnosis) -> list:
    return [c for c in diagnosis.causes if c.cause.startswith(ENGINE_PREFIX)]


def all_clear_allowed(diagnosis) -> bool:
    """A green all-clear may stand only beside a healthy verdict: any cause or warning episode forbids it."""
    return diagnosis.verdict == "healthy"


def parity_note(diagnosis) -> tuple[str, str] | None:
    """(kind, text) under the parity figures when no engine cause is listed: 'success' only on a healthy
    verdict; under a routing cause, 'warning' that the mismatch is the routing's (the temperature fit reads
    it as a flatter engine); otherwise 'info' that the engine is not the verdict's cause. None when the
    verdict lists engine causes (the page lists them)."""
    if engine_causes(diagnosis):
        return None
    routed = routing_causes(diagnosis)
    if routed:
        return ("warning", f"The engine/trainer mismatch is carried by MoE routing ({', '.join(c.cause for c in routed)}"
                           ", see the MoE routing section): the implied temperature and the fit residual read "
                           "tokens routed to other experts as a flatter engine, not a sampling temperature.")
    if all_clear_allowed(diagnosis):
        return ("success", "The engine and the trainer agree on the sampled tokens up to float noise.")
    return ("info", f"No engine cause in the verdict ({diagnosis.verdict}); the causes above name what is wrong.")


def _last(steps, column: str) -> float | None:
    """The column's last non-null value in a steps table (None: none)."""
    if column not in steps:
        return None
    v = steps[column].dropna()
    return float(v.iloc[-1]) if len(v) else None


def _max(steps, column: str) -> float | None:
    if column not in steps:
        return None
    v = steps[column].dropna()
    return float(v.max()) if len(v) else None


def overview_tiles(headline: dict, steps, routing: dict | None) -> list[tuple[str, str, str]]:
    """(label, value, help) of the Overview's five figure tiles after Steps and Tokens. A run with logp_ref: its
    KL, weights and flagged share; one without: what it measured instead (engine mismatch, rho, drift, routing),
    and the flagged share as n/a with what it needs. Never the text 'nan'."""
    if _last(steps, "k3_mean") is not None:
        return [("Latest k3 mean", shown(headline.get("k3_mean")), "KL(pi_theta || pi_ref) per token, k3"),
                ("Latest k3_is mean", shown(headline.get("k3_is_mean")), "k3 with the importance ratio rho"),
                ("Max |k3 weight|", shown(headline.get("weight_k3_abs_max")), "the largest per-token gradient weight"),
                ("Max |k3_is weight|", shown(headline.get("weight_k3_is_abs_max")), ""),
                ("Flagged tokens", shown(headline.get("flagged_frac"), ".3%"), "")]
    mism = _last(steps, "mismatch_kl")
    tiles = [("Latest KL(mu||pi_old)", shown(mism),
              "engine mismatch per token, nats" if mism is not None else needs("the engine mismatch", "logp_sampler")),
             ("Max rho", shown(_max(steps, "rho_max")), "rho = pi_theta/pi_old, largest over the run"),
             ("Latest drift |log pi_theta/pi_old|", shown(_last(steps, "drift_abs_mean")), "nats per token")]
    if routing and routing.get("routed"):
        share = routing.get("differ_share")
        tiles.append(("Routed differently", shown(share, ".2%"),
                      "share of routed tokens whose expert set differs between engine and trainer" if share is not None
                      else needs("routing agreement", "routes_engine")))
    else:
        tiles.append(("Latest rho clip fraction", shown(_last(steps, "rho_clip_frac"), ".2%"),
                      "tokens outside the PPO clip range"))
    tiles.append(("Flagged tokens", "n/a", needs("the token flags (theta_ll_ref, weight_blowup, clamp_saturated)",
                                                 "logp_ref", plural=True)))
    return tiles


TOKEN_COLUMNS = {"step": "step", "seq": "seq", "pos": "pos", "piece": "token", "mismatch": "log pi_old/mu",
                 "logp_old": "log pi_old", "logp_sampler": "log mu", "route_differ": "layers routed differently",
                 "route_layers": "MoE layers"}


def token_tables(analysis, vocab: dict | None = None) -> dict[str, Any]:
    """The Tokens page's lists for a run without flags: {"largest": the tokens with the largest |log pi_old/mu|,
    "routed": the tokens the engine routed to other experts} as DataFrames (TOKEN_COLUMNS; the routing columns
    only on a routed run), each read with the analysis (kldiag.analysis.reducers.mismatch_tokens)."""
    red = MismatchTokensReducer()
    out = {}
    for name, rows in red.result(reduced(analysis, red)).items():
        df = pd.DataFrame(rows)
        df["piece"] = [(vocab or {}).get(int(t), f"<{int(t)}>") if t >= 0 else "<?>" for t in df["token_id"]]
        cols = [c for c in TOKEN_COLUMNS if not (c.startswith("route") and not (df["route_layers"] > 0).any())]
        out[name] = df[cols].rename(columns=TOKEN_COLUMNS)
    return out


def how_to_record(name: str) -> str:
    """How to record a coverage input (`HOW_TO_RECORD` by its column)."""
    return HOW_TO_RECORD.get(HOW.get(name, name), f"record {name}")


def coverage_frame(cov: dict[str, Any]) -> pd.DataFrame:
    """The coverage table for display: one row per input, on how many steps it is present, its share of the
    loss tokens, and how to record it where no step has it."""
    rows = [{"input": INPUT_NAMES[k], "steps": f"{v['steps']:,} of {v['of']:,}",
             "share of tokens": shown(v["token_share"], ".1%"),
             "how to record": "" if v["steps"] else how_to_record(k)} for k, v in cov["inputs"].items()]
    return pd.DataFrame(rows)


def first_measured(lists: dict[str, pd.DataFrame]) -> tuple[int, int] | None:
    """(step, seq) a run without pi_ref opens the Sequence page on: the sequence of the token routed differently
    with the largest mismatch, else of the token with the largest mismatch (token_tables); None when neither."""
    for name in ("routed", "largest"):
        df = lists.get(name)
        if df is not None and not df.empty:
            return int(df["step"].iloc[0]), int(df["seq"].iloc[0])
    return None
