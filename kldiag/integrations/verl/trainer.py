"""kldiag's subclass of a verl V1 trainer: tags each actor update with the global step, turns the
workers' `kldiag_partials/...` into the `kldiag/...` metrics verl logs (verl_metrics) and, in a
kldiag_* trainer mode, attaches the recording loss once verl's `_setup()` built the worker groups."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from kldiag.integrations.verl.metrics import finish

ENV_RUN = "KLDIAG_RUN"


def config_get(cfg: Any, key: str, default: Any = None) -> Any:
    """cfg[key] for a dict, an OmegaConf DictConfig or a verl dataclass config."""
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    getter = getattr(cfg, "get", None)
    if callable(getter):
        try:
            return getter(key, default)
        except Exception:  # noqa: BLE001 - a dataclass whose get() differs: fall back to the attribute
            pass
    return getattr(cfg, key, default)


def run_of(config: Any) -> str:
    """The kldiag run a verl config records into: `kldiag.run`, else $KLDIAG_RUN, else
    `{trainer.default_local_dir}/kldiag`."""
    run = config_get(config_get(config, "kldiag"), "run") or os.environ.get(ENV_RUN)
    if not run:
        run = os.path.join(str(config_get(config_get(config, "trainer"), "default_local_dir", "checkpoints")),
                           "kldiag")
    return str(run)


def make_trainer(base: type, on_setup: Callable[[Any], None] | None = None) -> type:
    """A subclass of verl's trainer `base` whose actor updates carry the trainer's global step;
    `on_setup(trainer)` runs after verl's `_setup()` (the kldiag_* modes attach the recording loss there)."""

    class KldiagTrainer(base):  # type: ignore[misc, valid-type]
        kldiag_tags_steps = True

        def _setup(self) -> None:
            super()._setup()
            if on_setup is not None:
                on_setup(self)

        def _update_actor(self, batch: Any, metrics: dict) -> Any:
            batch.extra_info["kldiag_step"] = int(self.global_steps)  # reaches the loss as non-tensor data
            out = super()._update_actor(batch, metrics=metrics)
            finish(metrics)  # the previous step's kldiag/* figures, next to verl's actor/* (verl_metrics)
            return out

    KldiagTrainer.__name__ = KldiagTrainer.__qualname__ = f"Kldiag{base.__name__}"
    return KldiagTrainer
