"""The app's cached loaders and shared sidebar. Pages only display what these return.

Run directories come from KLDIAG_RUNS (os.pathsep-separated; tests set it) or else from
the script's arguments after `--` (`kldiag dashboard` passes them). Every loader is keyed
on a digest of the run's part keys (rank/name/size/mtime of each published file: `stamp`), so a
newly published part invalidates it; kldiag.analyze itself is incremental (RUN/.kldiag cache).
"""

from __future__ import annotations

import gc
import hashlib
import os
import sys

import dash_controls
import pandas as pd
import streamlit as st

import kldiag
from kldiag import format as F
from kldiag.analysis.reducers.coverage_table import coverage_of
from kldiag.analysis.runtime import runner
from kldiag.cli import engine_opts as engines
from kldiag.errors import EmptyRunError, KldiagError, NotARunError
from kldiag.views import dashboard as VD
from kldiag.views import estimators as VE
from kldiag.views import leads as VL
from kldiag.views import mismatch as VM
from kldiag.views import pages as V
from kldiag.views import sequences as VS
from kldiag.views import topk as VT

RUNS_ENV = "KLDIAG_RUNS"
LIVE_SECONDS = 3.0


def run_paths() -> list[str]:
    """The run directories this app shows, in the order given."""
    env = os.environ.get(RUNS_ENV)
    if env:
        return [p for p in env.split(os.pathsep) if p]
    return [a for a in sys.argv[1:] if not a.startswith("-")]


def labels(paths: list[str]) -> dict[str, str]:
    """Display name -> path."""
    return {V.run_label(p, paths): p for p in paths}


# ---- cached loaders (keyed on the part keys' digest: a new file re-keys them) -----------

_CURRENT: dict[str, str] = {}  # run path -> the digest of the part keys its cached results are of
_PER_ANALYSIS: dict = {}  # st.cache_resource loaders of (path, keys): what holds an Analysis alive
TABLES = ("steps", "flags", "alerts")


def stamp(keys: tuple[str, ...]) -> str:
    """The loaders' key of a run's part keys: their digest. Streamlit hashes a cached function's arguments
    on every call, the tuple element by element (a long run's hundreds of keys: most of a rerun's time)."""
    return hashlib.sha1("\0".join(keys).encode()).hexdigest()


def per_analysis(loader):
    """Register a st.cache_resource loader of (path, keys): once a run's parts re-key it, its entries for the
    older keys are dropped, so a live run holds one Analysis, not one per refresh (each with its token
    sample) until max_entries evicts them. Only this module's loaders: a page's would keep its script's
    globals (the page's Loaded, so its Analysis) alive through the registry."""
    _PER_ANALYSIS[loader.__qualname__] = loader
    return loader


def _forget_older(path: str, keys: str) -> None:
    old, _CURRENT[path] = _CURRENT.get(path), keys
    if old is None or old == keys:
        return
    for loader in list(_PER_ANALYSIS.values()):
        loader.clear(path, old)
    for name in TABLES:
        _table.clear(path, old, name)


@per_analysis
@st.cache_resource(max_entries=16, show_spinner="Analysing the run ...")
def _analysis(path: str, keys: str) -> kldiag.Analysis:
    # every page's data in the analysis's one read of each part (the Sequence page aside)
    return kldiag.analyze(path, kldiag.AnalysisConfig(**engines.from_env()), VD.reducers())  # --engine


def analysis_of(path: str, keys: str) -> kldiag.Analysis:
    """The run's Analysis with every page's reducers (cached on the part keys)."""
    return _analysis(path, keys)


@st.cache_resource(max_entries=64)
def _table(path: str, keys: str, name: str) -> pd.DataFrame:
    # one table at a time: a page that shows no sequence never converts the run's sequence rows
    return getattr(_analysis(path, keys), name).to_pandas()


@per_analysis
@st.cache_resource(max_entries=16, show_spinner="Diagnosing the run ...")
def _diagnosis(path: str, keys: str):
    from kldiag.diagnosis import diagnose

    return diagnose(_analysis(path, keys))  # the verdict and causes of kldiag analyze and report


def diagnosis(run: Loaded):
    """The run's kldiag.diagnosis.Diagnosis (verdict, causes with onset and fix, episodes)."""
    return _diagnosis(run.path, run.keys)


