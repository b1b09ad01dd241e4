"""`analyze(run_dir)`: stream every part once, cache its partial, merge, build the tables.

Parts are independent: each is reduced to a `Partial` (partials.py) by streaming record
batches, in this process's reader threads (`config.threads`, default one per core it may use)
or in Ray tasks (engine="ray", ray_engine.py), or read back from the cache in RUN/.kldiag/; the
merge of the earlier parts is cached too (prefix.py). Partials are merged in part order whatever
the threads or tasks did, so the result of a cached, incremental or parallel analysis equals a
full serial recompute exactly.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Sequence

from kldiag.analysis.cache import prefix, store
from kldiag.analysis.core import keyed, partials, seqrows, spill, tables
from kldiag.analysis.core.batch import Thresholds, clip_range
from kldiag.analysis.protocol import Reducer
from kldiag.analysis.rules import alerts
from kldiag.analysis.runtime import lost, runner, worker
from kldiag.analysis.types import Analysis, AnalysisConfig
from kldiag.errors import EmptyRunError
from kldiag.format import Manifest, open_run, vocab_stamp

OPSM_DELTA = 1e-4  # TRL's default off_policy_mask_threshold
WORKERS_GONE = ("AnalysisConfig.workers is gone: its process pool was 2-3x slower than the default, which reads and "
                "reduces the parts in a thread per core; drop it (threads=N caps the threads, engine=\"ray\" spreads "
                "the parts over machines)")


def validate(cfg: AnalysisConfig) -> None:
    """Raise ValueError naming the option when a threshold makes no sense."""
    if cfg.workers is not None:
        raise ValueError(WORKERS_GONE)
    checks = [("tau", cfg.tau > 1, "> 1 (pi_theta at least tau times below pi_ref)"),
              ("weight_limit", cfg.weight_limit > 0, "> 0"), ("clamp", cfg.clamp > 0, "> 0"),
              ("clip_low", cfg.clip_low is None or 0 <= cfg.clip_low < 1, "in [0, 1)"),
              ("clip_high", cfg.clip_high is None or cfg.clip_high >= 0, ">= 0"),
              ("top_k", cfg.top_k >= 0, ">= 0"), ("alert_window", cfg.alert_window >= 1, ">= 1"),
              ("alert_factor", cfg.alert_factor > 1, "> 1"),
              ("threads", cfg.threads is None or cfg.threads >= 1, ">= 1 or None (one per core)"),
              ("batch_size", cfg.batch_size >= 1, ">= 1"),
              ("engine", cfg.engine in ("local", "ray"), '"local" or "ray"'),
              ("opsm_delta", cfg.opsm_delta is None or math.isfinite(cfg.opsm_delta), "a finite number or None"),
              ("top_k_sequences", cfg.top_k_sequences is None or cfg.top_k_sequences >= 0, ">= 0 or None")]
    for name, ok, want in checks:
        if not ok:
            raise ValueError(f"AnalysisConfig.{name} = {getattr(cfg, name)!r} must be {want}")


def thresholds(cfg: AnalysisConfig, manifest: Manifest) -> Thresholds:
    """Kernel thresholds; the clip range comes from the config, else the manifest, else 0.2."""
    low, high = clip_range(cfg.clip_low, cfg.clip_high, manifest)
    return Thresholds(float(cfg.tau), float(cfg.weight_limit), float(cfg.clamp), low, high, int(cfg.top_k),
                      bool(cfg.per_rank))


def resolved(cfg: AnalysisConfig, manifest: Manifest) -> AnalysisConfig:
    """cfg with opsm_delta from the manifest's off_policy_mask_threshold when unset, else 1e-4."""
    if cfg.opsm_delta is not None:
        return cfg
    delta = manifest.config.get("off_policy_mask_threshold")
    return dataclasses.replace(cfg, opsm_delta=OPSM_DELTA if delta is None else float(delta))


def analyze(run_dir: str | os.PathLike, config: AnalysisConfig | None = None,
            reducers: Sequence[Reducer] = ()) -> Analysis:
    """Analyse a run directory (format v1); see kldiag.analysis.types.Analysis for the result.

    `reducers` ride along in the same read of each part (a face asks for what it will show:
    the diagnosis's side scan, a token sample, ...); their merged partials are in
    `Analysis.reduced[name]`. Raises NotARunError / UnsupportedFormatVersionError for a directory
    that is not a readable run, EmptyRunError when it holds no token rows yet.
    """
    cfg = config or AnalysisConfig()
    validate(cfg)
    t0 = time.perf_counter()
    worker.keep_freed_memory()
    run = open_run(run_dir)
    parts = run.parts()
    if not parts:
        raise EmptyRunError(f"run {run.path} has no published part files yet (tokens/rank-R/part-*.parquet); "
                            "record some steps first, or wait for the recorder to rotate its first file")
    th = thresholds(cfg, run.manifest)
    others = [runner.bound(r, parts, (th.clip_low, th.clip_high)) for r in reducers
              if r.name != partials.AnalysisReducer.name]
    skipped: list[str] = []
    empty: set[str] = set()
    merged, reduced, computed = read_run(run.cache_dir(), parts, th, cfg, others, skipped, empty)
    if merged.rows == 0:
        if cfg.use_cache:  # nothing was cached: the folders the spill made go too
            prefix.drop_empty_spill(run.cache_dir())
        e = EmptyRunError(f"run {run.path} has no readable token rows ({len(parts)} part file(s), "
                          f"{len(skipped)} skipped as unreadable)")
        e.skipped = list(skipped)  # parts published but unreadable: a watcher tells them from a run not started
        raise e
    a = build(run, resolved(cfg, run.manifest), merged, len(parts), computed, skipped, time.perf_counter() - t0,
              seqrows.spill_dir(run.cache_dir()))
    empty = lost.empty_parts(run.cache_dir() if cfg.use_cache else None, empty)
    a.lost = lost.lost_parts(parts, skipped, empty)  # the facts behind the diagnosis's data_missing
    a.spans = lost.read_spans(parts, a.lost)
    a.reduced = reduced
    a.memo.update({("reducer", r.name): r for r in others})  # which settings each was read with
    a.memo["parts"] = (run, parts)  # what it read: a later reducer binds to these, without listing the run again
    store.bind(a, run.cache_dir(), parts, skipped, cfg.use_cache, vocab_stamp(run.store))  # derived results' key
    worker.release_freed_memory()
    return a


