"""Runs reducers over a run's parts: each part read at most once, partials cached, merged in part order.

`Pass(cache_dir, parts, reducers, cfg).run(sinks)` walks the parts in order. A part whose cached
partial some reducer lacks is read once for all those reducers (only the union of their columns),
in this process's reader threads (`cfg.threads`, default one per core) or in Ray tasks; results
come back in part order and each partial is saved to the cache and handed to its reducer's sink
at once, so nothing is held until the end: a sink merges as partials arrive (`Accumulator`, or the
analysis's sealing merge). The exception, a concatenation that can cut its state back (the token
sample): its partials are written as the pass ends, only those of parts no saved state covers
(`Accumulator.hold`). `opened_parts` counts the parts read, for tests and benches.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache import side_prefix as reducer_prefix
from kldiag.analysis.core.batch import clip_range
from kldiag.analysis.protocol import KERNEL_ROWS, Arrays, Reducer
from kldiag.analysis.runtime import part_fold, worker
from kldiag.errors import CorruptPartError, RunFormatError
from kldiag.format import PartInfo, open_run

MERGE_EVERY = 32  # an Accumulator merges this many partials at a time
opened_parts = 0  # parts read by any Pass in this process (tests: "each part at most once")
Sink = Callable[[int, Arrays], None]  # (part index, partial), called in part order
Wanted = Callable[[int, Reducer], bool]  # whether reducer r needs part i's partial at all


def skip(part: PartInfo, error: Exception, strict: bool, skipped: list[str]) -> None:
    """Warn about an unreadable part and remember it (strict: raise, naming the fix)."""
    if strict:
        raise error if isinstance(error, RunFormatError) else CorruptPartError(
            f"part file {part.path} is unreadable ({error}); restore it from a copy if one exists, "
            "or move it out of the run directory to read the rest (its rows are lost)") from error
    warnings.warn(f"kldiag: skipping part {part.path}: {error}", stacklevel=4)
    skipped.append(str(part.path))


class Accumulator:
    """A sink that merges partials as they arrive, in part order, `reducer.merge_every` at a time
    (default MERGE_EVERY; 0: once at the end, for a reducer whose merge is a concatenation, which
    merging in steps would copy again and again).

    `state` (reducer_prefix.State) starts it where the merge of parts[0:state.k] left off: it is then
    handed only the partials of the later parts, and its result equals the merge of every part's.

    A concatenation that can cut its merge (the reducer's `slice_rows`, reducer_prefix.cut) counts each
    part's rows (`length`), which its state records, and its partials computed in this pass are held
    (`hold`), not written at once: a state that `keep` saves and that can be cut holds the same rows, so
    it is their one copy in the cache, and `save_held` writes only those of the parts after it (the
    token sample: 120 MB at 30M rows, once, not twice). A state that cannot be cut (the sample once
    capped) leaves every held partial written, as a restart falls back on them. A cut state's `spare`
    partials (later parts it holds, still listed) are handed out by `take` instead of being read; they
    are written only when a new state replaces the one that holds them and does not cover them."""

    def __init__(self, reducer: Reducer, every: int | None = None, state: reducer_prefix.State | None = None):
        self.reducer = reducer
        self.every = every if every is not None else getattr(reducer, "merge_every", MERGE_EVERY)
        self.acc: Arrays | None = state.acc if state else None
        self.buf: list[Arrays] = list(state.buf) if state else []
        self.done: Arrays | None = state.result if state else None  # parts[0:k] merged, nothing after
        self.start = self.next = state.k if state else 0  # the index the next partial should have
        self.gap: reducer_prefix.State | None = None  # the state before the first unreadable part
        self.held: dict[int, tuple[Path, Arrays, bool]] = {}  # part index: (its cache file, its partial,
        # whether it came from the loaded state), unwritten
        self.covered = 0  # parts[0:covered] are in a state keep() saved: their held partials are not written
        self.replaced = False  # keep() saved a state: the loaded one, and the spare partials it held, are gone
        self.spare: dict[str, Arrays] = dict(state.spare) if state and state.spare else {}
        cuts = not self.every and hasattr(reducer, "slice_rows") and hasattr(reducer, "length")
        had = state.rows if state else []  # None: a state whose rows were not recorded
        self.rows: list[int] | None = list(had) if cuts and had is not None else None  # each part's, parts[0] on

    def hold(self, i: int, path: Path, arrays: Arrays, spare: bool = False) -> bool:
        """Keep part i's computed partial (or spare: one `take` gave) to write later (save_held), if this
        reducer is a concatenation that can cut its state (its rows counted); False: write it now."""
        if self.rows is None:
            return False
        self.held[i] = (path, arrays, spare)
        return True

    def take(self, i: int, part: PartInfo, path: Path) -> Arrays | None:
        """Part i's partial from the loaded state (a cut state's spare, held), else None."""
        if not self.spare:
            return None
        arrays = self.spare.pop(reducer_prefix.part_digest(part), None)
        if arrays is not None and not self.hold(i, path, arrays, spare=True):
            reduce.save_arrays(path, arrays)  # not reached: a state has spare partials only when rows count
        return arrays

    def save_held(self) -> None:
        """Write the held partials that no saved state covers (the parts after it, or all of them; a spare
        one only once the state that held it is replaced)."""
        for i, (path, arrays, spare) in sorted(self.held.items()):
            if i >= self.covered and (self.replaced or not spare):
                reduce.save_arrays(path, arrays)
        self.held = {}

    def cuts_back(self, state: reducer_prefix.State) -> bool:
        """Whether a later read can cut `state` (its rows recorded, the reducer's slice_rows takes its partial)."""
        return (state.rows is not None and state.acc is None and len(state.buf) == 1
                and self.reducer.slice_rows(state.buf[0], 0, 0) is not None)

    def __call__(self, i: int, arrays: Arrays) -> None:
        if i != self.next and self.gap is None:  # parts next..i-1 were unreadable: a prefix stops there
            self.gap = self.state()
        self.next, self.done = i + 1, None
        if self.rows is not None and self.gap is None:
            self.rows.append(self.reducer.length(arrays))
        self.buf.append(arrays)
        if self.every and len(self.buf) >= self.every:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self.acc = self.reducer.merge(([self.acc] if self.acc is not None else []) + self.buf)
            self.buf = []

    def state(self) -> reducer_prefix.State:
        """What a merge that goes on from here needs: acc and the unmerged partials (merged into one
        for a reducer whose merge is a concatenation)."""
        if not self.every and len(self.buf) > 1:
            self.buf = [self.reducer.merge(self.buf)]
        rows = list(self.rows) if self.rows is not None and len(self.rows) == self.next else None
        return reducer_prefix.State(self.next, self.acc, list(self.buf), rows=rows)

    def result(self) -> Arrays:
        if self.done is not None:
            return self.done
        if not self.every and self.acc is None and len(self.buf) == 1:
            return self.buf[0]  # a concatenation of one partial: itself (no copy of a large sample)
        self.flush()
        return self.acc if self.acc is not None else self.reducer.merge([])

    def due(self) -> bool:
        """Whether keep() saves a state (reducer_prefix.due)."""
        end = self.gap.k if self.gap is not None else (self.next if self.done is None else self.start)
        return reducer_prefix.due(self.start, end) and end > self.start

    def keep(self, cache_dir: Path, parts: Sequence[PartInfo]) -> Arrays:
        """The result, after saving the state of the readable parts that lead the listing when it is due
        (reducer_prefix.due); the result is saved with it when it covers every part."""
        if not self.due():
            return self.result()
        state = self.gap or self.state()
        out = self.result()
        if self.gap is None and state.k == len(parts):
            state.result = out
        if reducer_prefix.save(cache_dir, parts, self.reducer, state):
            self.replaced = True
            self.covered = state.k if self.cuts_back(state) else 0
        self.save_held()
        return out


class Reduced(Mapping):
    """Reducer name -> merged partial (Analysis.reduced), each merged on first use: a page that shows one
    reducer's figures does not merge the others' (a refresh after a new part merges what is shown)."""

    def __init__(self, make: dict[str, Callable[[], Arrays]]):
        self._make, self._done, self._lock = dict(make), {}, threading.Lock()

    def __getitem__(self, name: str) -> Arrays:
        if name not in self._done:
            make = self._make[name]
            with self._lock:  # the app's sessions share an Analysis: merged once
                if name not in self._done:
                    self._done[name] = make()
        return self._done[name]

    def __contains__(self, name: object) -> bool:  # Mapping's would merge it (its __getitem__) to answer
        return name in self._make

    def __iter__(self) -> Iterator[str]:
        return iter(self._make)

    def __len__(self) -> int:
        return len(self._make)

    def __reduce__(self):
        return _ready, (dict(self.items()),)


def _ready(done: dict[str, Arrays]) -> Reduced:
    return Reduced({name: (lambda v=v: v) for name, v in done.items()})


def results(accs: dict[str, Accumulator], cache_dir: Path, parts: Sequence[PartInfo], use_cache: bool) -> Reduced:
    """Each accumulator's result, merged when first used; those whose prefix state is due to be saved
    (Accumulator.keep) are merged and saved now."""
    out = Reduced({name: functools.partial(acc.keep, cache_dir, parts) if use_cache else acc.result
                   for name, acc in accs.items()})
    for name, acc in accs.items():
        if use_cache and acc.due():
            out[name]
        acc.save_held()  # a state not due: every held partial written now, not when (if) a face reads it
    return out


def accumulators(cache_dir: Path, parts: Sequence[PartInfo], reducers: Sequence[Reducer],
                 use_cache: bool) -> dict[str, Accumulator]:
    """An Accumulator per reducer, started from its cached prefix state when there is one (a concatenation's
    cut back to the parts that still lead the listing: reducer_prefix.cut)."""
    return {r.name: Accumulator(r, state=reducer_prefix.load(cache_dir, parts, r, cut_back=True) if use_cache else None)
            for r in reducers}


class Pass:
    """One walk over `parts` for `reducers`: cached partials loaded, missing ones computed in one read."""

    def __init__(self, cache_dir: Path, parts: Sequence[PartInfo], reducers: Sequence[Reducer], cfg,
                 skipped: list[str] | None = None, wanted: Wanted | None = None):
        self.cache_dir, self.parts, self.reducers, self.cfg = Path(cache_dir), list(parts), list(reducers), cfg
        self.skipped = skipped if skipped is not None else []
        self.wanted = wanted or (lambda i, r: True)
        self.failed: set[int] = set()
        self.computed = 0
        self._paths: dict[tuple[int, str], Path] = {}
        self._names: dict[str, set[str]] = {}

    def _path(self, i: int, r: Reducer) -> Path:
        """Part i's cache file of r, its key hashed once a pass (looked up, then written)."""
        path = self._paths.get((i, r.name))
        if path is None:
            path = self._paths[(i, r.name)] = reduce.cache_path(self.cache_dir, r, self.parts[i])
        return path

    def _listed(self, r: Reducer) -> set[str]:
        """The names in r's cache folder, listed once a pass: on a fresh cache no part's file is opened to
        find it missing (a file another process writes meanwhile is computed again, and written alike)."""
        names = self._names.get(r.name)
        if names is None:
            try:
                names = set(os.listdir(self.cache_dir / r.name))
            except OSError:
                names = set()
            self._names[r.name] = names
        return names

    def run(self, sinks: dict[str, Sink]) -> None:
        """Hand every wanted partial to sinks[reducer name], part by part in order."""
        global opened_parts
        need = [[r for r in self.reducers if self.wanted(i, r)] for i in range(len(self.parts))]
        loaded: dict[tuple[int, str], Arrays] = {}
        jobs = []
        for i, rs in enumerate(need):
            missing = [r for r in rs if not (self.cfg.use_cache and (self._take(i, r, sinks.get(r.name), loaded)
                                                                     or self._load(i, r, loaded)))]
            if missing:
                jobs.append((i, missing))
        self.computed = len(jobs)
        opened_parts += len(jobs)
        results = self._results([(self.parts[i], rs) for i, rs in jobs])
        if not jobs:
            list(results)  # nothing to read; the Ray engine still says when Ray is missing
        pending = dict(jobs)
        for i, rs in enumerate(need):
            got = dict(next(results)[1]) if i in pending else {}
            if isinstance(got.get("error"), Exception):
                self.failed.add(i)
                skip(self.parts[i], got["error"], self.cfg.strict, self.skipped)
                continue
            for r in rs:
                arrays = got.get(r.name)
                if arrays is not None and self.cfg.use_cache:
                    hold = getattr(sinks[r.name], "hold", None)  # an Accumulator's (a concatenation's: later)
                    if hold is None or not hold(i, self._path(i, r), arrays):
                        reduce.save_arrays(self._path(i, r), arrays)
                sinks[r.name](i, arrays if arrays is not None else loaded.pop((i, r.name)))
        self.computed -= len(self.failed & set(pending))  # a part that could not be read was not analysed

    def _take(self, i: int, r: Reducer, sink, loaded: dict) -> bool:
        """Part i's partial of r from the sink's loaded state (Accumulator.take: a cut state's), if it has it."""
        take = getattr(sink, "take", None)
        got = take(i, self.parts[i], self._path(i, r)) if take is not None else None
        if got is not None:
            loaded[(i, r.name)] = got
        return got is not None

    def _load(self, i: int, r: Reducer, loaded: dict) -> bool:
        path = self._path(i, r)
        if path.name not in self._listed(r):
            return False
        got = reduce.load_arrays(path)  # unreadable (another kldiag's, cut short): computed again
        if got is not None:
            loaded[(i, r.name)] = got
        return got is not None

    def _results(self, jobs: list[part_fold.Job]) -> Iterator[tuple[int, dict]]:
        """(job index, {reducer name: partial} or {"error": e}), in job order, however the work is spread."""
        for k, result in self._raw(jobs):
            yield k, {"error": result} if isinstance(result, Exception) else result

    def _raw(self, jobs: list[part_fold.Job]) -> Iterator[tuple[int, dict | Exception]]:
        size = min(self.cfg.batch_size, KERNEL_ROWS)
        if self.cfg.engine == "ray":  # Ray tasks run where the parts are (kldiag[ray]; no task when all cached)
            from kldiag.analysis.runtime import ray as ray_engine  # noqa: PLC0415 - Ray is optional and slow to import

            yield from ray_engine.compute(jobs, size, self.cfg.strict, self.cfg.ray_address)
        elif jobs:
            # Threads, not processes: decoding and the kernels release the GIL, and a process pool
            # pays its start, imports and the partials' pickling (docs/metrics.md, "Streaming, cache, threads").
            worker.keep_freed_memory()
            yield from part_fold.fold_parts(jobs, size, worker.PART_ERRORS, threads=worker.threads(self.cfg.threads))

    def merged(self, r: Reducer) -> Arrays:
        """r's merge of every readable part's partial (a pass for this one reducer; from its cached
        prefix state, reducer_prefix.py, and the parts after it)."""
        return self.merged_all([r])[r.name]

    def merged_all(self, reducers: Sequence[Reducer]) -> Reduced:
        """Each reducer's merge of every readable part's partial, from one pass (each from its cached prefix
        state and the parts after it), merged when first used."""
        accs = accumulators(self.cache_dir, self.parts, reducers, self.cfg.use_cache)
        wanted = self.wanted
        self.wanted = lambda i, red: i >= accs[red.name].start and wanted(i, red)
        try:
            self.run(accs)
        finally:
            self.wanted = wanted
        return results(accs, self.cache_dir, self.parts, self.cfg.use_cache)


def bound(reducer: Reducer, parts: Sequence[PartInfo], clip: tuple[float, float] | None = None) -> Reducer:
    """The reducer with its run-dependent settings fixed (a token sample's stride; the run's PPO clip
    range `clip` = (clip_low, clip_high) for a reducer that counts clipped tokens), if it has any."""
    reducer = reducer.bind(parts) if hasattr(reducer, "bind") else reducer
    return reducer.with_clip(clip) if clip is not None and hasattr(reducer, "with_clip") else reducer


def parts_of(analysis) -> tuple:
    """(run, parts) an analysis read (kept in its memo by engine.analyze), else the run listed now."""
    if "parts" in getattr(analysis, "memo", {}):
        return analysis.memo["parts"]
    run = open_run(analysis.run_dir)
    return run, run.parts()


def _bound_to(analysis, run, parts: Sequence[PartInfo], reducer: Reducer) -> tuple[Reducer, bool]:
    """(reducer bound to `parts`, the analysis's (parts_of), whether the analysis read it along)."""
    red = bound(reducer, parts, clip_range(analysis.config.clip_low, analysis.config.clip_high, run.manifest))
    return red, analysis.memo.get(("reducer", red.name)) == red and red.name in analysis.reduced


def reduced(analysis, reducer: Reducer) -> Arrays:
    """The merged partial of `reducer` on an analysed run: the one the analysis read along when it
    was made with the same reducer, else one more pass over the parts the analysis read (those whose
    partial is cached are not read)."""
    run, parts = parts_of(analysis)
    red, along = _bound_to(analysis, run, parts, reducer)
    if along:
        return analysis.reduced[red.name]
    return Pass(run.cache_dir(), parts, [red], analysis.config).merged(red)


def read_along(analysis, reducers: Sequence[Reducer]) -> int:
    """Read every one of `reducers` that the analysis did not read along in one pass over its parts, as if
    it had: each is then in analysis.reduced (merged when first used) and `reduced` returns it without a
    read. What `analyze(run)` then several `reduced` calls would read part by part, once per reducer, is read
    once (a part whose partials are all cached, not at all). Returns how many reducers were read."""
    run, parts = parts_of(analysis)  # once: a run listed again (no memo) could have grown meanwhile
    bound_ = [_bound_to(analysis, run, parts, r) for r in reducers]
    missing = list({red.name: red for red, along in bound_ if not along}.values())
    if not missing:
        return 0
    got = Pass(run.cache_dir(), parts, missing, analysis.config).merged_all(missing)
    had = analysis.reduced
    analysis.reduced = Reduced({**{n: functools.partial(had.__getitem__, n) for n in had if n not in got},
                                **{n: functools.partial(got.__getitem__, n) for n in got}})
    analysis.memo.update({("reducer", red.name): red for red in missing})
    return len(missing)
