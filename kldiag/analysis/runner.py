"""Runs reducers over a run's parts: each part read at most once, partials cached, merged in part order.

`Pass(run, reducers, cfg)` first reads, in one pass, every part that lacks the cached partial of
any of the reducers (only those reducers, only the union of their columns), in this process,
in `cfg.workers` processes or in Ray tasks, saving each partial as it comes back; then
`partial(i, reducer)` and `merged(reducer)` read from memory or the cache, never from the part.
`opened` counts the parts read, for tests and benches.
"""

from __future__ import annotations

import multiprocessing
import sys
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kldiag.analysis import reduce, worker
from kldiag.analysis.reduce import Arrays, Reducer
from kldiag.errors import CorruptPartError, RunFormatError
from kldiag.format import PartInfo, open_run

KERNEL_ROWS = 1 << 19  # rows per batch handed to the reducers
opened_parts = 0  # parts read by any Pass in this process (tests: "each part at most once")


def skip(part: PartInfo, error: Exception, strict: bool, skipped: list[str]) -> None:
    """Warn about an unreadable part and remember it (strict: raise, naming the fix)."""
    if strict:
        raise error if isinstance(error, RunFormatError) else CorruptPartError(
            f"part file {part.path} is unreadable ({error}); delete it or move it out of the run") from error
    warnings.warn(f"kldiag: skipping part {part.path}: {error}", stacklevel=4)
    skipped.append(str(part.path))


class Pass:
    """The partials of `reducers` for every readable part of `parts`, computed where the cache lacks them."""

    def __init__(self, cache_dir: Path, parts: Sequence[PartInfo], reducers: Sequence[Reducer], cfg,
                 skipped: list[str] | None = None):
        self.cache_dir, self.parts, self.reducers, self.cfg = Path(cache_dir), list(parts), list(reducers), cfg
        self.skipped = skipped if skipped is not None else []
        self.fresh: dict[tuple[int, str], Arrays] = {}
        self.failed: set[int] = set()
        self.computed = self._compute_missing()

    def _cached(self, i: int, r: Reducer) -> bool:
        return self.cfg.use_cache and reduce.cache_path(self.cache_dir, r, self.parts[i]).exists()

    def _compute_missing(self) -> int:
        global opened_parts
        jobs = [(i, [r for r in self.reducers if not self._cached(i, r)]) for i in range(len(self.parts))]
        jobs = [(i, rs) for i, rs in jobs if rs]
        opened_parts += len(jobs)
        for k, result in self._results([(self.parts[i], rs) for i, rs in jobs]):
            i, rs = jobs[k]
            if isinstance(result, Exception):
                self.failed.add(i)
                skip(self.parts[i], result, self.cfg.strict, self.skipped)
                continue
            for r in rs:
                self.fresh[(i, r.name)] = result[r.name]
                if self.cfg.use_cache:
                    reduce.save_arrays(reduce.cache_path(self.cache_dir, r, self.parts[i]), result[r.name])
        return len(jobs)

    def _results(self, jobs: list[reduce.Job]) -> Iterator[tuple[int, dict | Exception]]:
        """(job index, partials or error), in job order, however the work is spread."""
        size = min(self.cfg.batch_size, KERNEL_ROWS)
        if self.cfg.engine == "ray":  # Ray tasks run where the parts are (kldiag[ray]; no Ray when all cached)
            from kldiag.analysis import ray_engine  # noqa: PLC0415 - Ray is optional and slow to import

            yield from ray_engine.compute(jobs, size, self.cfg.strict, self.cfg.ray_address)
        elif self.cfg.workers > 1 and len(jobs) > 1:
            # forkserver: a fork of a process with threads (a dashboard, the prefetch reader) can deadlock.
            ctx = multiprocessing.get_context("forkserver" if sys.platform.startswith("linux") else "spawn")
            with ProcessPoolExecutor(max_workers=min(self.cfg.workers, len(jobs)), mp_context=ctx) as pool:
                yield from enumerate(pool.map(worker.compute, *zip(*jobs, strict=True), [size] * len(jobs)))
        else:
            worker.keep_freed_memory()
            yield from reduce.fold_parts(jobs, size, worker.PART_ERRORS)

    def partial(self, i: int, r: Reducer) -> Arrays | None:
        """Part i's partial of r (None when the part is unreadable or its cache file vanished)."""
        if i in self.failed:
            return None
        got = self.fresh.get((i, r.name))
        if got is None:
            got = reduce.load_arrays(reduce.cache_path(self.cache_dir, r, self.parts[i]))
        if got is None:  # its cache file is unreadable (another kldiag's, cut short): compute it again
            self.fresh.update(self._recompute(i, r))
            got = self.fresh.get((i, r.name))
        return got

    def _recompute(self, i: int, r: Reducer) -> dict[tuple[int, str], Arrays]:
        global opened_parts
        opened_parts += 1
        result = worker.compute(self.parts[i], [r], min(self.cfg.batch_size, KERNEL_ROWS))
        if isinstance(result, Exception):
            self.failed.add(i)
            skip(self.parts[i], result, self.cfg.strict, self.skipped)
            return {}
        if self.cfg.use_cache:
            reduce.save_arrays(reduce.cache_path(self.cache_dir, r, self.parts[i]), result[r.name])
        return {(i, r.name): result[r.name]}

    def partials(self, r: Reducer, indices: Sequence[int] | None = None) -> list[Arrays]:
        """The readable parts' partials of r, in part order."""
        found = (self.partial(i, r) for i in (range(len(self.parts)) if indices is None else indices))
        return [p for p in found if p is not None]

    def merged(self, r: Reducer) -> Arrays:
        """r.merge of every readable part's partial, in part order."""
        return r.merge(self.partials(r))


def bound(reducer: Reducer, parts: Sequence[PartInfo]) -> Reducer:
    """The reducer with its run-dependent settings fixed (a token sample's stride), if it has any."""
    return reducer.bind(parts) if hasattr(reducer, "bind") else reducer


def reduced(analysis, reducer: Reducer) -> Arrays:
    """The merged partial of `reducer` on an analysed run: the one the analysis read along when it
    was made with the same reducer, else one more pass (parts whose partial is cached are not read)."""
    run = open_run(analysis.run_dir)
    parts = run.parts()
    red = bound(reducer, parts)
    if analysis.memo.get(("reducer", red.name)) == red and red.name in analysis.reduced:
        return analysis.reduced[red.name]
    return Pass(run.cache_dir(), parts, [red], analysis.config).merged(red)