def read_run(cache_dir, parts, th: Thresholds, cfg: AnalysisConfig, others: Sequence[Reducer],
             skipped: list[str], empty: set[str] | None = None) -> tuple[partials.Partial, dict, int]:
    """One pass over the parts: the merged analysis partial, the other reducers' merged partials, and
    how many parts were read; `empty` collects the keys of the parts read now that hold no row. With a cached prefix (prefix.py) the analysis merges only the partials
    of the parts after it (and of its open ones); without, it merges as partials arrive (prefix.Stream)."""
    red = partials.AnalysisReducer(th)
    pre = prefix.load(cache_dir, parts, th) if cfg.use_cache else None
    k = pre.k if pre else 0
    opened = {i for i in range(k) if parts[i].step_max >= pre.step_cut} if pre else set()
    spill_to = prefix.spill_folder(cache_dir) if cfg.use_cache else None  # None: unnamed temporary files
    stream, tail = (prefix.Stream(parts, th.top_k, spill_to) if pre is None else None), {}
    before_gap: list[partials.Partial] = []  # the merge of the parts before the first unreadable one

    def analysis_sink(i: int, arrays) -> None:
        p = partials.from_arrays(arrays)
        if p.rows == 0 and empty is not None and not parts[i].exclude:  # not rows a later attempt superseded
            empty.add(parts[i].key)
        if stream is None:
            tail[i] = p
            return
        if i != stream.added and not before_gap:
            before_gap.append(stream.result())
        stream.add(i, p)

    accs = runner.accumulators(cache_dir, parts, others, cfg.use_cache)  # from their prefix (reducer_prefix.py)
    done = runner.Pass(cache_dir, parts, [red, *others], cfg, skipped,
                       wanted=lambda i, r: i >= k or i in opened if r.name == red.name else i >= accs[r.name].start)
    done.run({red.name: analysis_sink, **accs})
    reduced = runner.results(accs, cache_dir, parts, cfg.use_cache)  # merged when a face first reads one
    if pre is not None and opened & done.failed:  # a prefix part unreadable now: merge without the prefix
        del skipped[:]
        merged, _, more = read_run(cache_dir, parts, th, dataclasses.replace(cfg, use_cache=False), [], skipped, empty)
        return merged, reduced, done.computed + more
    if stream is not None:
        merged = stream.result(chunked=True)
        end = min(done.failed, default=len(parts))  # a prefix never covers an unreadable part
        if cfg.use_cache and end > 0:
            covered = before_gap[0] if before_gap else merged
            prefix.save(cache_dir, parts, th, prefix.seal(covered, end, parts[end - 1].step_min))
        return merged, reduced, done.computed
    after = [tail[i] for i in range(k, len(parts)) if i in tail]
    merged = prefix.combine(pre, [tail[i] for i in sorted(opened)], after, th.top_k, chunked=True)
    if cfg.use_cache:
        prefix.refresh(cache_dir, parts, th, pre, tail, merged)
    return merged, reduced, done.computed


def build(run, cfg: AnalysisConfig, merged: partials.Partial, files: int, computed: int,
          skipped: list[str], seconds: float, spill_dir=None) -> Analysis:
    """The Analysis from the merged partial. Its seqs rows are consumed (merged.seq_chunks emptied):
    the per-step figures that need them first, then the sequence table chunk by chunk (seqrows.py)."""
    per_step = tables.by_step(merged.steps)
    chunks = merged.seq_rows()
    steps = tables.step_table(per_step, chunks, cfg)
    opsm = tables.opsm_counts(chunks)
    flags = tables.flag_table(merged.top, merged.bad, run.vocab(), cfg)
    by_rank = tables.step_table(merged.steps, chunks, cfg, ("step", "rank")) if cfg.per_rank else None
    trainer_kl = tables.trainer_kl(chunks, run.manifest.config, run) if cfg.trainer_compatible else None
    whole = lambda s: tables.sequence_table(s, cfg)  # noqa: E731
    if cfg.top_k_sequences is not None or not merged.seq_chunks:  # a selection over every row: in memory
        sequences = whole(keyed.concat(list(spill.loaded(chunks))))
    else:
        sequences = seqrows.build(merged.seq_chunks, whole, spill_dir, whole, (cfg.opsm_delta,))
    return Analysis(
        run_dir=run.path, manifest=run.manifest, config=cfg, steps=steps,
        sequences=sequences, flags=flags,
        histograms=tables.histograms(per_step), alerts=alerts.compute_alerts(steps, flags, cfg, run.manifest),
        steps_by_rank=by_rank, trainer_kl=trainer_kl, opsm=opsm,
        flag_context=tables.flag_context(merged.top, merged.bad),
        files=files, files_new=computed, skipped=skipped, superseded=tables.superseded_table(merged.superseded),
        info={"rows": merged.rows, "seconds": seconds, "tokens_per_s": merged.rows / max(seconds, 1e-9),
              "superseded_rows": int(merged.superseded["n_rows"].sum()) if merged.superseded else 0,
              "placeholders": int(merged.steps["n_placeholder"].sum()) if "n_placeholder" in merged.steps else 0})
