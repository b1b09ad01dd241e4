"""verl's KL term as its trainer logs it, recomputed from a run the verl hook recorded.

`actor/kl_loss` (verl 0.9.1, workers/utils/losses.py `ppo_loss` l. 130-140): per micro-batch
kl_loss = agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode,
dp_size, batch_num_tokens, global_batch_size, loss_scale_factor) (core_algos.py l. 1140, 2188),
logged as a Metric with AggregationType.SUM; the worker's train_mini_batch reduces each mini-batch
with `Metric.aggregate_dp` (mean over DP ranks of the sum over micro-batches, utils/metric/utils.py)
and the trainer averages the mini-batches (and PPO epochs) of the step (`reduce_metrics`). So

    actor/kl_loss(step) = sum over (rank, micro-batch) of kl_loss / (dp_size * mini-batches in step)

with batch_num_tokens = the mini-batch's response tokens over all ranks (fsdp transformer_impl.py
l. 730), global_batch_size = its sequences over all ranks, loss_scale_factor None = the micro-batch's
padded response width. The hook writes micro = mini * MICRO_SLOTS + micro-batch, so all of these
come from the rows. low_var_kl clamps the log-ratio to [-20, 20] and the value to [-10, 10]: a token
whose K3 exceeds 10 (pi_ref/pi_theta above about 13.6, or below e^-11) gets no KL gradient;
`clamp_share_by_step` gives the share of tokens and of |K3 gradient weight| (1 - pi_ref/pi_theta,
unclamped) in that dead zone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kldiag.format import open_run
from kldiag.frameworks.verl import MICRO_SLOTS, agg_loss, dead_zone, kl_penalty

COLUMNS = ["step", "micro", "iteration", "rank", "seq", "pos", "logp", "logp_ref", "mask"]
def _micro_batches(t: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """Padded [B, T] arrays per (step, rank, micro), rows sorted by (seq, iteration, pos)."""
    order = np.lexsort((t["pos"], t["iteration"], t["seq"], t["micro"], t["rank"], t["step"]))
    t = {k: v[order] for k, v in t.items()}
    key = np.stack([t["step"], t["rank"], t["micro"]], 1)
    cut = np.r_[0, np.flatnonzero((np.diff(key, axis=0) != 0).any(1)) + 1, len(order)]
    out = []
    for a, b in zip(cut[:-1], cut[1:], strict=True):
        row_key = t["seq"][a:b] * 65536 + t["iteration"][a:b]
        starts = np.r_[0, np.flatnonzero(np.diff(row_key)) + 1]
        row = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, b - a]))
        width = int(t["pos"][a:b].max()) + 1
        pad = {k: np.zeros((len(starts), width)) for k in ("logp", "logp_ref")}
        mask = np.zeros((len(starts), width), bool)
        for k in pad:
            pad[k][row, t["pos"][a:b]] = t[k][a:b]
        mask[row, t["pos"][a:b]] = t["mask"][a:b]
        out.append({"step": int(t["step"][a]), "rank": int(t["rank"][a]), "mini": int(t["micro"][a]) // MICRO_SLOTS,
                    "mask": mask, **pad})
    return out


def _read(run: Any) -> tuple[dict[str, np.ndarray], Any]:
    r = open_run(run) if isinstance(run, (str, bytes)) or hasattr(run, "__fspath__") else run
    table = r.read(columns=COLUMNS)
    t = {c: table.column(c).to_numpy(zero_copy_only=False) for c in COLUMNS}
    t["logp_ref"] = np.nan_to_num(t["logp_ref"].astype(np.float64), nan=0.0)
    t["mask"] = t["mask"].astype(bool) & (table.column("logp_ref").is_valid().to_numpy(zero_copy_only=False))
    return t, r.manifest


def kl_loss_by_step(run: Any, kl_loss_type: str | None = None, loss_agg_mode: str | None = None,
                    loss_scale_factor: float | None = None) -> dict[int, float]:
    """{step: actor/kl_loss as verl logs it} (settings default to the manifest's, written by the hook)."""
    t, manifest = _read(run)
    cfg = manifest.config
    kl_type = kl_loss_type or cfg.get("kl_loss_type", "low_var_kl")
    mode = loss_agg_mode or cfg.get("loss_agg_mode", "token-mean")
    lsf = loss_scale_factor if loss_scale_factor is not None else cfg.get("loss_scale_factor")
    dp = int(manifest.world_size)
    micros = _micro_batches(t)
    tokens: dict[tuple[int, int], int] = {}
    seqs: dict[tuple[int, int], int] = {}
    for m in micros:
        k = (m["step"], m["mini"])
        tokens[k] = tokens.get(k, 0) + int(m["mask"].sum())
        seqs[k] = seqs.get(k, 0) + m["mask"].shape[0]
    total: dict[int, float] = {}
    for m in micros:
        k = (m["step"], m["mini"])
        kld = kl_penalty(m["logp"], m["logp_ref"], kl_type)
        total[m["step"]] = total.get(m["step"], 0.0) + agg_loss(kld, m["mask"], mode, dp, tokens[k], seqs[k], lsf)
    minis = {s: len({mi for (st, mi) in tokens if st == s}) for s in total}
    return {s: v / (dp * minis[s]) for s, v in sorted(total.items())}


def clamp_share_by_step(run: Any) -> dict[int, dict[str, float]]:
    """{step: tokens, dead_tokens, token_share, weight_share}: low_var_kl's dead zone per step.

    weight_share = sum of |1 - pi_ref/pi_theta| over dead tokens / over all tokens in the loss
    (float64; an infinite weight makes the share 1 or NaN-free: inf/inf counts as 1).
    """
    t, _ = _read(run)
    m = t["mask"]
    step = t["step"][m]
    s, r = t["logp"][m].astype(np.float64), t["logp_ref"][m]
    dead = dead_zone(s, r)
    with np.errstate(over="ignore"):
        w = np.abs(1.0 - np.exp(r - s))
    out = {}
    for st in np.unique(step):
        sel = step == st
        wd, wa = w[sel & dead].sum(), w[sel].sum()
        share = 1.0 if np.isinf(wd) else float(wd / wa) if wa > 0 else 0.0
        out[int(st)] = {"tokens": int(sel.sum()), "dead_tokens": int((sel & dead).sum()),
                        "token_share": float((sel & dead).sum() / max(sel.sum(), 1)), "weight_share": share}
    return out


def trainer_kl(run: Any, config: dict[str, Any]) -> Any:
    """analyze's `trainer_kl` table for runs of the verl hook (manifest config kl_semantics == "verl"):
    step, kl (actor/kl_loss), clamp_dead_token_share, clamp_dead_weight_share (low_var_kl only, else null)."""
    import pyarrow as pa

    kl = kl_loss_by_step(run, config.get("kl_loss_type"), config.get("loss_agg_mode"), config.get("loss_scale_factor"))
    clamps = str(config.get("kl_loss_type", "low_var_kl")).rstrip("+") in ("low_var_kl", "k3")
    share = clamp_share_by_step(run) if clamps else {}
    steps = sorted(kl)
    col = [share.get(s, {}).get("token_share") for s in steps]
    wcol = [share.get(s, {}).get("weight_share") for s in steps]
    return pa.table({"step": pa.array(steps, pa.int64()), "kl": pa.array([kl[s] for s in steps], pa.float64()),
                     "clamp_dead_token_share": pa.array(col, pa.float64()),
                     "clamp_dead_weight_share": pa.array(wcol, pa.float64())})
