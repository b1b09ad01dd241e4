"""One step's tokens as the padded [B, T] batch a trainer sees (B sequences, right-padded to T).

Each sequence is counted once (the TokenSet keeps the first reuse iteration unless it was
loaded with all_iterations). Position t of row b is the sequence's t-th recorded token;
padding has mask False and log-probs 0.0, as in the frameworks' padded tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.mismatch.tokenset import TokenSet


@dataclass
class StepBatch:
    """Padded float64 [B, T] arrays of one step; mask bool [B, T]; seq int64 [B]."""

    step: int
    seq: np.ndarray
    mask: np.ndarray
    logp: np.ndarray  # pi_theta (the first update's forward pass)
    logp_old: np.ndarray  # pi_old (the trainer's recompute; pi_theta where not recorded)
    logp_ref: np.ndarray  # NaN where not recorded
    logp_sampler: np.ndarray  # NaN where not recorded
    advantage: np.ndarray
    micro: np.ndarray  # int64 [B]: the micro-batch of each sequence
    iteration: np.ndarray  # int64 [B]

    @property
    def has_sampler(self) -> bool:
        return bool(np.isfinite(self.logp_sampler[self.mask]).all()) and bool(self.mask.any())

    @property
    def nan_sampler(self) -> bool:
        """Some but not all of the trained tokens' sampler log-probs are NaN (the engine gave NaN)."""
        fin = np.isfinite(self.logp_sampler[self.mask])
        return bool(fin.any()) and not bool(fin.all())

    @property
    def has_ref(self) -> bool:
        return bool(np.isfinite(self.logp_ref[self.mask]).all()) and bool(self.mask.any())


def pad(ts: TokenSet, sl: slice, step: int) -> StepBatch:
    """The rows ts[sl] (one step, sorted by seq then pos) as a StepBatch; rows keyed by (seq, iteration)."""
    seq, it = ts.seq[sl], ts.iteration[sl]
    key = seq * 65536 + it
    starts = np.r_[0, np.flatnonzero(np.diff(key)) + 1] if len(key) else np.zeros(0, np.int64)
    lengths = np.diff(np.r_[starts, len(key)])
    b, t = len(starts), int(lengths.max(initial=0))
    row = np.repeat(np.arange(b), lengths)
    col = np.arange(len(key)) - np.repeat(starts, lengths)

    def grid(x: np.ndarray, fill: float) -> np.ndarray:
        out = np.full((b, t), fill, dtype=np.float64)
        out[row, col] = x
        return out

    mask = np.zeros((b, t), bool)
    mask[row, col] = ts.mask[sl]
    return StepBatch(step, seq[starts], mask, grid(ts.logp[sl], 0.0), grid(ts.logp_old[sl], 0.0),
                     grid(ts.logp_ref[sl], np.nan), grid(ts.logp_sampler[sl], np.nan), grid(ts.advantage[sl], 0.0),
                     ts.micro[sl][starts], it[starts])


def batches(ts: TokenSet) -> list[StepBatch]:
    return [pad(ts, sl, step) for step, sl in ts.step_slices()]


def masked_mean(x: np.ndarray, mask: np.ndarray, axis=None, eps: float = 0.0) -> np.ndarray | float:
    """sum(x * mask) / (sum(mask) + eps): verl_F.masked_mean uses eps=1e-8 (NaN for an empty mask at eps 0)."""
    m = mask.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.sum(np.where(mask, x, 0.0), axis=axis) / (np.sum(m, axis=axis) + eps)


def masked_sum(x: np.ndarray, mask: np.ndarray, axis=None) -> np.ndarray | float:
    return np.sum(np.where(mask, x, 0.0), axis=axis)
