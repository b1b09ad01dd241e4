"""The Guard on a TRL trainer: a TrainerCallback that acts at the end of each optimizer step.

`attach(trainer, run_dir, guard=kldiag.Guard(...))` installs it: the hook feeds the guard the
host copies of each loss micro-batch (the step TRL logs it at, `state.global_step + 1` while
the loss runs), and at `on_step_end` (after the optimizer step, `state.global_step` is that
step) the callback asks the guard for episodes that started. Then, per the guard's actions:
`control.should_save = True` (the Trainer saves `output_dir/checkpoint-STEP` in the same
step, transformers `Trainer._maybe_log_save_evaluate`), `control.should_training_stop = True`
(the Trainer leaves its loop after this step and runs on_train_end, so the recorder closes
and every row is published; with several processes, any rank's guard stops them all at the
same step), the reason in the trainer's logs (`kldiag/guard_stop_step`,
`log_history`) and in the run's manifest (config `guard_stop`). transformers 5.23.0,
TRL 1.16.0.
"""

from __future__ import annotations

from typing import Any


def install_guard(trainer: Any, hook: Any, guard: Any, config: dict[str, Any]) -> Any:
    """Wire `guard` to `trainer`: fed by `hook`, judged at each step end; returns the callback."""
    if guard.estimator is None:
        guard.estimator = config.get("estimator")  # k3_is when use_bias_correction_kl, else k3
    if guard.recorder is None:
        guard.recorder = hook.rec
    if hook.rec.flight_on and "flight" not in guard.actions:
        guard.actions += ("flight",)  # a sampled recording with a flight ring: publish it when an episode starts
    hook.guard = guard
    cb = guard_callback(guard, hook)
    trainer.add_callback(cb)
    return cb


def guard_callback(guard: Any, hook: Any = None) -> Any:
    from transformers import TrainerCallback

    class KldiagGuardCallback(TrainerCallback):
        """Turns the guard's verdict at each step end into a checkpoint and a clean stop."""

        def on_step_end(self, args, state, control, **kwargs):
            started = guard.end_step(int(state.global_step))
            save, stop = _any_rank(hook, bool(started) and guard.should_save, bool(started) and guard.should_stop)
            if not (started or save or stop):
                return control
            control.should_save = control.should_save or save
            if stop:  # every rank stops at the same step, or the others would hang in a collective
                control.should_training_stop = True
            if not started:
                return control
            reason = "; ".join(f"{e.kind} from step {e.start}: {e.message}" for e in started)
            state.log_history.append({"step": int(state.global_step), "kldiag/guard": reason,
                                      "kldiag/guard_stop_step": int(state.global_step) if guard.should_stop else None})
            if hook is not None and guard.should_stop:
                try:
                    hook.rec.update_config(guard_stop={"step": int(state.global_step), "reason": reason})
                except Exception:  # the manifest note is a courtesy; the stop stands without it
                    pass
            return control

        def on_train_end(self, args, state, control, **kwargs):
            guard.close()

    return KldiagGuardCallback()


def _any_rank(hook: Any, save: bool, stop: bool) -> tuple[bool, bool]:
    """(save, stop) if any rank's guard asks for it: one all-reduce of two numbers per step, and
    only with several processes (each rank's guard sees its own rank's tokens)."""
    acc = getattr(getattr(hook, "trainer", None), "accelerator", None)
    if acc is None or int(acc.num_processes) == 1:
        return save, stop
    import torch

    flags = acc.reduce(torch.tensor([float(save), float(stop)], device=acc.device), reduction="sum")
    return bool(flags[0].item() > 0), bool(flags[1].item() > 0)
