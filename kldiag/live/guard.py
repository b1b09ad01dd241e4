"""`kldiag.Guard`: act on a run when a chosen alert episode starts, before hours of GPU are lost.

    guard = kldiag.Guard(on="blowup,nonfinite", action="log,save,stop")
    for step in ...:                                   # any training loop
        guard.observe(step, logp=logp, logp_ref=logp_ref, logp_old=logp_old, mask=mask)
        ...
        if guard.end_step(step):                       # episodes of `on` that started
            save_checkpoint(); break                   # guard.should_stop / should_save say what to do

    from kldiag.integrations.trl import attach         # TRL: the callback does it
    attach(trainer, "runs/x", guard=kldiag.Guard(on="blowup"))

observe() copies the host arrays (the recorder's own host copies in the TRL hook) and hands
them to a worker thread, which reduces them to per-step figures with kldiag.estimators (the
analysis' definitions). end_step() waits (at most wait_s) for that step's figures, evaluates
the episode rules of kldiag.analysis.rules.episodes on the steps so far, and acts on each episode
of a kind in `on` that started: "log" (a warning on the `kldiag.live.guard` logger and stderr),
"save" and "stop" (flags the trainer integration turns into a checkpoint and a clean stop;
a plain loop reads guard.should_save / should_stop), "call" (the user's `callback(episode)`),
"notify" (a Slack-compatible webhook message through kldiag.live.notify, `notify=URL`, `env:NAME`
or a Notifier; sent from a background thread, once per episode, the URL never logged),
"flight" (the `recorder=`'s flight recorder publishes its last steps, whole, as an evidence bundle
at RUN/flight/<step>-<kind>/; the TRL hook turns it on when its recorder samples with
flight_steps > 0; paths in guard.flights).
`on` may also name `data_missing` ("all" includes it): with a recorder (`recorder=`, or the TRL
hook's own), an episode of that kind starts at the step where the recorder's dropped_rows or lost_rows
grew, rows the run will lack (the diagnosis's data_missing cause, kldiag/diagnosis/missing.py).
A failure inside the guard disables it with one warning: it never stops a run on an error of
its own, and a recorder's write error does not concern it (it keeps its own copies).
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from kldiag import estimators as E
from kldiag.analysis.rules import episodes as EP
from kldiag.diagnosis.types import DiagnosisConfig, Episode
from kldiag.live.notify import Notifier

log = logging.getLogger("kldiag.live.guard")
ACTIONS = ("log", "save", "stop", "call", "flight", "notify")
_SUMS = ("tokens", "sum_w", "sum_w_flagged", "flagged", "nonfinite", "invalid", "n_mismatch", "sum_mismatch",
         "n_drift", "sum_drift", "placeholders")
_MAXES = ("weight_k3_abs_max", "weight_k3_is_abs_max")


def _arr(x: Any) -> np.ndarray | None:
    return None if x is None else np.array(x, copy=True)  # as given (float32): widened on the worker


def step_sums(logp, logp_ref=None, logp_old=None, logp_sampler=None, mask=None) -> dict[str, float]:
    """Per-step partial sums and maxima of one batch ([B, T] float64 arrays; mask: bool [B, T])."""
    keep = np.ones(np.shape(logp), bool) if mask is None else np.asarray(mask, bool)
    out = dict.fromkeys(_SUMS, 0.0) | dict.fromkeys(_MAXES, np.nan)
    out["tokens"] = float(keep.sum())
    # as the analysis (docs/metrics.md): logp and logp_ref counted over every stored token, logp_old and
    # logp_sampler only in the loss (outside it, tool output, a hook may hold placeholders); flagged in the loss
    loss_only = [np.where(keep, x, -1.0) for x in (logp_old, logp_sampler) if x is not None]
    present = [x for x in (logp, logp_ref) if x is not None] + loss_only
    nonfinite, invalid = E.flag_nonfinite(*present), E.flag_invalid(*present)
    out["nonfinite"], out["invalid"] = float(nonfinite.sum()), float(invalid.sum())
    out["placeholders"] = float(placeholders(keep, logp_old, logp_sampler).sum())
    bad = (nonfinite | invalid) & keep
    old = logp if logp_old is None else np.where(np.isnan(logp_old), logp, logp_old)
    ok = keep & ~nonfinite
    if logp_ref is not None:
        with np.errstate(all="ignore"):
            w = np.abs(E.weight_k3(logp, logp_ref))
            w_is = np.abs(E.weight_k3_is(logp, logp_ref, old))
            f = E.flags(logp, logp_ref, old)
        flagged = ((f.theta_ll_ref | f.weight_blowup | f.clamp_saturated) & ok) | bad
        fin = ok & np.isfinite(w)
        out.update(sum_w=float(w[fin].sum()), sum_w_flagged=float(w[fin & flagged].sum()),
                   flagged=float(flagged.sum()),
                   weight_k3_abs_max=float(np.nanmax(w[ok])) if ok.any() else np.nan,
                   weight_k3_is_abs_max=float(np.nanmax(w_is[ok])) if ok.any() else np.nan)
    with np.errstate(all="ignore"):
        drift = np.abs(logp - old)
        out.update(n_drift=float(ok.sum()), sum_drift=float(drift[ok].sum()))
        if logp_sampler is not None:
            k3 = E.k3_of_log_ratio(old - logp_sampler)  # KL(mu || pi_old) per token, K3 of log(pi_old/mu)
            m = ok & np.isfinite(k3)
            out.update(n_mismatch=float(m.sum()), sum_mismatch=float(k3[m].sum()))
    return out


def placeholders(keep: np.ndarray, logp_old=None, logp_sampler=None) -> np.ndarray:
    """bool: tokens outside the loss whose logp_old or logp_sampler is 0.0 or non-finite (ignored)."""
    hit = np.zeros(np.shape(keep), bool)
    for x in (logp_old, logp_sampler):
        if x is not None:
            with np.errstate(invalid="ignore"):
                hit |= (x == 0) | ~np.isfinite(x)
    return hit & ~keep


def _merge(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    out = {k: a[k] + b[k] for k in _SUMS}
    for k in _MAXES:
        out[k] = float(np.fmax(a[k], b[k]))
    return out


class Guard:
    """Watches per-step figures of a live run and acts when an episode of `on` starts."""

    def __init__(self, on: str | tuple[str, ...] = "blowup,nonfinite", action: str | tuple[str, ...] = "log,save,stop",
                 callback: Callable[[Episode], Any] | None = None, estimator: str | None = None,
                 config: DiagnosisConfig = DiagnosisConfig(), weight_limit: float = E.WEIGHT_LIMIT,
                 alert_window: int = 20, alert_factor: float = 10.0, wait_s: float = 10.0, recorder: Any = None,
                 notify: str | Notifier | None = None):
        self.on = EP.parse_rules(on)
        actions = tuple(a.strip() for a in (action.split(",") if isinstance(action, str) else action) if a.strip())
        unknown = sorted(set(actions) - set(ACTIONS))
        if unknown:
            raise ValueError(f"unknown guard action(s) {unknown}; choose from {', '.join(ACTIONS)}")
        if "call" in actions and callback is None:
            raise ValueError("action 'call' needs callback=f (f(episode) is called when an episode starts)")
        self.actions = actions + (("call",) if callback is not None and "call" not in actions else ())
        if "notify" in actions and notify is None:
            raise ValueError("action 'notify' needs notify=URL (a Slack-compatible webhook, or env:NAME)")
        self.actions += ("notify",) if notify is not None and "notify" not in self.actions else ()
        self.notifier = notify if isinstance(notify, Notifier) or notify is None else Notifier(notify)
        if "flight" in actions and recorder is None:
            raise ValueError("action 'flight' needs recorder=rec (a kldiag.Recorder with flight_steps > 0); the TRL "
                             "hook passes its own")
        self.callback, self.estimator, self.wait_s = callback, estimator, wait_s
        self.recorder = recorder  # "flight": its flight recorder publishes the last steps when an episode starts
        self.flights: list[str] = []  # the evidence bundles published
        self.context = dict(weight_limit=weight_limit, alert_window=alert_window, alert_factor=alert_factor,
                            config=config)
        self.steps: dict[int, dict[str, float]] = {}
        self.fired: list[Episode] = []
        self.should_stop = self.should_save = False
        self.failed: BaseException | None = None
        self._judged = -(1 << 62)  # the last step end_step judged: later starts are new
        self._lost_seen = 0  # the recorder's dropped + lost rows at the last look (data_missing)
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._submitted = self._processed = 0
        self._thread = threading.Thread(target=self._work, name="kldiag-guard", daemon=True)
        self._thread.start()

    # -- the training thread
    def observe(self, step: int, logp, logp_ref=None, logp_old=None, logp_sampler=None, mask=None) -> None:
        """Hand one batch (host arrays, [B, T]) of `step` to the worker; returns at once."""
        if self.failed is None:
            with self._lock:
                self._submitted += 1
            self._queue.put((int(step), _arr(logp), _arr(logp_ref), _arr(logp_old), _arr(logp_sampler),
                             None if mask is None else np.array(mask, dtype=bool, copy=True)))

    def end_step(self, step: int) -> list[Episode]:
        """After the optimizer step `step`: the episodes of `on` that started (acted upon), else []."""
        if self.failed is not None:
            return []
        try:
            self._drain()
            new = self._evaluate(int(step)) + self._data_missing(int(step))
            for e in new:
                self._act(e)
            return new
        except Exception as e:  # the guard never takes a run down with it
            self._fail(e)
            return []

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self.wait_s)
        if self.notifier is not None:
            self.notifier.close(timeout=self.wait_s)

    # -- the worker
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self.failed is None:
                    step, logp, logp_ref, logp_old, logp_sampler, mask = item
                    logps = (None if x is None else E.as_f64(x) for x in (logp, logp_ref, logp_old, logp_sampler))
                    sums = step_sums(*logps, mask)
                    with self._lock:
                        self.steps[step] = _merge(self.steps[step], sums) if step in self.steps else sums
            except Exception as e:
                self._fail(e)
            finally:
                with self._done:
                    self._processed += item is not None
                    self._done.notify_all()

    def _drain(self) -> None:
        with self._done:
            if not self._done.wait_for(lambda: self._processed >= self._submitted or self.failed, self.wait_s):
                warnings.warn(f"kldiag guard: the per-step check took over {self.wait_s}s; judging the steps so "
                              "far", stacklevel=3)

    def table(self, last: int | None = None) -> dict[str, np.ndarray]:
        """The steps so far (the `last` ones only, if given) as the columns the episode rules read."""
        with self._lock:
            steps = sorted(self.steps)[-last:] if last else sorted(self.steps)
            rows = [self.steps[s] for s in steps]

        def c(k):
            return np.array([r[k] for r in rows], dtype=np.float64)

        tokens = np.maximum(c("tokens"), 1.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            return {"step": np.array(steps, dtype=np.int64), "tokens": c("tokens"),
                    "weight_k3_abs_max": c("weight_k3_abs_max"), "weight_k3_is_abs_max": c("weight_k3_is_abs_max"),
                    "blame_share": np.where(c("sum_w") > 0, c("sum_w_flagged") / c("sum_w"), 0.0),
                    "flagged_frac": c("flagged") / tokens, "nonfinite_count": c("nonfinite"),
                    "invalid_count": c("invalid"), "mismatch_kl": c("sum_mismatch") / c("n_mismatch"),
                    "drift_abs_mean": c("sum_drift") / c("n_drift")}

    def _evaluate(self, step: int) -> list[Episode]:
        """Episodes of `on` starting after the last judged step. Only the tail is judged: enough
        steps before the new ones for the trailing median and for bridging (cost flat in run length)."""
        ctx = EP.RuleContext(estimator=self.estimator or EP.DEFAULT_ESTIMATOR, **self.context)
        with self._lock:
            fresh = sum(1 for s in self.steps if self._judged < s <= step)
        history = 2 * max(ctx.alert_window, ctx.config.quiet_steps) + 1
        cols = self.table(last=history + fresh + 1)
        keep = cols["step"] <= step
        cols = {k: v[keep] for k, v in cols.items()}
        new = [e for e in EP.episodes(cols, ctx, self.on) if e.start > self._judged]
        self._judged = max(self._judged, step)
        self.fired += new
        return new

    def _data_missing(self, step: int) -> list[Episode]:
        """A data_missing episode at `step` when the recorder dropped or lost rows since the last look."""
        if "data_missing" not in self.on or self.recorder is None:
            return []
        stats = self.recorder.stats
        lost = int(stats.get("dropped_rows", 0)) + int(stats.get("lost_rows", 0))
        if lost <= self._lost_seen:
            return []
        e = Episode("data_missing", step, None, step, float(lost), "warning",
                    f"the recorder lost {lost - self._lost_seen:,} row(s) by step {step} (dropped_rows "
                    f"{stats.get('dropped_rows', 0):,}, lost_rows {stats.get('lost_rows', 0):,}, write_errors "
                    f"{stats.get('write_errors', 0):,}): the run will lack them", metric="lost_rows")
        self._lost_seen = lost
        self.fired.append(e)
        return [e]

    def _act(self, e: Episode) -> None:
        if "log" in self.actions:
            msg = f"kldiag guard: {e.kind} episode started at step {e.start}: {e.message}"
            log.warning(msg)
            print(msg, file=sys.stderr, flush=True)
        self.should_save |= "save" in self.actions
        self.should_stop |= "stop" in self.actions
        if "call" in self.actions and self.callback is not None:
            self.callback(e)
        if "notify" in self.actions and self.notifier is not None:  # queued: the step never waits on the webhook
            self.notifier.episode(e, run=str(getattr(self.recorder, "run_dir", "") or ""))
        if "flight" in self.actions and self.recorder is not None:
            trigger = {"kind": e.kind, "start": e.start, "severity": e.severity, "message": e.message,
                       "peak_step": e.peak_step, "peak_value": e.peak_value, "source": "guard"}
            path = self.recorder.dump_flight(trigger, self.table(last=self.recorder.options.flight_steps or None))
            if path is not None:
                self.flights.append(path)
                log.warning("kldiag guard: the last steps at full fidelity are in %s", path)

    def _fail(self, e: BaseException) -> None:
        if self.failed is None:
            self.failed = e
            warnings.warn(f"kldiag guard disabled after an internal error ({type(e).__name__}: {e}); training "
                          "goes on unguarded", stacklevel=2)
