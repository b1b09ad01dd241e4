"""Cause `engine_retokenization`: the trainer scores other tokens or contexts than the engine generated.

A multi-turn rollout trains on one sequence per trajectory: [prompt | turn 0 | tool | turn 1 | ...].
When the trainer rebuilds that sequence from text (decode, re-apply the chat template, tokenise
again) rather than from the engine's token ids, the ids at a turn boundary can differ ('Hel'+'lo'
comes back as 'Hello'; a template re-renders tool JSON or drops earlier reasoning). Then
pi_old(x_t | x~) is not pi_old(x_t | x) even with identical weights, and log mu - log pi_old is:

    large at the first tokens of turns after the first (the boundary lies just before them),
    fading along the turn (the context difference recedes),
    absent from first turns and from single-turn sequences (no boundary was re-tokenised there).

The detector reads the per-turn figures (kldiag/analysis/reducers/turns.py, `TurnReducer`) and names the cause
when all three hold, sustained over steps; it absorbs the generic engine mismatch it explains (the
built-in rule's figures become its `explained_mismatch` evidence, and `diagnose` drops the
engine-mismatch causes listed in `absorbs`). The fix is each framework's token-in-token-out path
(kldiag/frameworks/turns.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from kldiag import fmt
from kldiag.analysis.reducers import turns as TU
from kldiag.analysis.rules import episodes as EP
from kldiag.analysis.runtime.runner import reduced
from kldiag.diagnosis import causes as C
from kldiag.diagnosis.types import Cause
from kldiag.frameworks.turns import retokenize_fix

NAME = "engine_retokenization"
KL_KEYS = ("mismatch_kl_mean", "mismatch_kl_max", "drift_abs_mean", "dominates_drift", "token_mult_prob_error_median")


@dataclass(frozen=True)
class RetokenizeConfig:
    """When a turn-boundary mismatch is a cause. Every default on one screen."""

    min_start: float = 0.05  # nats: mean |log mu - log pi_old| at later turns' first token, above float noise
    first_turn_ratio: float = 4.0  # later-turn starts at least this x the first turns' (and single-turn) level
    body_ratio: float = 1.5  # later-turn starts at least this x the rest of those turns: largest at the boundary
    min_starts: int = 20  # first tokens of later turns needed (the run's total)


def _mean(a, n) -> float:
    return float(TU.ratio(np.sum(a), np.sum(n)))


def figures(m: dict[str, np.ndarray]) -> dict:
    """The cause's figures from the merged turn partial: mean |log mu - log pi_old| at later turns' first
    token and after it, in first turns (all tokens, and their first token), in single-turn sequences, and
    later turns' profile along the position bins; NaN where there is no token."""
    a, n = np.asarray(m["mismatch_abs"], np.float64), np.asarray(m["n_mismatch"], np.float64)
    return {"later_start": _mean(a[1:, 0], n[1:, 0]), "later_body": _mean(a[1:, 1:], n[1:, 1:]),
            "later_starts": int(n[1:, 0].sum()), "first_turn": _mean(a[0], n[0]),
            "first_turn_start": _mean(a[0, 0], n[0, 0]), "single_turn": _mean(m["single_abs"], m["single_n"]),
            "later_profile": TU.ratio(a[1:].sum(0), n[1:].sum(0))}


def holds(f: dict, cfg: RetokenizeConfig) -> bool:
    """Whether the run-level figures show the pattern: later turns start far above first turns (their
    tokens, and their first token: a turn's start may be harder than its body in any run) and single-turn
    sequences, and above the rest of their own turn."""
    start = f["later_start"]
    if not (f["later_starts"] >= cfg.min_starts and np.isfinite(start) and start > cfg.min_start):
        return False
    quiet = [v for v in (f["first_turn"], f["first_turn_start"], f["single_turn"]) if np.isfinite(v)]
    if any(start < cfg.first_turn_ratio * v for v in quiet):
        return False
    return not np.isfinite(f["later_body"]) or start >= cfg.body_ratio * f["later_body"]