@per_analysis
@st.cache_resource(max_entries=16, show_spinner="Comparing estimators on the run's tokens ...")
def estimator_partial(path: str, keys: str) -> VE.EstimatorPartial:
    """What each estimator does on the run's own tokens: read in the analysis's pass (VD.reducers() lists
    its reducer), so the page's first visit reads no part; a run analysed without it gets one pass."""
    return VE.from_arrays(runner.reduced(_analysis(path, keys), VD.estimator_reducer()))


@per_analysis
@st.cache_resource(max_entries=8, show_spinner="Reading the run's tokens ...")
def mismatch_view(path: str, keys: str) -> VM.MismatchView:
    """The Mismatch page's view: from the analysis's token sample (no extra read), or the result store."""
    return VM.view_of(_analysis(path, keys))


@per_analysis
@st.cache_resource(max_entries=16, show_spinner="Reading the top-k lists ...")
def topk_summary(path: str, keys: str):
    """The Tokens page's top-k summary and the first token that has lists."""
    return VT.summary(_analysis(path, keys)), VT.first_listed(path)


@st.cache_data(max_entries=16, show_spinner=False)
def coverage(path: str, keys: str) -> dict:
    """Which optional inputs each step has (kldiag.analysis.reducers.coverage_table, read with the analysis)."""
    return coverage_of(_analysis(path, keys))


@st.cache_data(max_entries=16, show_spinner=False)
def mismatch_tokens(path: str, keys: str) -> dict:
    """The Tokens page's lists when no token is flagged: routed differently, largest engine mismatch."""
    return VL.token_tables(_analysis(path, keys), _vocab(path, F.vocab_stamp(path)))


@st.cache_resource(max_entries=8)
def _vocab(path: str, mtime_ns: int) -> dict[int, str] | None:
    return F.open_run(path).vocab()


@st.cache_data(max_entries=64)
def sequence(path: str, step: int, seq: int, keys: str) -> pd.DataFrame:
    """One sequence's tokens with every per-token quantity and decoded text."""
    return VS.tokens(_analysis(path, keys), step, seq, vocab=_vocab(path, F.vocab_stamp(path)))  # stored


@st.cache_data(max_entries=8, show_spinner=False)
def worst_sequences(path: str, keys: str, n: int) -> pd.DataFrame:
    """The n sequences with the largest max |k3 weight| (a long run's: only their row groups read)."""
    return VS.worst(_analysis(path, keys), n)


@st.cache_data(max_entries=64, show_spinner=False)
def step_sequences(path: str, keys: str, step: int) -> pd.DataFrame:
    """Every sequence of one step, in table order (seq ascending)."""
    return VS.of_step(_analysis(path, keys), step)


@st.cache_data(max_entries=16, show_spinner=False)
def sequence_steps(path: str, keys: str) -> list[int]:
    return VS.steps_with_sequences(_analysis(path, keys))


@st.cache_data(max_entries=16, show_spinner=False)
def first_sequence(path: str, keys: str) -> tuple[int, int] | None:
    """Where the Sequence page opens: the most faulty sequence, else the worst."""
    return VS.first_to_show(_analysis(path, keys))


@st.cache_data(max_entries=64)
def present(path: str, keys: str) -> dict[str, bool]:
    return V.present_in(_analysis(path, keys))


# ---- what pages call -----------------------------------------------------------------


class Loaded:
    """A run that analysed: its path, part keys, Analysis and pandas tables (steps, flags, alerts: each
    converted when a page first reads it; sequences are read a step or the worst N at a time)."""

    def __init__(self, path: str, keys: str):
        self.path, self.keys = path, keys  # keys: `stamp` of the part keys
        _forget_older(path, keys)
        self.present = present(path, keys)  # analyses the run on its first load
        _ANALYSED.add(path)
        _settle_once()

    # a cache lookup, not an attribute: a page's globals (which a widget's callback keeps alive) hold no Analysis
    analysis = property(lambda self: _analysis(self.path, self.keys))

    steps = property(lambda self: _table(self.path, self.keys, "steps"))
    flags = property(lambda self: _table(self.path, self.keys, "flags"))
    alerts = property(lambda self: _table(self.path, self.keys, "alerts"))


_SETTLED: list[bool] = []


