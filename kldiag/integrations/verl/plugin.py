"""kldiag's "verl.plugins" entry point: registers the kldiag_* V1 trainer modes.

verl 0.9.1 loads every entry point of the group "verl.plugins" at `import verl`
(verl/__init__.py, VERL_USE_EXTERNAL_PLUGINS, default "auto"), in the driver, the TaskRunner and
every worker. verl's trainer package cannot be imported that early (it imports verl itself), so
this module only waits for `verl.trainer.ppo.v1` to finish importing (a meta-path finder that
wraps that one module's loader) and then registers, with verl's own `register_trainer`
(trainer_base.py l. 1999):

    kldiag_sync            -> PPOTrainerSync            (trainer.v1.trainer_mode=kldiag_sync)
    kldiag_colocate_async  -> PPOTrainerColocateAsync
    kldiag_separate_async  -> PPOTrainerSeparateAsync

Each subclass, after verl's `_setup()` built the worker groups, replaces the actor loss by
kldiag's recording `ppo_loss` (kldiag.integrations.verl.attach), and tags every actor update with
the trainer's global step. The run is `kldiag.run` in the config (`+kldiag.run=URI`), else
$KLDIAG_RUN, else `{trainer.default_local_dir}/kldiag`. Nothing happens unless a run selects a mode.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any

from kldiag.integrations.verl import attach
from kldiag.integrations.verl.trainer import make_trainer, run_of

TARGET = "verl.trainer.ppo.v1"
MODES = {"kldiag_sync": "PPOTrainerSync", "kldiag_colocate_async": "PPOTrainerColocateAsync",
         "kldiag_separate_async": "PPOTrainerSeparateAsync"}


def register(module: Any | None = None) -> list[str]:
    """Register the kldiag_* modes in verl's TRAINER_REGISTRY (idempotent); returns their names.

    No version check here: an unsupported verl fails when a kldiag mode attaches (IntegrationError
    naming the supported range), never when verl merely imports its trainers.
    """

    v1 = module if module is not None else importlib.import_module(TARGET)
    for name, base in MODES.items():
        if name not in v1.trainer_base.TRAINER_REGISTRY:
            v1.register_trainer(name)(make_trainer(getattr(v1, base), lambda t: attach(t, run_of(t.config))))
    return list(MODES)


class _Loader(importlib.abc.Loader):
    """verl's own loader for TARGET, then `register` once the module has executed."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        try:
            register(module)
        except Exception as e:  # noqa: BLE001 - never break `import verl` for a run that does not use kldiag
            import warnings

            warnings.warn(f"kldiag could not register its verl trainer modes ({type(e).__name__}: {e}); "
                          "trainer.v1.trainer_mode=kldiag_* is unavailable", RuntimeWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != TARGET:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Finder)]
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """Register now if verl's trainer package is loaded, else as soon as it is."""
    if TARGET in sys.modules:
        register(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install()
