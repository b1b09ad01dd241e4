"""What the dashboard reads: every page's reducers, handed to `analyze` in one pass over the parts."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading

import pyarrow as pa

from kldiag import format as F
from kldiag.analysis import analyze
from kldiag.analysis.reducers.mismatch_tokens import MismatchTokensReducer
from kldiag.analysis.types import AnalysisConfig
from kldiag.diagnosis import truncation as TR
from kldiag.diagnosis.core import reducers as diagnosis_reducers
from kldiag.mismatch import signatures as S
from kldiag.views.estimators import EstimatorReducer

DEFAULT_CONFIG = AnalysisConfig()


def reducers(config: AnalysisConfig = DEFAULT_CONFIG) -> list:
    """What the dashboard's pages read besides the analysis tables, as reducers for
    `analyze(run, config, reducers)`: one read of each part serves the Overview, Distributions, Tokens,
    Mismatch (with its per-turn chart: the diagnosis's `turns` reducer), Estimators (`estimator_reducer`,
    one compiled pass per batch) and Compare pages. Only the Sequence page reads a part again: the one
    that holds its sequence."""
    return [*diagnosis_reducers(), estimator_reducer(config), MismatchTokensReducer()]


def estimator_reducer(config: AnalysisConfig = DEFAULT_CONFIG) -> EstimatorReducer:
    """The Estimators page's reducer (read in the analysis's pass with `reducers()`, cached per part)."""
    return EstimatorReducer(config.tau, config.weight_limit, config.clamp)


PREPARE_ROWS = 4096  # the rows of the run's last part that `prepare_refresh` analyses


def prepare_refresh(run_dir: str | os.PathLike, config: AnalysisConfig = DEFAULT_CONFIG) -> None:
    """A live dashboard's refresh made ready before the first new part arrives:
    - its analysis pass: `analyze` with `reducers()` on the first PREPARE_ROWS rows of the run's last part,
      copied to a temporary run (no cache), so that each compiled kernel the pass runs is loaded (numba
      reads its machine code from its cache on a signature's first call: about 0.4 s for the pass's
      kernels); same columns and types as the run's own parts, so the same signatures;
    - the diagnosis's fits on the token sample (parity, signatures, truncation) of the run as it is, kept
      for the next analysis while its sample is the same (kldiag.mismatch.kept: a new part rarely adds to it).
    Nothing is returned; a run with no part is left alone."""
    parts = F.list_parts(run_dir)
    if not parts:
        return
    last = parts[-1]
    batch = next(last.open().iter_batches(batch_size=PREPARE_ROWS), None)  # a local file or an object
    if batch is None:
        return
    table = pa.Table.from_batches([batch])
    with tempfile.TemporaryDirectory(prefix="kldiag-prepare-") as tmp:
        F.write_manifest(tmp, F.read_manifest(run_dir))
        steps = table.column("step")
        name = F.part_name(int(steps[0].as_py()), int(steps[-1].as_py()), 0, last.attempt)
        F.publish_part(table, F.rank_dir(tmp, last.rank), name)
        analyze(tmp, dataclasses.replace(config, use_cache=False), reducers(config))
    _prepare_fits(analyze(run_dir, config, reducers(config)))  # warm: the app's analysis, from the same cache


def _prepare_fits(analysis) -> None:
    S.report_for(analysis)  # and the parity fit it reads
    TR.report_for(analysis)


_PREPARING: dict[str, threading.Thread] = {}
_LOCK = threading.Lock()


def prepare_refresh_in_background(run_dir: str | os.PathLike, config: AnalysisConfig = DEFAULT_CONFIG
                                  ) -> threading.Thread:
    """`prepare_refresh` in a daemon thread, once per run and process (later calls give that thread): the
    dashboard starts it when Live is turned on. A failure is left to the refresh itself to report."""
    key = os.fspath(run_dir)
    with _LOCK:
        if key not in _PREPARING:
            _PREPARING[key] = threading.Thread(target=_prepare_quietly, args=(key, config), daemon=True,
                                               name="kldiag-prepare-refresh")
            _PREPARING[key].start()
        return _PREPARING[key]


def _prepare_quietly(run_dir: str, config: AnalysisConfig) -> None:
    try:
        prepare_refresh(run_dir, config)
    except Exception:  # noqa: BLE001 - a warm-up only: whatever fails here, the refresh meets and shows
        pass