def _settle_once() -> None:
    """Once per process, when the first run is loaded: move every object alive then (the imports, Streamlit,
    the cached analysis) out of the garbage collector's view (gc.freeze). A full collection scanned all
    150k of them, 0.07-0.09 s each, and a refresh of a 1B-row run set off one or two: 0.14 s of its 0.5 s.
    What is made later is collected as before; what is frozen is freed by its reference count."""
    if not _SETTLED:
        _SETTLED.append(True)
        gc.freeze()


def load(path: str) -> Loaded | None:
    """The run's analysis, or None after showing on the page why there is none."""
    try:
        F.read_manifest(path)
        keys = V.part_keys(path)
        if not keys:
            raise EmptyRunError(f"{path} has no published token parts yet")
        return Loaded(path, stamp(keys))
    except NotARunError as e:
        st.error(f"Not a kldiag run: {e}")
    except EmptyRunError:
        from kldiag.analysis.runtime.lost import NOTHING_PUBLISHED, no_tokens_reason

        reason = no_tokens_reason(path)
        if reason == NOTHING_PUBLISHED:
            st.info(f"{path} has no tokens yet: nothing has been published. Turn on **Live** in the sidebar "
                    "to refresh when the trainer writes its first part.")
        else:
            st.error(f"{path} has no readable tokens: {reason}. Their steps are lost to every page.")
    except KldiagError as e:
        st.error(f"Cannot analyse {path}: {e}")
    return None


def run_label() -> str | None:
    """The label of the run the pages show (the sidebar's choice, else the first run)."""
    return dash_controls.chosen_label(labels(run_paths()))


def current() -> Loaded | None:
    """The run chosen in the sidebar, loaded; shows a message and returns None otherwise."""
    paths = run_paths()
    if not paths:
        st.error("No run directory given. Start the app with `kldiag dashboard RUN_DIR [RUN_DIR ...]`.")
        return None
    by_label = labels(paths)
    label = st.session_state.get("run_label")
    return load(by_label.get(label, paths[0]))


def page(title: str) -> Loaded:
    """Every run page's prelude: its title, the chosen run loaded (or stop with a message)
    and notices for columns the run lacks."""
    st.title(title)
    run = current()
    dash_controls.show_notices()  # a deep link to something that does not exist: what was shown instead
    if run is None:
        st.stop()
    column_notices(run)
    return run


def column_notices(run: Loaded) -> None:
    """Say what a run without some columns cannot show."""
    if not run.present.get("logp_ref", True):
        st.info("This run has no reference log-probs (logp_ref is null: beta = 0 or not recorded): "
                "KL values, weights and flags are not defined; rho and drift still are.")
    if not run.present.get("logp_old", True):
        st.info("On-policy run (logp_old is null): rho = 1, so k3_is equals k3 in value and k2 in weight.")


def sidebar() -> None:
    """Run picker and the live toggle; call once from main.py before the page runs."""
    paths = run_paths()
    with st.sidebar:
        if len(paths) > 1:
            st.selectbox("Run", list(labels(paths)), key="run_label")
        elif paths:
            st.caption(f"Run: `{paths[0]}`")
        live = st.toggle("Live", key="live", help="Re-read the run every few seconds and show new steps.")
        seconds = st.number_input("Refresh every (s)", 1.0, 600.0, LIVE_SECONDS, key="live_seconds",
                                  disabled=not live)
    _watch(paths, seconds if live else None)


_ANALYSED: set[str] = set()  # runs whose analysis this process has made: their cache is warm


def _watch(paths: list[str], every: float | None) -> None:
    if every is not None:  # live: the first refresh's pass made ready (its compiled kernels loaded)
        for p in paths:
            if p in _ANALYSED:  # else its first analysis may still run: a second one beside it would be cold
                VD.prepare_refresh_in_background(p, kldiag.AnalysisConfig(**engines.from_env()))

    @st.fragment(run_every=every)
    def watcher() -> None:
        keys = tuple(_safe_keys(p) for p in paths)
        if st.session_state.get("_part_keys", keys) != keys:
            st.session_state["_part_keys"] = keys
            st.rerun(scope="app")
        st.session_state["_part_keys"] = keys

    watcher()


def _safe_keys(path: str) -> tuple[str, ...]:
    try:
        return V.part_keys(path)
    except OSError:
        return ()
