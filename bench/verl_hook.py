"""What the verl hook costs per micro-batch: kldiag's recording ppo_loss / verl 0.9.1's own ppo_loss.

    python bench/verl_hook.py [--batch 8 --prompt 256 --response 2048 --calls 30 --device cpu]

Both run on the same nested (no-padding) micro-batch of verl's V1 layout: log_probs and entropy over
prompt+response from the "model", old/ref/rollout log-probs, advantages and response_mask as nested
response tensors, uid. Reported: median wall time of verl's ppo_loss alone, of the hook (verl's loss,
then padding, hashing the ids and record()), their ratio, and the bytes per recorded token on disk.
The forward and backward passes of a real model are not included: the ratio is an upper bound on
the share of a training step the hook takes.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig
from verl.workers.utils.losses import ppo_loss

import kldiag
from kldiag.integrations import verl as hook


def nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def micro_batch(b: int, prompt: int, response: int, device: str):
    g = torch.Generator().manual_seed(0)
    r_len = torch.randint(response // 2, response + 1, (b,), generator=g).tolist()
    p_ids = [torch.randint(0, 151_936, (prompt,), generator=g) for _ in range(b)]
    r_ids = [torch.randint(0, 151_936, (r,), generator=g) for r in r_len]
    old = [-torch.rand(r, generator=g) for r in r_len]
    fields = {"prompts": nested(p_ids), "responses": nested(r_ids),
              "input_ids": nested(torch.cat([p, r]) for p, r in zip(p_ids, r_ids, strict=True)),
              "response_mask": nested(torch.ones(r, dtype=torch.long) for r in r_len), "old_log_probs": nested(old),
              "ref_log_prob": nested(o - 0.5 for o in old), "rollout_log_probs": nested(o + 0.01 for o in old),
              "advantages": nested(torch.full((r,), 0.3) for r in r_len)}
    data = tu.get_tensordict({k: v.to(device) for k, v in fields.items()})
    tu.assign_non_tensor_stack(data, "uid", [f"p{i // 4}" for i in range(b)])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=sum(r_len), global_batch_size=b)
    n = sum(r_len) + b * prompt
    offsets = data["input_ids"].offsets()
    out = {"log_probs": torch.nested.nested_tensor_from_jagged(-torch.rand(n, device=device), offsets=offsets),
           "entropy": torch.nested.nested_tensor_from_jagged(torch.rand(n, device=device), offsets=offsets)}
    return data, out, sum(r_len)


def timed(fn, calls: int, device: str) -> float:
    out = []
    for _ in range(calls):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss, _ = fn()
        loss.item()  # verl's engine reads the loss right after the loss function
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=2048)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    cfg = ActorConfig(strategy="fsdp", use_kl_loss=True, rollout_n=4, ppo_micro_batch_size_per_gpu=args.batch)
    data, out, tokens = micro_batch(args.batch, args.prompt, args.response, args.device)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        rec_loss = hook.loss_fn(cfg, run)
        rec_loss(model_output=out, data=data)  # opens the recorder
        hook.STATE.recorder.flush()
        plain = timed(lambda: ppo_loss(cfg, out, data), args.calls, args.device)
        attached = timed(lambda: rec_loss(model_output=out, data=data), args.calls, args.device)
        hook.close()
        nbytes = sum(p.size for p in kldiag.open_run(run).parts())
        rows = kldiag.open_run(run).read(columns=["seq"]).num_rows
    print(f"micro-batch {args.batch} x ({args.prompt} prompt + <= {args.response} response) = {tokens} response "
          f"tokens, {args.device}: verl ppo_loss {plain * 1e3:.2f} ms, with kldiag recording "
          f"{attached * 1e3:.2f} ms, ratio {attached / plain:.2f} (+{(attached - plain) * 1e3:.2f} ms); "
          f"{nbytes / rows:.2f} bytes/token on disk")


if __name__ == "__main__":
    main()
