"""The Ray engine: `AnalysisConfig(engine="ray")`, `kldiag analyze RUN --engine ray`.

One plain Ray task per part runs the local engine's own per-part function (worker.compute ->
part_fold.compute_part: every reducer lacking the part's partial) where the part lives (a shared
filesystem or object storage), and returns the part's small partials: token rows never enter the
object store, only partials travel to the driver, which merges them in part order as they arrive,
exactly as the local engine does (runner.Pass), so the result is the same bit for bit whatever
the number of workers. Plain tasks rather than Ray Data: Ray Data's read_parquet cuts its
own blocks, so a part's partial would be summed over other batch boundaries (not bit-equal
to the local engine), and it was slower here (bench/ray_analyze.py, docs/scale.md).

Failures: a corrupt part comes back as the error the local engine would skip or raise
(same message); a worker that dies (killed, out of memory, a lost node) is retried by Ray
MAX_RETRIES times, then the part is reported by name: skipped with a warning, or an
EngineError in strict mode. Ray itself is imported only here, only when this engine runs.

Retries are safe because a task is idempotent: it reads its part and returns its partials,
and writes nothing (a reducer keeps its state in memory); the driver caches each partial once
it is back (reduce.save_arrays: a temporary file renamed into place), so a worker killed
mid-pass leaves neither a partial nor a half-written file, and its retry starts the part
again from the first batch (tests/test_analysis_ray.py kills one with SIGKILL).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

from kldiag.analysis import protocol as reduce
from kldiag.analysis.runtime import part_fold, worker
from kldiag.errors import EngineError
from kldiag.format import PartInfo

RAY_EXTRA = "pip install 'kldiag[ray]'"
REDUCE_VERSION = 1  # the driver and the workers must agree on the reducer protocol and partial layouts
MAX_RETRIES = 3  # Ray re-runs a part's task this many times after its worker died
_task = None  # the Ray remote function, made once per process


def require_ray():
    """The ray module; EngineError naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise EngineError(f"the Ray engine needs Ray: {RAY_EXTRA} (or choose --engine local)") from None
    return ray


def connect(address: str | None = None):
    """Connect this process to Ray once: `address`, else RAY_ADDRESS's cluster, else a local Ray.

    A Ray already initialised in this process (a notebook, a trainer's driver, a test) is
    used as it is. A local Ray started here stays up for the next analysis (a dashboard
    refreshes often; starting Ray costs seconds) and stops with the process.
    """
    ray = require_ray()
    if ray.is_initialized():
        return ray
    kw: dict = {"logging_level": "ERROR", "log_to_driver": False}  # errors come back as exceptions
    if not (address or os.environ.get("RAY_ADDRESS")):
        kw["include_dashboard"] = False  # a local Ray for this process only
    try:
        ray.init(address=address, **kw)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = address or os.environ.get("RAY_ADDRESS") or "a local Ray"
        raise EngineError(f"cannot start or reach Ray at {where} ({e}); check --ray-address / RAY_ADDRESS "
                          "(ray status on the head node prints it; a cluster with token authentication also needs "
                          "RAY_AUTH_MODE=token and its token), or use --engine local") from e
    return ray


def reduce_part(part: PartInfo, reducers: Sequence[reduce.Reducer], batch_size: int) -> tuple[int, dict | Exception]:
    """Ray task body: (REDUCE_VERSION of this worker's kldiag, the part's partials or its error)."""
    return REDUCE_VERSION, worker.compute(part, reducers, batch_size)


def task(ray):
    """reduce_part as a Ray task: re-run when its worker dies (it is idempotent), not when it raises
    (a bug: raised on the driver, naming the part)."""
    global _task
    if _task is None:
        _task = ray.remote(num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False)(reduce_part)
    return _task


def compute(jobs: Sequence[part_fold.Job], batch_size: int, strict: bool = False,
            address: str | None = None) -> Iterator[tuple[int, dict | Exception]]:
    """(index, the part's partials or the error that made it unreadable) of each job, in job order,
    each yielded as soon as it and every job before it are back: the driver merges as they arrive
    and holds at most the results that came back ahead of an earlier one.

    A part whose worker kept dying comes back as an EngineError naming it (raised at once in
    strict mode, the remaining tasks cancelled). Parts and reducers are plain picklable values.
    """
    if not jobs:  # everything came from the cache: no cluster needed, but say when Ray is missing
        require_ray()
        return
    ray = connect(address)
    remote = task(ray)
    pending = [remote.remote(part, reducers, batch_size) for part, reducers in jobs]
    index = {ref: i for i, ref in enumerate(pending)}
    ahead: dict[int, dict | Exception] = {}
    nxt = 0
    try:
        while nxt < len(jobs):
            done, pending = ray.wait(pending, num_returns=1) if pending else ([], pending)
            for ref in done:
                i = index.pop(ref)  # no reference left: Ray frees the partial from its object store
                ahead[i] = _get(ray, jobs[i][0], ref)
                if strict and isinstance(ahead[i], EngineError):
                    raise ahead[i]
            del done
            while nxt in ahead:
                yield nxt, ahead.pop(nxt)
                nxt += 1
    except BaseException:
        # A generator closed after ray.shutdown() (garbage-collected later): ray.cancel would start a new
        # local Ray in this process (Ray's auto-init) just to cancel tasks that died with the old one.
        if ray.is_initialized():
            for ref in pending:
                ray.cancel(ref)
        raise


def _get(ray, part: PartInfo, ref) -> dict | Exception:
    try:
        version, result = ray.get(ref)
    except ray.exceptions.RayTaskError as e:  # a bug, not a bad part: raise it, naming the part
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
        raise EngineError(f"analysing part {part.path} on Ray failed: {cause!r}") from cause
    except ray.exceptions.RayError as e:  # the worker died MAX_RETRIES + 1 times
        return EngineError(f"part {part.path} failed {MAX_RETRIES + 1} times on Ray ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); its worker keeps dying (memory? a node "
                           "lost?): check `ray status` and the worker logs, then analyse again")
    if version != REDUCE_VERSION:
        raise EngineError(f"Ray workers run a kldiag whose reducers are version {version}, this driver's are "
                          f"{REDUCE_VERSION}: install the same kldiag on every node of the cluster")
    return result
