"""kldiag's crosswalk next to the frameworks' own numbers, metric by metric.

    python examples/crosswalk_parity.py verl [--run sample_logs/demo_k3]   # needs verl (0.9.1)
    python examples/crosswalk_parity.py trl [--steps 6]                    # a real GRPOTrainer on CPU

verl: every step of the run, padded as verl pads a batch, handed to verl's own functions
(rollout_corr_helper.compute_rollout_correction_and_rejection_mask, debug.metrics.calculate_debug_metrics,
core_algos.kl_penalty + agg_loss) in float64. TRL: a tiny GRPOTrainer trained with kldiag attached;
its logged `kl` per step against kldiag.crosswalk("trl"). Prints: metric, kldiag's mean over the
steps, the framework's mean, and the max relative difference over the steps.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

import kldiag.crosswalk as X

VERL_SETTINGS = [{"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3,token_k1",
                  "rollout_rs_threshold": "0.05,0.5_2.0"},
                 {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0"}]


def _row(name: str, mine: list[float], theirs: list[float]) -> tuple[str, float, float, float]:
    a, b = np.asarray(mine, np.float64), np.asarray(theirs, np.float64)
    rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-300)
    rel = np.where((a == b), 0.0, rel)
    return name, float(a.mean()), float(b.mean()), float(rel.max())


def verl_rows(run: str) -> list[tuple[str, float, float, float]]:
    import torch
    from verl.protocol import DataProto
    from verl.trainer.ppo import core_algos, rollout_corr_helper
    from verl.utils.debug import metrics as debug

    from kldiag.crosswalk.batch import pad
    from kldiag.mismatch import tokenset as TS

    def t64(x):
        return torch.tensor(np.ascontiguousarray(x), dtype=torch.float64)

    ts = TS.load(run)
    batches = [pad(ts, sl, s) for s, sl in ts.step_slices()]
    out: dict[str, tuple[list[float], list[float]]] = {}
    for settings in VERL_SETTINGS:
        rows = X.crosswalk(run, "verl", **settings).to_pylist()
        for b, mine in zip(batches, rows, strict=True):
            rollout = np.where(b.mask, b.logp_sampler, 0.0)
            _, _, theirs = rollout_corr_helper.compute_rollout_correction_and_rejection_mask(
                t64(b.logp_old), t64(rollout), t64(b.mask), **settings)
            data = DataProto.from_dict(tensors={"rollout_log_probs": t64(rollout), "old_log_probs": t64(b.logp_old),
                                                "response_mask": torch.tensor(b.mask.astype(np.int64)),
                                                "responses": torch.zeros(b.mask.shape, dtype=torch.int64)})
            theirs.update(debug.calculate_debug_metrics(data))
            kld = core_algos.kl_penalty(t64(b.logp), t64(np.where(b.mask, b.logp_ref, 0.0)), "low_var_kl")
            theirs["actor/kl_loss"] = float(core_algos.agg_loss(kld, t64(b.mask), "token-mean"))
            for k, v in theirs.items():
                pair = out.setdefault(k, ([], []))
                pair[0].append(mine[k])
                pair[1].append(float(v))
    return [_row(k, a, b) for k, (a, b) in out.items()]


def trl_rows(steps: int) -> list[tuple[str, float, float, float]]:
    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trl_grpo import WORDS, build_tiny_model

    from kldiag.integrations import trl as kt

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", seed=0)
        for corrected in (False, True):
            args = trl.GRPOConfig(output_dir=f"{tmp}/out{corrected}", per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, num_generations=4, max_completion_length=8,
                                  num_iterations=2, beta=0.1, learning_rate=5e-2, max_steps=steps, logging_steps=1,
                                  report_to=[], use_cpu=True, seed=0, save_strategy="no", disable_tqdm=True,
                                  use_bias_correction_kl=corrected)
            trainer = trl.GRPOTrainer(
                model=str(model), args=args,
                reward_funcs=lambda completions, **kw: [float(c.split().count("cat")) for c in completions],
                train_dataset=Dataset.from_dict({"prompt": [" ".join(WORDS[i % 20:i % 20 + 3]) for i in range(64)]}),
                processing_class=PreTrainedTokenizerFast.from_pretrained(model))
            kt.attach(trainer, f"{tmp}/run{corrected}")
            trainer.train()
            logged = {h["step"]: h["kl"] for h in trainer.state.log_history if "kl" in h}
            table = X.crosswalk(f"{tmp}/run{corrected}", "trl")
            mine = dict(zip(table.column("step").to_pylist(), table.column("kl").to_pylist(), strict=True))
            keys = sorted(logged)
            out.append(_row(f"kl (use_bias_correction_kl={corrected})", [mine[k] for k in keys],
                            [logged[k] for k in keys]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("framework", choices=["verl", "trl"])
    p.add_argument("--run", default="sample_logs/demo_k3")
    p.add_argument("--steps", type=int, default=6)
    a = p.parse_args()
    rows = verl_rows(a.run) if a.framework == "verl" else trl_rows(a.steps)
    print(f"| metric | kldiag (mean over steps) | {a.framework} (mean over steps) | max rel. diff over steps |")
    print("|---|---|---|---|")
    for name, mine, theirs, rel in rows:
        print(f"| `{name}` | {mine:.6g} | {theirs:.6g} | {rel:.1e} |")


if __name__ == "__main__":
    main()
