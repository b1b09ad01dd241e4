"""`mixed_version_rollout` without version stamps: a jump of |log mu - log pi_old| inside the sequences.

A run that records no per-token versions (none, or one per sequence) cannot say which sequences straddle a weight
update; what it shows is the effect: from some position on, a sequence's engine/trainer mismatch steps up and
stays up (the new weights over the old KV cache). On the parity fit set (kldiag.mismatch.parity.tokens_for), per
sequence over its tokens in the loss with both log-probs, x_t = |log mu - log pi_old|, the split k (both sides at
least `min_side` tokens) of largest

    t = (mean(y[k:]) - mean(y[:k])) / (sd * sqrt(1/k + 1/(L - k)))     y = log(x + 1e-3), sd pooled within sides

(the log makes the engine's heavy-tailed |D| a shift of location with a steady spread).
A sequence jumps when t >= `t_min`, mean(x[k:]) >= `ratio` x mean(x[:k]) and the step is at least `min_excess`
nats. The cause needs `min_share` of the sequences (and `min_sequences`) to jump; onset: the first sustained step
(DiagnosisConfig.persistence) where `min_share` of its sequences jump. kldiag's own thresholds (docs/metrics.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.analysis.core import keyed
from kldiag.analysis.rules import episodes as EP

LOG_FLOOR = 1e-3  # nats: |D| below this (float noise) counts as this


@dataclass(frozen=True)
class JumpConfig:
    min_side: int = 8  # tokens on each side of the split
    t_min: float = 6.0  # the split's t statistic ...
    ratio: float = 3.0  # ... the level after over the level before ...
    min_excess: float = 0.01  # ... and the step in nats (float noise)
    min_share: float = 0.05  # share of the sequences that jump
    min_sequences: int = 5
    examples: int = 5


def sequence_jumps(step: np.ndarray, seq: np.ndarray, pos: np.ndarray, x: np.ndarray,
                   cfg: JumpConfig = JumpConfig()) -> dict[str, np.ndarray]:
    """Per sequence [Q] of the rows (sorted by step, seq, pos; x finite): step, seq, tokens, the best split's t
    (on log(x + LOG_FLOOR)), position, mean x before and after it, the sequence's mean x, and whether it jumps
    (module docstring)."""
    starts = keyed.segment_starts([step, seq]) if len(step) else np.zeros(0, np.int64)
    lengths = np.diff(np.append(starts, len(step)))
    owner = np.repeat(np.arange(len(starts)), lengths)
    k = np.arange(len(step)) - starts[owner]  # tokens before this row in its sequence
    t, _, _ = _split(np.log(x + LOG_FLOOR), starts, lengths, owner, k, cfg.min_side)
    _, before, after = _split(x, starts, lengths, owner, k, cfg.min_side)
    best = _argmax_per_run(t, starts, lengths)
    total = np.add.reduceat(x, starts) if len(starts) else np.zeros(0)
    out = {"step": step[starts], "seq": seq[starts], "tokens": lengths, "t": t[best], "pos": pos[best],
           "before": before[best], "after": after[best], "mean": total / np.maximum(lengths, 1)}
    with np.errstate(invalid="ignore"):
        out["jumps"] = ((out["t"] >= cfg.t_min) & (out["after"] >= cfg.ratio * out["before"])
                        & (out["after"] - out["before"] >= cfg.min_excess))
    return out


def _split(y: np.ndarray, starts: np.ndarray, lengths: np.ndarray, owner: np.ndarray, k: np.ndarray,
           min_side: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row, splitting its sequence before it: (t, mean before, mean after), t -inf where a side is short."""
    L = lengths[owner]
    csum, csum2 = np.cumsum(y) - y, np.cumsum(y * y) - y * y  # sums of the rows before, run-wide
    b_sum, b_sq = csum - csum[starts][owner], csum2 - csum2[starts][owner]
    tot = np.add.reduceat(y, starts)[owner] if len(starts) else np.zeros(0)
    tot_sq = np.add.reduceat(y * y, starts)[owner] if len(starts) else np.zeros(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        before, after = b_sum / np.maximum(k, 1), (tot - b_sum) / np.maximum(L - k, 1)
        # the pooled sd within the two sides: the jump itself does not inflate it
        ss = (b_sq - k * before ** 2) + (tot_sq - b_sq - (L - k) * after ** 2)
        sd = np.sqrt(np.maximum(ss, 0.0) / np.maximum(L - 2, 1))
        ok = (k >= min_side) & (L - k >= min_side) & (sd > 0)
        t = np.where(ok, (after - before) / (sd * np.sqrt(1.0 / np.maximum(k, 1) + 1.0 / np.maximum(L - k, 1))),
                     -np.inf)
    return t, before, after


def _argmax_per_run(v: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The row of each run's maximum (its first, on ties)."""
    if not len(starts):
        return np.zeros(0, np.int64)
    top = np.maximum.reduceat(v, starts)
    hit = v == np.repeat(top, lengths)
    idx = np.flatnonzero(hit)
    first = np.searchsorted(idx, starts)
    return idx[np.minimum(first, len(idx) - 1)]


def jump_evidence(ts, dcfg, cfg: JumpConfig = JumpConfig()) -> tuple[int | None, dict] | None:
    """(onset, evidence) when enough sequences of the token set jump, else None."""
    ok = ts.mask & np.isfinite(ts.logp_sampler) & np.isfinite(ts.logp_old)
    if ok.sum() < 2 * cfg.min_side:
        return None
    sj = sequence_jumps(ts.step[ok], ts.seq[ok], ts.pos[ok], np.abs(ts.logp_sampler[ok] - ts.logp_old[ok]), cfg)
    jumps = sj["jumps"]
    if jumps.sum() < cfg.min_sequences or jumps.mean() < cfg.min_share:
        return None
    steps, idx = np.unique(sj["step"], return_inverse=True)
    share = np.bincount(idx, weights=jumps, minlength=len(steps)) / np.bincount(idx, minlength=len(steps))
    onset = EP.first_sustained(steps, share >= cfg.min_share, dcfg)
    if onset is None:
        return None
    j = np.flatnonzero(jumps)
    rest = ~jumps
    w = sj["tokens"].astype(np.float64)
    ev = {"stamps": "none: a within-sequence jump of |log mu - log pi_old|", "sequences": int(len(jumps)),
          "jumping_sequences": int(jumps.sum()), "jump_share": float(jumps.mean()),
          "level_before_jump": float(np.mean(sj["before"][j])), "level_after_jump": float(np.mean(sj["after"][j])),
          "level_other_sequences": float(np.average(sj["mean"][rest], weights=w[rest])) if rest.any() else None,
          "jump_position_median": float(np.median(sj["pos"][j])), "t_median": float(np.median(sj["t"][j])),
          "t_min": cfg.t_min, "ratio_threshold": cfg.ratio, "share_threshold": cfg.min_share,
          "examples": [{"step": int(sj["step"][i]), "seq": int(sj["seq"][i]), "pos": int(sj["pos"][i]),
                        "before": float(sj["before"][i]), "after": float(sj["after"][i])} for i in j[:cfg.examples]]}
    return onset, ev
