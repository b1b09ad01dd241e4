"""Training-thread cost per step of the OpenRLHF, AReaL and SkyRL hooks (thread CPU time, time.thread_time).

    python bench/hooks_overhead.py            # 30 steps each after 3 warm-up steps, CPU tensors

Each hook's recording function is called as the framework calls it, on tensors of a small but realistic step:
OpenRLHF 8 micro-batches of 4 x 384 (256 action columns); AReaL 8 packed micro-batches of 4 sequences x 384
tokens; SkyRL one driver batch of 32 x 256 response columns cut into its micro-batches. What is timed is the
hook's work on the training thread (ids, shape checks, the host copies it queues): the recorder's writer
threads run beside it (given PAUSE_S between steps to drain, as a real step's forward and backward would) and
are not counted, as in bench/trl_overhead.py. The framework's own step is not run.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace as NS

import torch

torch.set_num_threads(1)  # intra-op worker spin on a loaded 2-core machine inflates the thread CPU time of small ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kldiag.integrations import areal, openrlhf, skyrl  # noqa: E402

STEPS, WARM = 30, 3
PAUSE_S = 0.2  # between steps, as the rest of a real step (seconds to minutes) would leave


def timed(step_fn) -> list[float]:
    out = []
    for i in range(WARM + STEPS):
        cpu = time.thread_time()
        step_fn(i)
        if i >= WARM:
            out.append(time.thread_time() - cpu)
        time.sleep(PAUSE_S)  # the framework's own step: the writer threads drain meanwhile
    return out


def bench_openrlhf(run: str) -> list[float]:
    os.environ[openrlhf.ENV_RUN] = run
    args = NS(algo=NS(kl=NS(estimator="k3", use_loss=True, init_coef=0.01, unbiased_gradient=True),
                      advantage=NS(is_correction_level="token", estimator="group_norm")),
              actor=NS(eps_clip_low_high=(0.2, 0.28)), train=NS(max_epochs=1, micro_batch_size=4),
              rollout=NS(temperature=1.0, top_p=1.0, n_samples_per_prompt=4), critic=NS(freezing_steps=-1))
    trainer = NS(args=args, strategy=NS(accumulated_gradient=8))
    g = torch.Generator().manual_seed(0)
    mk = (lambda *s: -torch.rand(*s, generator=g))
    exps = [NS(sequences=torch.randint(0, 32000, (4, 384), generator=g), attention_mask=torch.ones(4, 384),
               action_mask=torch.ones(4, 256, dtype=torch.bool), action_log_probs=mk(4, 256),
               base_action_log_probs=mk(4, 256), rollout_log_probs=mk(4, 256), advantages=torch.randn(4, 256),
               prompts=[f"p{i}" for i in range(4)]) for _ in range(8)]
    openrlhf.STATE.__init__()
    openrlhf.STATE.per_epoch = 8

    def step(i):
        openrlhf.STATE.fits, openrlhf.STATE.calls = i + 1, 0
        for e in exps:
            openrlhf.record_micro_batch(trainer, e, e.action_log_probs + 0.01)
            openrlhf.STATE.calls += 1
    out = timed(step)
    openrlhf.close()
    return out


def bench_areal(run: str) -> list[float]:
    os.environ[areal.ENV_RUN] = run
    engine = NS(config=NS(kl_ctl=0.0, kl_estimator="k1", eps_clip=0.2), data_parallel_rank=0,
                data_parallel_world_size=1, is_data_parallel_head=lambda: True)
    g = torch.Generator().manual_seed(0)
    n = 4 * 384
    mbs = [{"cu_seqlens": torch.tensor([0, 384, 768, 1152, 1536]),
            "input_ids": torch.randint(0, 32000, (n,), generator=g),
            "loss_mask": (torch.arange(n) % 384 >= 128).int(), "prox_logp": -torch.rand(n, generator=g),
            areal.SAMPLER_KEY: -torch.rand(n, generator=g), "advantages": torch.randn(n, generator=g)}
           for _ in range(8)]
    areal.STATE.__init__()

    def step(i):
        for mb in mbs:
            areal.record_micro_batch(engine, mb["prox_logp"] + 0.01, None, mb, i)
    out = timed(step)
    areal.close()
    return out


class _Batch(dict):
    metadata: dict = {}


def bench_skyrl(run: str) -> list[float]:
    from kldiag.record.recorder import Recorder

    g = torch.Generator().manual_seed(0)
    b = _Batch(sequences=torch.randint(0, 32000, (32, 384), generator=g), attention_mask=torch.ones(32, 384),
               loss_mask=torch.ones(32, 256, dtype=torch.long), action_log_probs=-torch.rand(32, 256, generator=g),
               rollout_logprobs=-torch.rand(32, 256, generator=g), advantages=torch.randn(32, 256, generator=g))
    b.metadata = {"policy_mini_batch_boundaries": [(0, 16), (16, 32)]}
    cfg = {"micro_train_batch_size_per_gpu": 4}
    rec = Recorder(run, trainer="skyrl")
    out = timed(lambda i: skyrl.record_step(rec, b, i, cfg, 2, [f"u{j // 4}" for j in range(32)]))
    rec.close()
    return out


def main() -> None:
    for name, fn in (("openrlhf", bench_openrlhf), ("areal", bench_areal), ("skyrl", bench_skyrl)):
        with tempfile.TemporaryDirectory() as tmp:
            ms = [x * 1e3 for x in fn(str(Path(tmp) / "run"))]
        print(f"{name:9s} hook thread CPU per step: median {statistics.median(ms):.2f} ms, "
              f"min {min(ms):.2f}, max {max(ms):.2f} ({STEPS} steps)")


if __name__ == "__main__":
    main()
