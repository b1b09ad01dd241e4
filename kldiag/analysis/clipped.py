"""The reducer body the staleness and per-task reducers share (the reducer protocol of kldiag.analysis.runner):
the run's PPO clip range, bound by the engine from the analysis's thresholds (runner.bound), one partial per
record batch kept in a list, and one merge at the end."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pyarrow as pa

DEFAULT_CLIP = (0.2, 0.2)  # PPO's epsilon (Schulman et al. 2017) when no range is bound


class ClippedListReducer:
    """Mixin of a frozen dataclass reducer with a `clip` field, `partial(batch, clip)` and `merge(partials)`."""

    clip: tuple[float, float] | None

    def partial(self, batch: pa.RecordBatch, clip: tuple[float, float]) -> Any:
        raise NotImplementedError

    def merge(self, partials: list) -> Any:
        raise NotImplementedError

    def with_clip(self, clip: tuple[float, float]):
        return self if self.clip is not None else replace(self, clip=(float(clip[0]), float(clip[1])))

    def bound_clip(self) -> tuple[float, float]:
        return self.clip or DEFAULT_CLIP

    def start(self, part) -> list:
        return []

    def add(self, state: list, batch: pa.RecordBatch) -> None:
        p = self.partial(batch, self.bound_clip()) if batch.num_rows else None
        if p is not None:
            state.append(p)

    def finish(self, state: list, dropped: int) -> Any:
        return self.merge(state)
