"""What each RL framework computes, names and accepts, in one place: numpy only, no I/O.

One module per framework (`trl`, `verl`, `slime`, `openrlhf`, `nemo_rl`, and `plain` for a torch
loop of your own), each with its fixes phrased in its own option names (`FIXES`), and where kldiag
depends on them its estimator names, clamps, reductions and supported versions. Integrations,
importers, the crosswalk, the trainer-compatible KL and the diagnosis all read them from here.
"""

from __future__ import annotations

from typing import Any

from kldiag.frameworks import nemo_rl, openrlhf, plain, slime, trl, verl

FAMILIES = ("trl", "verl", "slime", "openrlhf", "nemo_rl", "plain")
MODULES = {"trl": trl, "verl": verl, "slime": slime, "openrlhf": openrlhf, "nemo_rl": nemo_rl, "plain": plain}
# Trainers that clamp the K3 value at 10, leaving tokens with k3 > 10 no KL gradient: verl's and
# OpenRLHF's kl_penalty, NeMo-RL's kl_output_clamp_value, ROLL, SkyRL and AReaL.
CLAMPING_TRAINERS = ("verl", "openrlhf", "nemo_rl", "roll", "skyrl", "areal")
# The estimator name kldiag records for a clamped K3 loss (verl's and slime's low_var_kl).
CLAMPED_K3 = "k3_clamped"


def trainer_name(manifest: Any) -> str:
    """The manifest's trainer name, lower case with '-' as '_' ("" when there is none)."""
    return str((getattr(manifest, "trainer", None) or {}).get("name") or "").lower().replace("-", "_")


def family(manifest: Any) -> str:
    """The trainer family of a run from its manifest's trainer name ("plain" when unknown).

    "verl", "verl.v1", "verl_sync" are verl; "nemo-rl", "nemo_rl", "nemorl" are nemo_rl.
    """
    name = trainer_name(manifest)
    for f in FAMILIES[:-1]:
        if name == f or name.startswith(f + ".") or name.startswith(f + "_") or (f == "nemo_rl" and "nemo" in name):
            return f
    return "plain"


def clamps(manifest: Any) -> bool:
    """Whether the run's K3 loss is clamped at 10: the manifest's `kl_clamp`, else its estimator
    (`k3_clamped`, as kldiag's verl and slime hooks record low_var_kl), else its trainer."""
    cfg = getattr(manifest, "config", None) or {}
    if "kl_clamp" in cfg:
        return bool(cfg["kl_clamp"])
    if cfg.get("estimator") == CLAMPED_K3:
        return True
    name = trainer_name(manifest)
    return family(manifest) in CLAMPING_TRAINERS or any(name.startswith(t) for t in CLAMPING_TRAINERS)


def fix_for(cause: str, manifest: Any, **values: float) -> str:
    """The fix for `cause` phrased for the run's trainer; plain-torch advice otherwise.

    values fill the fix's placeholders (`t`: an implied temperature).
    """
    text = MODULES[family(manifest)].FIXES.get(cause) or plain.FIXES.get(cause, "")
    return text.format(**values) if values else text
