"""`analyze(run_dir)`: stream every part once, cache its partial, merge, build the tables.

Parts are independent: each is reduced to a `Partial` (partials.py) by streaming record
batches, in this process, in `config.workers` processes or in Ray tasks (engine="ray",
ray_engine.py), or read back from the cache in RUN/.kldiag/; the merge of the earlier parts
is cached too (prefix.py). Partials are merged in part order whatever the workers did, so
the result of a cached, incremental or parallel analysis equals a full serial recompute exactly.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kldiag.analysis import alerts, partials, prefix, tables, worker
from kldiag.analysis.kernel import Thresholds
from kldiag.analysis.types import Analysis, AnalysisConfig
from kldiag.errors import CorruptPartError, EmptyRunError, RunFormatError
from kldiag.format import Manifest, PartInfo, open_run

OPSM_DELTA = 1e-4  # TRL's default off_policy_mask_threshold


def validate(cfg: AnalysisConfig) -> None:
    """Raise ValueError naming the option when a threshold makes no sense."""
    checks = [("tau", cfg.tau > 1, "> 1 (pi_theta at least tau times below pi_ref)"),
              ("weight_limit", cfg.weight_limit > 0, "> 0"), ("clamp", cfg.clamp > 0, "> 0"),
              ("clip_low", cfg.clip_low is None or 0 <= cfg.clip_low < 1, "in [0, 1)"),
              ("clip_high", cfg.clip_high is None or cfg.clip_high >= 0, ">= 0"),
              ("top_k", cfg.top_k >= 0, ">= 0"), ("alert_window", cfg.alert_window >= 1, ">= 1"),
              ("alert_factor", cfg.alert_factor > 1, "> 1"), ("workers", cfg.workers >= 1, ">= 1"),
              ("batch_size", cfg.batch_size >= 1, ">= 1"),
              ("engine", cfg.engine in ("local", "ray"), '"local" or "ray"'),
              ("opsm_delta", cfg.opsm_delta is None or math.isfinite(cfg.opsm_delta), "a finite number or None"),
              ("top_k_sequences", cfg.top_k_sequences is None or cfg.top_k_sequences >= 0, ">= 0 or None")]
    for name, ok, want in checks:
        if not ok:
            raise ValueError(f"AnalysisConfig.{name} = {getattr(cfg, name)!r} must be {want}")


def thresholds(cfg: AnalysisConfig, manifest: Manifest) -> Thresholds:
    """Kernel thresholds; the clip range comes from the config, else the manifest, else 0.2."""
    clip = manifest.config.get("clip_range") or [0.2, 0.2]
    if isinstance(clip, (int, float)):
        clip = [clip, clip]
    low = cfg.clip_low if cfg.clip_low is not None else float(clip[0])
    high = cfg.clip_high if cfg.clip_high is not None else float(clip[1])
    return Thresholds(float(cfg.tau), float(cfg.weight_limit), float(cfg.clamp), low, high, int(cfg.top_k))


def resolved(cfg: AnalysisConfig, manifest: Manifest) -> AnalysisConfig:
    """cfg with opsm_delta from the manifest's off_policy_mask_threshold when unset, else 1e-4."""
    if cfg.opsm_delta is not None:
        return cfg
    delta = manifest.config.get("off_policy_mask_threshold")
    return dataclasses.replace(cfg, opsm_delta=OPSM_DELTA if delta is None else float(delta))


def _skip(part: PartInfo, error: Exception, strict: bool, skipped: list[str]) -> None:
    if strict:
        raise error if isinstance(error, RunFormatError) else CorruptPartError(
            f"part file {part.path} is unreadable ({error}); delete it or move it out of the run") from error
    warnings.warn(f"kldiag: skipping part {part.path}: {error}", stacklevel=3)
    skipped.append(str(part.path))


