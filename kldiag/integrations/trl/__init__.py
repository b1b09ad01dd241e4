"""Attach kldiag to TRL's `GRPOTrainer`: one line, no change to the maths, no extra forward.

    from kldiag.integrations.trl import attach
    rec = attach(trainer, "runs/my_run")     # before trainer.train()
    trainer.train()                          # the recorder closes when training ends

Per micro-batch of the loss it records what `GRPOTrainer._compute_loss` used: the current
log-probs and entropies (captured from the loss's own call to
`_get_per_token_logps_and_entropies`, detached and copied), `old_per_token_logps` (null, i.e.
on-policy, when TRL used the detached current values), `ref_per_token_logps` (beta > 0),
`sampling_per_token_logps` (when an inference engine supplied them), advantages, the loss
mask (completion mask times TRL's tool mask), completion token ids, and a sequence id
assigned when the generation batch is produced, so it stays the same across the
`num_iterations` reuses of that batch.

Steps: a row's `step` is the optimizer step whose metrics TRL logs for that micro-batch,
i.e. `trainer.state.global_step + 1` while the loss is computed (the Trainer increments
global_step after the optimizer step, then logs). `micro` counts loss calls within the
step; `iteration` is the reuse index (0 .. num_iterations - 1) of the generation batch.
`policy_version` (format v1.3) is the step whose weights generated the completion: the
`global_step + 1` at the call to `_generate_and_score_completions`, which TRL makes once every
`steps_per_generation x num_iterations` loss calls (trl 1.16 grpo_trainer.py `_prepare_inputs`)
and whose batch then serves the steps after it, so staleness = step - policy_version.

On every logging step, a few `kldiag/...` metrics (computed with kldiag.estimators from the
host copies, accumulated since the last log) are added to the dict TRL logs, so they reach
W&B/TensorBoard and `trainer.state.log_history` like TRL's own `kl`. They are computed in
the recorder's writer thread (Recorder.observe) from the copies it writes, so the training
thread only hands tensors to record(); at a log it waits (LOG_WAIT_S at most) until the
writer has converted the batches queued before it, never for a publish. With a guard, live
histograms, or a recorder that samples or drops (every_n_steps, seq_fraction,
backpressure="drop"), they are computed on the training thread as before, over every batch.

The hook relies on private GRPOTrainer methods; `attach` checks the TRL version and their
signatures and raises `IntegrationError` (naming SUPPORTED) rather than failing mid-run.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings
from typing import Any

import numpy as np

from kldiag.errors import IntegrationError
from kldiag.frameworks import sampling as sampling_settings
from kldiag.frameworks.trl import SUPPORTED
from kldiag.integrations.common.moe_capture import find_sources
from kldiag.integrations.trl.guard import install_guard
from kldiag.integrations.trl.kernel import TOPK_CHECK_NATS, TopkCapture
from kldiag.integrations.trl.metrics import (  # re-exported: kldiag.integrations.trl.batch_partials, ...
    METRIC_PREFIX,  # noqa: F401
    _reduce_across_ranks,
    batch_partials,
    log_metrics,
    merge_partials,
    warm_kernel,
)
from kldiag.integrations.trl.routes import RoutesCapture, routes_config, unwrap
from kldiag.record.recorder import Recorder

_TRL_MIN, _TRL_MAX = (1, 15), (1, 17)  # 1.15: the wrapped methods are 1.16's line for line (tests/test_trl_versions.py)
SEQ_KEY = "kldiag_seq"  # [B] int64 carried in TRL's buffered inputs through shuffle and split
VERSION_KEY = "kldiag_policy_version"  # [B] int64, likewise: the step whose weights generated the batch
LOG_WAIT_S = 2.0  # a log waits at most this long for the writer; later batches count at the next log

# Private GRPOTrainer methods the hook wraps, with the parameters it passes or reads.
_REQUIRED_METHODS: dict[str, tuple[str, ...]] = {
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep",
                                           "compute_entropy"),
    "_generate_and_score_completions": ("inputs",),
    "_compute_loss": ("model", "inputs"),
    "compute_loss": ("model", "inputs"),
    "_prepare_inputs": ("generation_batch",),
    "log": ("logs",),
}
_REQUIRED_ATTRIBUTES = ("_step", "beta", "num_iterations", "num_generations", "accelerator", "state", "args",
                        "processing_class", "model")


# ---- attach ---------------------------------------------------------------------------


def attach(trainer: Any, run_dir: Any, guard: Any = None, **recorder_options: Any):
    """Record every loss micro-batch of `trainer` (a trl.GRPOTrainer or subclass) into `run_dir`.

    `guard`: a kldiag.Guard fed the same host copies; it logs, saves a checkpoint, stops
    training or calls back when an episode it watches starts (kldiag/integrations/trl/guard.py).

    `recorder_options` go to `kldiag.Recorder` (e.g. rotate_steps, every_n_steps, strict);
    A `config` given there is merged over the one the hook derives from GRPOConfig.
    Returns the Recorder; it is closed when training ends (trainer's on_train_end).
    Raises IntegrationError for an unsupported TRL version or a trainer already attached.

    `histograms=True` (or a directory) also writes live TensorBoard histograms of d, |k3 weight|,
    |k3_is weight| and rho at each log (kldiag/integrations/trl/histograms.py; needs tensorboard).

    `topk=k` also records the trainer's k most likely token ids and their log-probs at every
    completion token (columns topk_ids/topk_logp; trl_kernel.TopkCapture: one more LM-head
    projection of the completion tokens, since TRL's fused head never forms the logits). None
    (the default): nothing changes. The engine's side is the caller's: docs/recorder.md, "Top-k".
    """
    check_supported(trainer)
    histograms = recorder_options.pop("histograms", False)
    topk = recorder_options.pop("topk", None)
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise IntegrationError(f"attach(topk={topk!r}): give the number of top tokens to record (e.g. 20), or None")
    if getattr(trainer, "_kldiag_hook", None) is not None:
        raise IntegrationError("kldiag is already attached to this trainer; call attach() once per trainer")
    options = recorder_defaults(trainer)
    layout, routes_warning = _moe_layout(trainer, options["config"])
    options["config"] = {**options["config"], **(recorder_options.pop("config", None) or {})}
    options.update(recorder_options)
    warm_kernel()  # compiled (or loaded from numba's cache) here, not in the first step, beside the trainer
    rec = Recorder(run_dir, **options)
    hook = _Hook(trainer, rec, strict=bool(options.get("strict", False)))
    hook.topk, hook.layout = topk, layout
    if routes_warning:
        warnings.warn(routes_warning, stacklevel=2)
    hook.install()
    if histograms:
        from kldiag.integrations.trl.histograms import LiveHistograms

        hook.histograms = LiveHistograms(histograms)
    if guard is not None:
        install_guard(trainer, hook, guard, options["config"])
    return rec


# TRL's generation batch holds completions and sampling log-probs, never the engine's expert ids.
ENGINE_ROUTES_MISSING = ("TRL's generation batch carries no engine routes (neither vLLM's nor transformers' "
                         "generate returns them to GRPOTrainer)")


def _moe_layout(trainer: Any, config: dict) -> tuple[Any, str | None]:
    """The policy's MoE layout (kldiag.integrations.common.moe_capture) and the attach warning; sets
    config["routes"]."""
    try:
        layout = find_sources(unwrap(trainer, trainer.model))
    except Exception:  # noqa: BLE001 - said in the manifest; the loss's first call looks again
        layout = None
    config["routes"], warning = routes_config(layout, ENGINE_ROUTES_MISSING)
    return layout, warning


def check_supported(trainer: Any) -> None:
    """Raise IntegrationError unless trl's version and the trainer's private API are what the hook needs."""
    try:
        import trl
        from packaging.version import InvalidVersion, Version
    except ImportError as e:
        raise IntegrationError(
            f"kldiag.integrations.trl needs trl{SUPPORTED}: pip install 'kldiag[trl]' ({e})") from e
    try:
        release = Version(trl.__version__).release[:2]
    except InvalidVersion:
        release = (0, 0)
    if not (_TRL_MIN <= release < _TRL_MAX):
        raise IntegrationError(f"kldiag.integrations.trl supports trl{SUPPORTED}, found trl {trl.__version__}; "
                               f"install a supported version: pip install 'trl{SUPPORTED}'")
    if not isinstance(trainer, trl.GRPOTrainer):
        raise IntegrationError(f"attach() expects a trl.GRPOTrainer or a subclass, got {type(trainer).__name__}")
    for name, params in _REQUIRED_METHODS.items():
        # TRL's own methods must match exactly; a subclass override may also take *args/**kwargs.
        for cls, lenient in ((trl.GRPOTrainer, False), (type(trainer), True)):
            missing = _missing_parameters(getattr(cls, name, None), params, lenient)
            if missing:
                raise IntegrationError(
                    f"{cls.__name__}.{name} is missing or lacks parameters {missing}; kldiag's TRL hook supports "
                    f"trl{SUPPORTED} (found trl {trl.__version__}); use a supported TRL or the plain "
                    "kldiag.Recorder API")
    absent = [a for a in _REQUIRED_ATTRIBUTES if not hasattr(trainer, a)]
    if absent:
        raise IntegrationError(f"{type(trainer).__name__} lacks attributes {absent} that kldiag's TRL hook reads; "
                               f"it supports trl{SUPPORTED} (found trl {trl.__version__})")


def _missing_parameters(method: Any, params: tuple[str, ...], lenient: bool = False) -> list[str]:
    if not callable(method):
        return list(params)
    try:
        found = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return list(params)
    kinds = {p.kind for p in found.values()}
    if lenient and {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} <= kinds:
        return []
    return [p for p in params if p not in found]


def recorder_defaults(trainer: Any) -> dict[str, Any]:
    """Recorder keyword arguments derived from the trainer: manifest config, versions, vocab, rank."""
    import transformers
    import trl

    args = trainer.args
    config = {
        "beta": float(args.beta),
        "estimator": "k3_is" if args.use_bias_correction_kl else "k3",
        "clip_range": [float(trainer.epsilon_low), float(trainer.epsilon_high)],
        "use_bias_correction_kl": bool(args.use_bias_correction_kl),
        "loss_type": args.loss_type,
        "importance_sampling_level": args.importance_sampling_level,
        "epsilon_low": float(trainer.epsilon_low),
        "epsilon_high": float(trainer.epsilon_high),
        "num_iterations": int(args.num_iterations),
        "off_policy_mask_threshold": args.off_policy_mask_threshold,
        "num_generations": int(trainer.num_generations),
        "per_device_train_batch_size": int(args.per_device_train_batch_size),
        "gradient_accumulation_steps": int(args.gradient_accumulation_steps),
        "steps_per_generation": int(args.steps_per_generation),
        "max_completion_length": args.max_completion_length,
        "logging_steps": args.logging_steps,
        "use_vllm": bool(args.use_vllm),
        "engine_sampling": sampling_settings.from_trl(args),  # kldiag.frameworks.sampling: temperature, top-k/p
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
    }
    acc = trainer.accelerator
    return {"beta": config["beta"], "estimator": config["estimator"], "clip_range": config["clip_range"],
            "trainer": "trl", "trainer_version": trl.__version__, "config": config,
            "tokenizer": _tokenizer_of(trainer.processing_class),
            "world_size": int(acc.num_processes), "rank": int(acc.process_index)}


def _tokenizer_of(processing_class: Any) -> Any:
    # A multimodal processor carries its tokenizer as an attribute.
    return getattr(processing_class, "tokenizer", None) or processing_class


# ---- the hook --------------------------------------------------------------------------


class _Hook:
    """Instance-level wrappers around one trainer's methods (subclass overrides stay inside them)."""

    WRAPPED = ("_generate_and_score_completions", "compute_loss", "_get_per_token_logps_and_entropies", "log")

    def __init__(self, trainer: Any, rec: Any, strict: bool = False):
        self.trainer, self.rec, self.strict = trainer, rec, strict
        self.active = True
        self.has_ref = float(trainer.beta) != 0.0
        self.failures = 0
        self._armed = False  # inside compute_loss: the next log-prob call is the loss's own
        self._captured: tuple[np.ndarray, np.ndarray | None] | None = None
        self._next_seq = 0  # first sequence id of the next generation batch (global, all ranks)
        self._step: int | None = None
        self._micro = 0
        self._window: dict[str, float] | None = None  # partials since the last log
        self._window_lock = threading.Lock()  # the writer thread merges into the window (off-thread mode)
        self._off: bool | None = None  # metrics in the writer thread; decided at the first capture
        self._observer_error: BaseException | None = None
        self.late_logs = 0  # logs whose wait for the writer timed out
        self._pending = False  # a batch was recorded since the last log: every rank logs (a collective)
        self.histograms: Any = None  # trl_histograms.LiveHistograms when attach(histograms=...)
        self.guard: Any = None  # a kldiag.Guard fed the host copies (trl_guard.install_guard)
        self.topk: int | None = None  # attach(topk=k): the trainer's top-k per completion token
        self.topk_check: float | None = None  # trl_kernel.TopkCapture's label check, first batch
        self._routes: Any = None  # MoE models: the trainer's routes of the loss's forward (trl_routes)
        self._margin: Any = None  # and the router's margin per token, (min over layers, its layer)
        self.layout: Any = None  # moe_capture.MoeLayout of the policy, found at attach
        self._moe: bool | None = None  # whether the policy has routers (looked up at the first loss call)

    def install(self) -> None:
        t = self.trainer
        handlers = (self._on_generate, self._on_compute_loss, self._on_logps, self._on_log)
        for name, handler in zip(self.WRAPPED, handlers, strict=True):
            original = getattr(t, name)  # bound: the subclass's override if there is one
            setattr(t, name, functools.wraps(original)(functools.partial(handler, original)))
        t.add_callback(_close_callback(self))
        t._kldiag_hook = self

    def close(self) -> None:
        self.active = False
        if self.histograms is not None:
            self.histograms.close()
        self.rec.close()

    # -- wrappers: each calls the original with the same arguments and returns its result

    def _on_generate(self, original, inputs, *args, **kwargs):
        out = original(inputs, *args, **kwargs)
        if self.active and self.trainer.model.training and isinstance(out, dict):
            self._guarded(self._assign_seq_ids, out)
        return out

    def _on_compute_loss(self, original, model, inputs, *args, **kwargs):
        if not (self.active and self.trainer.model.training):
            return original(model, inputs, *args, **kwargs)
        self._armed, self._captured = True, None
        try:
            loss = original(model, inputs, *args, **kwargs)
        finally:
            self._armed = False
        captured, self._captured = self._captured, None
        if captured is not None:
            self._guarded(self._record, inputs, *captured)
        self._routes = self._margin = None
        return loss

    def _on_logps(self, original, *args, **kwargs):
        first = self._armed and self._captured is None
        if first and self._moe is not False:  # an MoE policy: its routers' choices, by forward hooks (trl_routes)
            return self._with_routes(original, args, kwargs)
        return self._on_logps_topk(original, first, *args, **kwargs)

    def _with_routes(self, original, args, kwargs):
        self._routes, self._margin, opened = None, None, []
        self._guarded(lambda: opened.append(RoutesCapture.around(self.trainer, original, args, kwargs, self.layout)))
        capture = opened[0] if opened else None
        self._moe = capture is not None
        try:
            out = self._on_logps_topk(original, True, *args, **kwargs)
        finally:
            if capture is not None:
                capture.close()
        if capture is not None:
            self._guarded(lambda: setattr(self, "_routes", capture.result()))
            self._guarded(lambda: setattr(self, "_margin", capture.margin()))
        return out

    def _on_logps_topk(self, original, first, *args, **kwargs):
        opened: list[TopkCapture] = []
        if first and self.topk:  # a hook on the backbone for this one call (a failure: counted, warned)
            self._guarded(lambda: opened.append(TopkCapture.around(
                self.trainer, self.topk, original, args, kwargs, check=self.topk_check is None)))
        if not opened:
            out = original(*args, **kwargs)
            if first:
                self._capture(out)
            return out
        capture = opened[0]
        try:
            out = original(*args, **kwargs)
        finally:
            capture.close()
        self._capture(out)
        self._guarded(self._capture_topk, capture, out[0])
        return out

    def _capture_topk(self, capture: TopkCapture, logp: Any) -> None:
        ids, top, check = capture.result(logp, check=self.topk_check is None)
        if check is not None:
            self.topk_check = check
            if check > TOPK_CHECK_NATS:
                warnings.warn(f"kldiag: the recorded top-k log-probs differ from TRL's by up to {check:.3g} nats "
                              "(a logit scaling kldiag does not apply?); the topk columns are not TRL's "
                              "distribution", stacklevel=3)
        on_host = not self.off_thread()  # off-thread: device tensors, which record() copies
        self._captured = (*self._captured[:2], (_host(ids), _host(top)) if on_host else (ids, top))

    def _on_log(self, original, logs, *args, **kwargs):
        if self.active and self.trainer.model.training and isinstance(logs, dict):
            if self._off:
                self._guarded(self._wait_converted)
            if self._pending or self._window is not None or self._observer_error is not None:
                self._guarded(self._add_metrics, logs)
        return original(logs, *args, **kwargs)

    # -- work

    def _assign_seq_ids(self, out: dict) -> None:
        import torch

        b = int(out["completion_ids"].shape[0])
        acc = self.trainer.accelerator
        start = self._next_seq + int(acc.process_index) * b
        self._next_seq += b * int(acc.num_processes)
        # On the CPU: TRL's shuffle and split index it like any [B] tensor, at no device cost.
        out[SEQ_KEY] = torch.arange(start, start + b, dtype=torch.long)
        out[VERSION_KEY] = torch.full((b,), int(self.trainer.state.global_step) + 1, dtype=torch.long)

    def off_thread(self) -> bool:
        """Whether the log metrics are computed in the writer thread (decided once, at the first batch)."""
        if self._off is None:
            rec = self.rec
            self._off = (self.histograms is None and self.guard is None and rec.every_n_steps == 1
                         and rec.seq_fraction == 1.0 and rec.backpressure == "block")
            if self._off:
                rec.observe(self._observe)
        return self._off

    def _capture(self, out: tuple) -> None:  # self._captured: (logp, entropy[, (topk ids, topk logp)])
        # Copied now: the loss goes on using these tensors after this call returns.
        if self.off_thread():  # a device copy (no sync); record() stages it to the host
            self._captured = (out[0].detach().clone(), None if out[1] is None else out[1].detach().clone())
            return
        self._captured = (_host(out[0], copy=True), None if out[1] is None else _host(out[1], copy=True))

    def _record(self, inputs: dict, logp: np.ndarray, entropy: np.ndarray | None, topk: tuple = ()) -> None:
        t = self.trainer
        step = int(t.state.global_step) + 1  # the step TRL logs this micro-batch's metrics at
        if step != self._step:
            self._step, self._micro = step, 0
        micro, self._micro = self._micro, self._micro + 1
        per_generation = int(t.args.steps_per_generation)
        iteration = (int(t._step) % (per_generation * int(t.num_iterations))) // per_generation
        seq = self._seq_ids(inputs, logp.shape[0])
        self._pending = True
        top = dict(zip(("topk_ids", "topk_logp"), topk, strict=True)) if topk else {}
        if self._routes is not None:  # format v1.3: the trainer's routes (the engine's: not in TRL's batch)
            top["experts"] = self._routes if self.off_thread() else _host(self._routes)
        if self._routes is not None and self._margin is not None:  # the router's confidence per token
            margin = dict(zip(("route_margin_trainer", "route_margin_layer"), self._margin, strict=True))
            top.update(margin if self.off_thread() else {k: _host(v) for k, v in margin.items()})
        if self.off_thread():
            return self._record_tensors(inputs, step, micro, iteration, seq, logp, entropy, top)
        completion = _host(inputs["completion_mask"]).astype(bool)
        mask = completion & _host(inputs["tool_mask"]).astype(bool) if "tool_mask" in inputs else completion
        logp_old = _host_or_none(inputs.get("old_per_token_logps"))
        logp_ref = _host_or_none(inputs.get("ref_per_token_logps")) if self.has_ref else None
        partials = batch_partials(logp, logp_ref, logp_old, mask, _host_or_none(inputs.get("sampling_per_token_logps")))
        self._window = partials if self._window is None else merge_partials(self._window, partials)
        if self.histograms is not None:
            self.histograms.observe(logp, logp_ref, logp_old, mask)
        if self.guard is not None:  # before the recorder: a write error of kldiag does not blind the guard
            self.guard.observe(step, logp, logp_ref, logp_old, _host_or_none(inputs.get("sampling_per_token_logps")),
                               mask)
        self.rec.record(step=step, logp=logp, logp_old=logp_old, logp_ref=logp_ref,
                        logp_sampler=_host_or_none(inputs.get("sampling_per_token_logps")),
                        advantages=_host(inputs["advantages"]), mask=mask, completion_mask=completion,
                        token_ids=_host(inputs["completion_ids"]), seq_ids=seq,
                        group_ids=seq // int(t.num_generations), entropy=entropy, micro=micro, iteration=iteration,
                        policy_version=_host_or_none(inputs.get(VERSION_KEY)), **top)

    def _record_tensors(self, inputs: dict, step: int, micro: int, iteration: int, seq: np.ndarray, logp: Any,
                        entropy: Any, top: dict) -> None:
        """Off-thread mode: the tensors go to record() as they are (it copies them); no host work here."""
        completion = inputs["completion_mask"].bool()
        # Without a tool mask the loss mask is the completion mask, which the recorder writes as `mask`
        # when none is given: one tensor fewer to copy here and to gather in the writer.
        mask = completion & inputs["tool_mask"].bool() if "tool_mask" in inputs else None
        self.rec.record(step=step, logp=logp, logp_old=inputs.get("old_per_token_logps"),
                        logp_ref=inputs.get("ref_per_token_logps") if self.has_ref else None,
                        logp_sampler=inputs.get("sampling_per_token_logps"), advantages=inputs["advantages"],
                        mask=mask, completion_mask=completion, token_ids=inputs["completion_ids"], seq_ids=seq,
                        group_ids=seq // int(self.trainer.num_generations), entropy=entropy, micro=micro,
                        iteration=iteration, policy_version=inputs.get(VERSION_KEY), **top)

    def _observe(self, columns: dict[str, np.ndarray]) -> None:
        """Writer thread: merge one recorded batch's partials into the window (the same inputs as on-thread)."""
        try:
            mask = columns["mask"] if "mask" in columns else columns["completion"]
            p = batch_partials(columns["logp"], columns.get("logp_ref"), columns.get("logp_old"), mask,
                               columns.get("logp_sampler"))
        except Exception as e:  # noqa: BLE001 - raised (or counted) on the training thread at the next log
            self._observer_error = e
            return
        with self._window_lock:
            self._window = p if self._window is None else merge_partials(self._window, p)

    def _wait_converted(self) -> None:
        if not self.rec.wait_converted(LOG_WAIT_S):
            self.late_logs += 1

    def _seq_ids(self, inputs: dict, b: int) -> np.ndarray:
        seq = inputs.get(SEQ_KEY)
        if seq is not None:
            return _host(seq).astype(np.int64)
        # A subclass that builds its own inputs: fresh ids, unique but not stable across reuses.
        if self._next_seq == 0:
            warnings.warn(f"kldiag: inputs carry no {SEQ_KEY!r}; sequence ids will not be stable across "
                          "num_iterations reuses (does a subclass bypass _generate_and_score_completions?)",
                          stacklevel=3)
        start, self._next_seq = self._next_seq, self._next_seq + b
        return np.arange(start, start + b, dtype=np.int64)

    def _add_metrics(self, logs: dict) -> None:
        error, self._observer_error = self._observer_error, None
        if error is not None:
            raise error
        with self._window_lock:
            window, self._window, self._pending = self._window, None, False
        if window is None:  # the writer timed out on every batch of this window: they count at the next log
            if int(self.trainer.accelerator.num_processes) == 1:
                return
            window = batch_partials(np.zeros((0, 0), np.float32), None, None, np.zeros((0, 0), bool))
        partials = _reduce_across_ranks(window, self.trainer.accelerator)
        logs.update(log_metrics(partials, self.has_ref))
        if self.histograms is not None:
            self.histograms.flush(self.trainer)

    def _guarded(self, fn, *args) -> None:
        """Recording never kills training unless strict: failures are counted and warned about once."""
        try:
            fn(*args)
        except Exception as e:
            if self.strict:
                raise
            self.failures += 1
            if self.failures == 1:
                warnings.warn(f"kldiag: recording failed and is skipped ({type(e).__name__}: {e}); training goes "
                              "on. Pass strict=True to attach() to raise instead.", stacklevel=3)


def _close_callback(hook: _Hook) -> Any:
    from transformers import TrainerCallback

    class KldiagCloseCallback(TrainerCallback):
        """Closes the recorder when training ends, so the run is complete when train() returns."""

        def on_train_end(self, args, state, control, **kwargs):
            hook.close()

    return KldiagCloseCallback()


def _host(x: Any, copy: bool = False) -> np.ndarray:
    """Host numpy array of a tensor: floats as float32 (bf16/fp16 widened), device tensors copied.

    Without `copy`, a CPU tensor is viewed, not copied: such views are only read before the
    wrapper returns, and Recorder.record copies what it keeps, so no tensor the loss uses is
    ever written to.
    """
    import torch

    if isinstance(x, torch.Tensor):
        x = x.detach()
        dtype = torch.float32 if x.is_floating_point() else x.dtype
        if x.device.type == "cpu" and x.dtype == dtype and not copy:
            return x.numpy()
        return x.to(device="cpu", dtype=dtype, copy=True).numpy()
    return np.array(x, copy=copy)


def _host_or_none(x: Any) -> np.ndarray | None:
    return None if x is None else _host(x)
