"""The demo: a tiny GRPO run trained with K3 and with k3_is, recorded, analysed and summarised."""

from __future__ import annotations

import dataclasses
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kldiag import format as F
from kldiag.errors import KldiagError
from kldiag.record.recorder import Recorder
from kldiag.version import __version__

ESTIMATORS = ("k3", "k3_is")
FINAL_STEPS = 20  # "final" reward and filler probability: mean over the last steps
RUN_ENTRIES = {F.MANIFEST, F.VOCAB, F.TOKENS_DIR, F.WRITERS_DIR, F.CACHE_DIR}


@dataclass
class DemoRun:
    """One of the pair: where it was recorded and what the training saw."""

    estimator: str
    run_dir: Path
    seconds: float  # training time, recording included
    final_reward: float
    final_p_punished: float  # pi_theta's mass on the punished tokens (the fillers)
    max_grad_norm: float  # before clipping
    median_grad_norm: float
    rows: int  # token rows the recorder published


def run_dir_name(estimator: str) -> str:
    return f"demo_{estimator}"


def _fresh_run_dir(path: Path) -> Path:
    """Empty `path` for a new recording, but only if it is a kldiag run (or absent/empty):
    a demo must never delete a directory it did not write."""
    if path.exists():
        entries = {p.name for p in path.iterdir()}
        if entries and (F.MANIFEST not in entries or not entries <= RUN_ENTRIES):
            raise KldiagError(f"{path} exists and is not a kldiag demo run; pass another --out directory")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _mean_last(values: list[float]) -> float:
    tail = values[-FINAL_STEPS:]
    return sum(tail) / len(tail)


def train_one(cfg, out: Path, progress: bool = False) -> DemoRun:
    """Train and record one run of the pair into OUT/demo_<estimator>."""
    from kldiag.tools import demo_train as T  # torch: only when training

    run_dir = _fresh_run_dir(out / run_dir_name(cfg.estimator))

    def show(s: T.StepStats) -> None:
        if progress and (s.step % 25 == 0 or s.step == cfg.steps - 1):
            print(f"  [{cfg.estimator:5s}] step {s.step:4d}  reward {s.reward:+.3f}  "
                  f"p(punished) {100 * s.p_punished:6.3g}%  grad norm {s.grad_norm:.3f}", file=sys.stderr)

    with Recorder(run_dir, beta=cfg.beta, estimator=cfg.estimator, clip_range=cfg.clip_range,
                         trainer="kldiag-demo", trainer_version=__version__, config=T.run_config(cfg),
                         tokenizer=T.vocab(cfg), tags={"demo": True}) as rec:
        result = T.train(cfg, record=rec.record, progress=show)
    grads = sorted(s.grad_norm for s in result.history)
    return DemoRun(cfg.estimator, run_dir, result.seconds, _mean_last([s.reward for s in result.history]),
                   _mean_last([s.p_punished for s in result.history]), grads[-1], grads[len(grads) // 2],
                   rec.stats["rows"])


def run_pair(out: str | Path, steps: int | None = None, seed: int | None = None,
             progress: bool = False) -> list[DemoRun]:
    """Train and record the K3 run and its k3_is twin (same seed, same everything else)."""
    from kldiag.tools import demo_train as T

    base = T.DemoConfig()
    changes: dict[str, Any] = {k: v for k, v in (("steps", steps), ("seed", seed)) if v is not None}
    out = Path(out)
    return [train_one(dataclasses.replace(base, estimator=e, **changes), out, progress) for e in ESTIMATORS]


def summarize(run: DemoRun, analysis) -> dict[str, Any]:
    """The figures the demo prints for one run, from its analysis and its training."""
    steps = analysis.steps

    def col(name: str) -> list[float]:
        return [v for v in steps.column(name).to_pylist() if v is not None]

    return {
        "run": run.run_dir.name,
        "estimator": run.estimator,
        "max_weight_k3": max(col("weight_k3_abs_max"), default=float("nan")),
        "max_weight_k3_is": max(col("weight_k3_is_abs_max"), default=float("nan")),
        "weight_blowup_tokens": int(sum(col("weight_blowup_count"))),
        "theta_ll_ref_tokens": int(sum(col("theta_ll_ref_count"))),
        "final_reward": run.final_reward,
        "final_p_punished": run.final_p_punished,
        "grad_norm_max": run.max_grad_norm,
        "grad_norm_median": run.median_grad_norm,
        "train_seconds": run.seconds,
    }


def format_summary(s: dict[str, Any]) -> str:
    loss_weight = s["max_weight_k3"] if s["estimator"] == "k3" else s["max_weight_k3_is"]
    return (f"{s['run']:12s} loss {s['estimator']:5s}  max |weight of its loss| {loss_weight:10.1f}   "
            f"max |k3 weight| {s['max_weight_k3']:10.1f}   max |k3_is weight| {s['max_weight_k3_is']:6.1f}\n"
            f"{'':12s} tokens with |k3 weight| > 10: {s['weight_blowup_tokens']:5d}   final reward "
            f"{s['final_reward']:+.3f}   p(punished) {100 * s['final_p_punished']:.3g}%   "
            f"grad norm median {s['grad_norm_median']:.2f} max {s['grad_norm_max']:.2f}   "
            f"trained in {s['train_seconds']:.1f} s")