def part_partials(cache_dir: Path, parts: list[PartInfo], th: Thresholds, cfg: AnalysisConfig,
                  skipped: list[str]) -> tuple[list[partials.Partial], int]:
    """The partial of every readable part, in part order; also how many were computed now.

    cache_dir: the run's cache directory (Run.cache_dir(): RUN/.kldiag, or a local one for URIs).
    """
    found: dict[int, partials.Partial] = {}
    if cfg.use_cache:
        for i, part in enumerate(parts):
            cached = partials.load(partials.cache_path(cache_dir, part, th))
            if cached is not None:
                found[i] = cached
    todo = [i for i in range(len(parts)) if i not in found]
    if cfg.engine == "ray":  # Ray tasks run _compute where the parts are (kldiag[ray]; no Ray when all cached)
        from kldiag.analysis import ray_engine

        results = ray_engine.compute([parts[i] for i in todo], th, cfg.batch_size, cfg.strict, cfg.ray_address)
    elif cfg.workers > 1 and len(todo) > 1:
        # forkserver: a fork of a process with threads (a dashboard, the prefetch reader) can deadlock.
        ctx = multiprocessing.get_context("forkserver" if sys.platform.startswith("linux") else "spawn")
        with ProcessPoolExecutor(max_workers=min(cfg.workers, len(todo)), mp_context=ctx) as pool:
            results = list(pool.map(worker.compute, [parts[i] for i in todo], [th] * len(todo),
                                    [cfg.batch_size] * len(todo)))
    else:
        worker.keep_freed_memory()
        by_index = dict(partials.compute_parts([parts[i] for i in todo], th, cfg.batch_size, worker.PART_ERRORS))
        results = [by_index[k] for k in range(len(todo))]
    for i, result in zip(todo, results, strict=True):
        if isinstance(result, Exception):
            _skip(parts[i], result, cfg.strict, skipped)
            continue
        found[i] = result
        if cfg.use_cache:
            partials.save(partials.cache_path(cache_dir, parts[i], th), result)
    return [found[i] for i in sorted(found)], len(todo)


def analyze(run_dir: str | os.PathLike, config: AnalysisConfig | None = None) -> Analysis:
    """Analyse a run directory (format v1); see kldiag.analysis.types.Analysis for the result.

    Raises NotARunError / UnsupportedFormatVersionError for a directory that is not a
    readable run, EmptyRunError when it holds no token rows yet.
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
    skipped: list[str] = []
    # merges the new parts' partials after the cached merge of the earlier ones (prefix.py)
    merged, computed = prefix.merged_partial(run.cache_dir(), parts, th, cfg, skipped, part_partials)
    if merged.rows == 0:
        raise EmptyRunError(f"run {run.path} has no readable token rows ({len(parts)} part file(s), "
                            f"{len(skipped)} skipped as unreadable)")
    return build(run, resolved(cfg, run.manifest), merged, len(parts), computed, skipped, time.perf_counter() - t0)


def build(run, cfg: AnalysisConfig, merged: partials.Partial, files: int, computed: int,
          skipped: list[str], seconds: float) -> Analysis:
    per_step = tables.by_step(merged.steps)
    steps = tables.step_table(per_step, merged.seqs, cfg)
    flags = tables.flag_table(merged.top, merged.bad, run.vocab(), cfg)
    return Analysis(
        run_dir=run.path, manifest=run.manifest, config=cfg, steps=steps,
        sequences=tables.sequence_table(merged.seqs, cfg), flags=flags,
        histograms=tables.histograms(per_step), alerts=alerts.compute_alerts(steps, flags, cfg, run.manifest),
        steps_by_rank=tables.step_table(merged.steps, merged.seqs, cfg, ("step", "rank")) if cfg.per_rank else None,
        trainer_kl=tables.trainer_kl(merged.seqs, run.manifest.config, run) if cfg.trainer_compatible else None,
        files=files, files_new=computed, skipped=skipped, superseded=tables.superseded_table(merged.superseded),
        info={"rows": merged.rows, "seconds": seconds, "tokens_per_s": merged.rows / max(seconds, 1e-9),
              "superseded_rows": int(merged.superseded["n_rows"].sum()) if merged.superseded else 0})
