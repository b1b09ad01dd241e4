"""The flight recorder: the last K steps at full fidelity, kept on the host while a run records a sample.

A recorder that samples (`every_n_steps > 1` or `seq_fraction < 1`) with `flight_steps = K > 0`
also keeps a host copy of every micro-batch of the last K steps, whole, in a ring bounded by K
steps and `flight_bytes`. When a guard fires (action "flight") or the caller asks
(`Recorder.dump_flight`), the ring is published as an evidence bundle: a run in the run format
at RUN/flight/<step>-<kind>/ (every row of those steps, readable by `kldiag analyze`, `report` and
`dashboard` like any run) plus `flight.json`: the trigger, its rule, the steps held, the worst
tokens by |k3 weight| and, when the guard gave them, its per-step figures.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import deque
from typing import Any

import numpy as np

from kldiag import estimators as E
from kldiag.format import VOCAB

FLIGHT_DIR = "flight"
SUMMARY = "flight.json"
WORST = 20  # tokens listed in the summary


@dataclasses.dataclass
class Entry:
    """One micro-batch as record() got it: numpy host copies of its arguments ([B, T] or [B])."""

    step: int
    micro: int
    iteration: int
    arrays: dict[str, np.ndarray]
    nbytes: int


def host_copy(x: Any) -> np.ndarray:
    """A numpy copy of a tensor (any device and dtype; bf16 widened to float32) or an array."""
    if hasattr(x, "detach"):
        x = x.detach()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.cpu().numpy().copy()
    return np.array(x, copy=True)


class Ring:
    """The last `steps` steps' micro-batches, at most `max_bytes` (the oldest steps go first)."""

    def __init__(self, steps: int, max_bytes: int):
        self.steps, self.max_bytes = steps, max_bytes
        self.entries: deque[Entry] = deque()
        self.nbytes = 0
        self.lock = threading.Lock()

    def add(self, step: int, micro: int, iteration: int, args: dict[str, Any]) -> None:
        arrays = {k: host_copy(v) for k, v in args.items()}
        entry = Entry(step, micro, iteration, arrays, sum(a.nbytes for a in arrays.values()))
        with self.lock:
            self.entries.append(entry)
            self.nbytes += entry.nbytes
            while self.entries and (self._held_steps() > self.steps or self.nbytes > self.max_bytes):
                gone = self.entries.popleft()
                self.nbytes -= gone.nbytes

    def _held_steps(self) -> int:
        return len({e.step for e in self.entries})

    def snapshot(self) -> list[Entry]:
        with self.lock:
            return list(self.entries)


def worst_tokens(entries: list[Entry], limit: int = WORST) -> list[dict[str, Any]]:
    """The tokens of the ring with the largest |k3 weight| (1 - pi_ref/pi_theta), in the loss."""
    rows = []
    for e in entries:
        a = e.arrays
        if "logp_ref" not in a:
            continue
        s, r = E.as_f64(a["logp"]), E.as_f64(a["logp_ref"])
        keep = np.asarray(a.get("mask", a.get("completion_mask", np.ones(s.shape, bool))), bool)
        with np.errstate(over="ignore", invalid="ignore"):
            w = np.abs(E.weight_k3(s, r))
        w = np.where(keep & np.isfinite(w), w, -1.0)
        for b, t in zip(*np.unravel_index(np.argsort(-w, axis=None)[:limit], w.shape), strict=True):
            if w[b, t] >= 0:
                rows.append({"step": e.step, "micro": e.micro, "iteration": e.iteration, "row": int(b),
                             "pos": int(t), "seq": int(a["seq_ids"][b]) if "seq_ids" in a else None,
                             "weight_k3": float(E.weight_k3(s[b, t], r[b, t])), "logp": float(s[b, t]),
                             "logp_ref": float(r[b, t])})
    return sorted(rows, key=lambda x: -abs(x["weight_k3"]))[:limit]


def bundle_rel(store: Any, step: int, kind: str) -> str:
    """flight/<step>-<kind>[-n] inside the run (a local directory or a URI): a new bundle per dump."""
    base = f"{FLIGHT_DIR}/{step:09d}-{kind}"
    rel, n = base, 1
    while store.exists(f"{rel}/run.json"):
        n += 1
        rel = f"{base}-{n}"
    return rel


def summary(trigger: dict[str, Any], entries: list[Entry], figures: dict[str, Any] | None) -> dict[str, Any]:
    """flight.json: what fired, which steps the bundle holds, the worst tokens, the guard's figures."""
    steps = sorted({e.step for e in entries})
    return {"trigger": trigger, "steps": steps, "micro_batches": len(entries),
            "bytes": int(sum(e.nbytes for e in entries)), "worst_tokens": worst_tokens(entries),
            "step_figures": _plain(figures or {})}


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, np.ndarray):
        return [_plain(v) for v in x.tolist()]
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x.item() if hasattr(x, "item") else x


def publish(rec: Any, recorder_class: type, entries: list[Entry], trigger: dict[str, Any] | None,
            figures: dict[str, Any] | None) -> str | None:
    """Write `entries` as a bundle beside `rec`'s run with a recorder of `recorder_class` (every row,
    no sampling, no ring), the run's vocab, and flight.json; returns the bundle's path or URI."""
    if not entries:
        return None
    trigger = dict(trigger or {"kind": "manual"})
    kind = str(trigger.get("kind", "manual"))
    rel = bundle_rel(rec.store, int(trigger.get("start", entries[-1].step)), kind)
    opts = dataclasses.replace(rec.options, every_n_steps=1, seq_fraction=1.0, flight_steps=0, tokenizer=None,
                               rotate_seconds=None, rank=rec.rank, world_size=rec.world_size,
                               tags={**(rec.manifest.tags or {}), "flight": kind})
    with recorder_class(rec.store.full(rel), opts) as bundle:
        for e in entries:
            bundle.record(step=e.step, micro=e.micro, iteration=e.iteration, **e.arrays)
    vocab = rec.store.read_bytes(VOCAB)
    if vocab is not None:
        rec.store.write_bytes(f"{rel}/{VOCAB}", vocab)
    body = summary(trigger, entries, figures)
    rec.store.write_bytes(f"{rel}/{SUMMARY}", json.dumps(body, indent=2, default=str).encode())
    return rec.store.full(rel)