def step_fire(m: dict[str, np.ndarray], cfg: RetokenizeConfig) -> np.ndarray:
    """Per step of m["step"]: its later turns' first tokens are over min_start and first_turn_ratio x its
    first turns' level (all their tokens, and their first tokens)."""
    start = TU.ratio(m["step_start_abs"][:, 1:].sum(1), m["step_start_n"][:, 1:].sum(1))
    first = np.fmax(TU.ratio(m["step_abs"][:, 0], m["step_n"][:, 0]),
                    TU.ratio(m["step_start_abs"][:, 0], m["step_start_n"][:, 0]))
    floor = np.maximum(cfg.min_start, cfg.first_turn_ratio * np.nan_to_num(first))
    return np.nan_to_num(start, nan=-np.inf) > floor


def _examples(m: dict[str, np.ndarray], k: int) -> list[dict]:
    return [{"step": int(m["ex_step"][i]), "seq": int(m["ex_seq"][i]), "rank": int(m["ex_rank"][i]),
             "turn": int(m["ex_turn"][i]), "start_mismatch_abs": float(m["ex_start_abs"][i]),
             "body_mismatch_abs_mean": float(m["ex_body_abs"][i])} for i in range(min(k, len(m["ex_step"])))]


def _evidence(m: dict[str, np.ndarray], f: dict, cfg: RetokenizeConfig, builtin: Cause | None) -> dict:
    s = TU.summary(m)
    per_turn = [{"turn": r["turn"], "tokens": r["tokens"], "start_mismatch_abs_mean": r["start_mismatch_abs_mean"],
                 "body_mismatch_abs_mean": r["body_mismatch_abs_mean"]} for r in s["by_turn"]]
    return {"turn_start_vs_body": per_turn, "first_turn_mismatch_abs_mean": f["first_turn"],
            "first_turn_start_mismatch_abs_mean": f["first_turn_start"],
            "later_turn_start_mismatch_abs_mean": f["later_start"],
            "later_turn_body_mismatch_abs_mean": f["later_body"],
            "single_turn_mismatch_abs_mean": f["single_turn"] if np.isfinite(f["single_turn"]) else None,
            "sequences": s["sequences"],
            "later_turn_mismatch_by_position": dict(zip(TU.POS_LABELS, map(float, f["later_profile"]), strict=True)),
            "examples": _examples(m, 5), "thresholds": dataclasses.asdict(cfg),
            "explained_mismatch": {k: builtin.evidence.get(k) for k in KL_KEYS} if builtin else None}


def _summary(f: dict, onset: int, ex: list[dict]) -> str:
    first = f"{fmt.metric(f['first_turn'])} in first turns"
    if np.isfinite(f["single_turn"]):
        first += f" and {fmt.metric(f['single_turn'])} in single-turn sequences"
    text = (f"the trainer scores other tokens or contexts than the engine generated at turn boundaries: "
            f"|log mu - log pi_old| averages {fmt.metric(f['later_start'])} nats at the first token of turns after "
            f"the first and {fmt.metric(f['later_body'])} in the rest of those turns, against {first}, "
            f"from step {onset}")
    if ex:
        e = ex[0]
        text += (f"; e.g. step {e['step']} seq {e['seq']} turn {e['turn']}: {fmt.metric(e['start_mismatch_abs'])} "
                 "nats at its first token")
    return text + " (a re-tokenised conversation, not the engine's token ids)"


def engine_retokenization(analysis, ctx: C.Context, config: RetokenizeConfig = RetokenizeConfig()) -> list[Cause]:
    """Cause `engine_retokenization` (module docstring); onset: the first sustained step whose later turns
    start over the floor. Absorbs the generic engine mismatch (see `absorbs`)."""
    m = reduced(analysis, TU.TurnReducer())
    if TU.scalar(m["seq_multi"]) == 0:
        return []
    f = figures(m)
    if not holds(f, config):
        return []
    onset = EP.first_sustained(m["step"], step_fire(m, config), ctx.config)
    if onset is None:
        return []
    builtin = C.engine_mismatch(analysis, ctx)
    ev = _evidence(m, f, config, builtin[0] if builtin else None)
    ev["persistence"] = ctx.config.persistence.describe()
    return [Cause(NAME, onset, "warning", ev, retokenize_fix(analysis.manifest), _summary(f, onset, ev["examples"]))]


# the generic engine-mismatch causes a re-tokenisation explains: each would also show in first turns
engine_retokenization.absorbs = ("engine_mismatch", "engine_temperature_mismatch", "engine_precision")
