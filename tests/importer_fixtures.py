"""Dumps built the way slime, NeMo-RL and prime-rl write them (the frameworks cannot be
installed here: slime needs Megatron, NeMo-RL and prime-rl need their GPU stacks).

Each builder follows the writer's code line by line (cited); the copied functions are
Apache-2.0 code of those projects. `truth` returns the per-token arrays the builder used,
for the tests' independent numpy computation.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch


class Opaque:
    """A pickled object that torch.load(weights_only=True) refuses (a slime payload with a custom type)."""

    def __init__(self, v):
        self.v = v


# ---- slime (THUDM/slime@624b824a) -------------------------------------------------------

# slime/observability/train_data_utils.py l. 97-188, verbatim (logger and torch as there).
logger = logging.getLogger(__name__)
_LAYOUT_FIELDS = ("micro_batch_indices", "num_microbatches", "global_batch_sizes")
_WHOLE_BATCH_FIELDS = ("raw_reward",)


def _is_per_sample(value, num_samples: int) -> bool:
    if torch.is_tensor(value):
        return value.dim() >= 1 and value.size(0) == num_samples
    if isinstance(value, (list, tuple)):
        return len(value) == num_samples
    return False


def _build_dump_payload(dp_shards, *, rollout_id, writer_rank):
    samples = []
    layout = []
    whole_batch = {}
    id_columns = {"sample_indices": "sample_index", "partition": "rollout_position"}
    for shard in dp_shards:
        rollout_data = shard["rollout_data"]
        dp_rank = shard["data_parallel_rank"]
        num_local = len(rollout_data["response_lengths"])

        shard_layout = {"rank": shard["rank"], "data_parallel_rank": dp_rank}
        for column in id_columns:
            value = rollout_data.get(column)
            shard_layout[column] = list(value) if value is not None else None
        per_sample_columns = {}
        for key, value in rollout_data.items():
            if key in id_columns:
                continue
            if key in _WHOLE_BATCH_FIELDS:
                whole_batch.setdefault(key, value)
            elif key in _LAYOUT_FIELDS or not _is_per_sample(value, num_local):
                shard_layout[key] = value
            else:
                per_sample_columns[key] = value

        for i in range(num_local):
            sample = {"data_parallel_rank": dp_rank}
            for column, scalar_key in id_columns.items():
                values = rollout_data.get(column)
                if values is not None:
                    sample[scalar_key] = values[i]
            for key, column in per_sample_columns.items():
                sample[key] = column[i]
            samples.append(sample)
        layout.append(shard_layout)

    order_key = next(
        (
            scalar_key
            for scalar_key in ("rollout_position", "sample_index")
            if samples and all(sample.get(scalar_key) is not None for sample in samples)
        ),
        None,
    )
    if order_key is not None:
        samples.sort(key=lambda sample: sample[order_key])
    else:
        logger.warning("no order key")

    return {
        "format_version": 2,
        "rollout_id": rollout_id,
        "rank": writer_rank,
        "samples": samples,
        "dp_shards": layout,
        **whole_batch,
    }


def slime_rollout_data(rng: np.random.Generator, rollout_id: int, n_prompts: int, group: int, dp_size: int):
    """Per-DP-rank rollout_data as slime's actor holds it at save_debug_train_data.

    RolloutManager._convert_samples_to_train_data / _split_train_data_by_dp (slime/ray/rollout.py
    l. 657-700, 783-821): tokens (prompt + response, long), response_lengths, loss_masks (int),
    sample_indices, rollout_log_probs (float32), split by `partition` (round robin here, as
    build_dp_schedule may interleave); process_rollout_data keeps `partition` and takes
    total_lengths per partition (slime/utils/data.py l. 304-329); the actor adds log_probs,
    ref_log_probs (compute_log_prob), advantages and returns (per-token tensors).
    """
    n = n_prompts * group
    truth = []
    for pos in range(n):
        prompt_len, resp_len = int(rng.integers(2, 6)), int(rng.integers(1, 9))
        logp = rng.normal(-1.0, 0.7, resp_len).clip(max=-1e-3).astype(np.float32)
        ref = (logp + rng.normal(0, 0.8, resp_len)).clip(max=-1e-3).astype(np.float32)
        sampler = (logp + rng.normal(0, 0.05, resp_len)).clip(max=-1e-3).astype(np.float32)
        if pos == 3:
            logp[0], ref[0] = -8.0, -1.5  # a pi_theta << pi_ref token: k3 blows up
        mask = (rng.random(resp_len) > 0.2).astype(np.int32)
        mask[0] = 1
        adv = np.full(resp_len, rng.normal(), np.float32)
        truth.append({"pos": pos, "group": pos // group, "tokens": rng.integers(0, 1000, prompt_len + resp_len),
                      "resp": resp_len, "logp": logp, "ref": ref, "sampler": sampler, "mask": mask, "adv": adv})
    partitions = [[p for p in range(n) if p % dp_size == r] for r in range(dp_size)]
    shards = []
    for r, part in enumerate(partitions):
        t = [truth[p] for p in part]
        rollout_data = {
            "partition": part,
            "tokens": [torch.as_tensor(x["tokens"], dtype=torch.long) for x in t],
            "response_lengths": [x["resp"] for x in t],
            "loss_masks": [torch.as_tensor(x["mask"], dtype=torch.int) for x in t],
            "sample_indices": [1000 * rollout_id + x["pos"] for x in t],
            "rollout_ids": [x["pos"] for x in t],
            "rollout_log_probs": [torch.as_tensor(x["sampler"]) for x in t],
            "raw_reward": [float(i) for i in range(n)],
            "total_lengths": [len(x["tokens"]) for x in t],
            "global_batch_sizes": [n],
            "num_microbatches": [1],
            "micro_batch_indices": [[list(range(len(t)))]],
            "log_probs": [torch.as_tensor(x["logp"]) for x in t],
            "ref_log_probs": [torch.as_tensor(x["ref"]) for x in t],
            "advantages": [torch.as_tensor(x["adv"]) for x in t],
            "returns": [torch.as_tensor(x["adv"]) for x in t],
        }
        shards.append({"rank": r, "data_parallel_rank": r, "rollout_data": rollout_data})
    return shards, truth


def write_slime(dump_dir: Path, rollout_ids, *, n_prompts=3, group=2, dp_size=2, seed=0, with_rollout=True):
    """--dump-details DIR: DIR/train_data/{id}.pt (save_debug_train_data, train_data_utils.py l. 239-242)
    and DIR/rollout_data/{id}.pt ({rollout_id, samples: [Sample.to_dict()]}, rollout_data_utils.py
    l. 140-153, with group_index and index from RolloutDataSource, data_source.py l. 108-117)."""
    rng = np.random.default_rng(seed)
    truth = {}
    for rid in rollout_ids:
        shards, t = slime_rollout_data(rng, rid, n_prompts, group, dp_size)
        path = dump_dir / "train_data" / f"{rid}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_build_dump_payload(shards, rollout_id=rid, writer_rank=0), path)
        if with_rollout:
            samples = [{"group_index": 100 * rid + x["group"], "index": 1000 * rid + x["pos"], "status": "completed",
                        "tokens": x["tokens"].tolist(), "response_length": x["resp"]} for x in t]
            rpath = dump_dir / "rollout_data" / f"{rid}.pt"
            rpath.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"rollout_id": rid, "samples": samples}, rpath)
        truth[rid] = t
    return truth


# ---- NeMo-RL (NVIDIA-NeMo/RL@7ea279ab) -----------------------------------------------------

def write_nemo(log_dir: Path, steps, *, n_prompts=3, group=2, seed=0, skip_prev=False):
    """train_data_step{N}.jsonl as grpo.py l. 3631-3653 and logger.py l. 1071-1096 write it:
    [B, S] right-padded lists, one-element lists per line (make_microbatch_iterator(1)),
    `idx`; log-probs aligned with their token, 0 on the prompt; prev_logprobs zeros when skipped."""
    rng = np.random.default_rng(seed)
    truth = {}
    for step in steps:
        n = n_prompts * group
        rows = []
        for i in range(n):
            p, r = int(rng.integers(2, 5)), int(rng.integers(1, 8))
            prev = np.zeros(p + r, np.float32)
            gen = np.zeros(p + r, np.float32)
            prev[p:] = rng.normal(-1.0, 0.6, r).clip(max=-1e-3)
            gen[p:] = (prev[p:] + rng.normal(0, 0.1, r)).clip(max=-1e-3)
            loss = np.zeros(p + r, np.int64)
            loss[p:] = 1
            rows.append({"p": p, "r": r, "prev": prev, "gen": gen, "loss": loss, "adv": float(rng.normal()),
                         "tokens": rng.integers(1, 500, p + r), "sample_mask": 0.0 if i == 1 else 1.0})
        s = max(x["p"] + x["r"] for x in rows) + 2  # make_sequence_length_divisible_by padding

        def pad(a, s=s):
            return np.concatenate([a, np.zeros(s - len(a), a.dtype)])

        log_data = {
            "content": [[f"sample {i}"] for i in range(n)],
            "rewards": [x["adv"] for x in rows],
            "input_lengths": [x["p"] + x["r"] for x in rows],
            "token_ids": [pad(x["tokens"]).tolist() for x in rows],
            "token_loss_mask": [pad(x["loss"]).tolist() for x in rows],
            "sample_loss_mask": [x["sample_mask"] for x in rows],
            "advantages": [pad(np.full(x["p"] + x["r"], x["adv"], np.float32)).tolist() for x in rows],
            "generation_logprobs": [pad(x["gen"]).tolist() for x in rows],
            "prev_logprobs": [(np.zeros(s) if skip_prev else pad(x["prev"])).tolist() for x in rows],
        }
        path = log_dir / f"train_data_step{step}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for i in range(n):
                sample = {k: v[i:i + 1] for k, v in log_data.items()}  # BatchedDataDict.slice
                f.write(json.dumps({**sample, "idx": i}, default=str) + "\n")
        truth[step] = rows
    return truth


# ---- prime-rl (PrimeIntellect-ai/prime-rl@559b4477) ----------------------------------------

def write_prime(out_dir: Path, steps, *, ranks=2, per_rank=3, seed=0, stable=True):
    """token_exports/step_{N}/rank_{r}.jsonl as TokenExporter.export/_write write them
    (token_export.py l. 42-74, 102-112): one line per sequence with a loss token, columns
    of _export_columns (l. 128-157), mismatch_kl etc. from compute_importance_ratio_and_mismatch_kl
    (loss.py l. 100-106), non-finite floats as null (l. 247-253); STABLE after every rank (l. 81-85)."""
    rng = np.random.default_rng(seed)
    truth = {}
    for step in steps:
        d = out_dir / "token_exports" / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        for rank in range(ranks):
            lines, rows = [], []
            for k in range(per_rank):
                p, r = int(rng.integers(1, 4)), int(rng.integers(1, 7))
                n = p + r
                t = rng.normal(-1.0, 0.6, n).clip(max=-1e-3).astype(np.float32)
                inf = (t + rng.normal(0, 0.1, n)).clip(max=-1e-3).astype(np.float32)
                inf[:p] = 0.0
                loss = np.zeros(n, bool)
                loss[p:] = True
                if k == 1 and r > 1:
                    loss[-1] = False  # a masked token inside the completion
                adv = np.full(n, rng.normal(), np.float32)
                ent = rng.random(n).astype(np.float32)
                tt, ii = torch.as_tensor(t), torch.as_tensor(inf)
                log_ratio = tt - ii
                ratio = torch.exp(log_ratio)
                mismatch = ratio - log_ratio - 1
                rec = {"schema_version": 1, "step": step, "rank": rank, "micro_step": k // 2,
                       "micro_sequence_idx": k % 2, "export_sequence_idx": k, "env_name": "math",
                       "token_ids": rng.integers(0, 100, n).tolist(), "position_ids": list(range(n)),
                       "loss_mask": loss.tolist(), "advantages": adv.tolist(), "inference_logprobs": ii.tolist(),
                       "trainer_logprobs": tt.tolist(), "entropy": ent.tolist(), "mismatch_kl": mismatch.tolist(),
                       "log_importance_ratio": log_ratio.tolist(), "importance_ratio": ratio.tolist(),
                       "prob_delta": (torch.exp(tt) - torch.exp(ii)).tolist(), "is_masked": [False] * n,
                       "is_masked_high": [False] * n, "is_masked_low": [False] * n, "rl_weights": [None] * n,
                       "ce_weights": [None] * n, "ref_kl_weights": [None] * n}
                lines.append(json.dumps(rec, separators=(",", ":"), allow_nan=False))
                rows.append({"p": p, "t": t, "inf": inf, "loss": loss, "mismatch": mismatch.numpy()})
            (d / f"rank_{rank}.jsonl").write_text("\n".join(lines) + "\n")
            truth[(step, rank)] = rows
        if stable:
            (d / "STABLE").touch()
    return truth
