"""What each RL framework computes, names and accepts, in one place: numpy only, no I/O.

One module per framework (`trl`, `verl`, `slime`, `openrlhf`, `nemo_rl`, `skyrl`, `areal`, and `plain` for a torch
loop of your own), each with its fixes phrased in its own option names (`FIXES`, and `IF_SET`: the fix
to give instead when the run's manifest already has what a fix would set, see `SETTINGS`), and where kldiag
depends on them its estimator names, clamps, reductions and supported versions. Integrations,
importers, the crosswalk, the trainer-compatible KL and the diagnosis all read them from here.
"""

from __future__ import annotations

from typing import Any

from kldiag.frameworks import areal, nemo_rl, openrlhf, plain, skyrl, slime, trl, verl

FAMILIES = ("trl", "verl", "slime", "openrlhf", "nemo_rl", "skyrl", "areal", "plain")
MODULES = {"trl": trl, "verl": verl, "slime": slime, "openrlhf": openrlhf, "nemo_rl": nemo_rl, "skyrl": skyrl,
           "areal": areal, "plain": plain}
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


DAPO_CLIP_HIGH = 0.28  # the upper PPO clip epsilon DAPO recommends (clip-higher), which the entropy fixes name
# The manifest config keys that hold each framework's upper clip epsilon, and whether it corrects the
# engine/trainer mismatch with importance sampling (a key's last dotted component also matches).
CLIP_HIGH_KEYS = ("epsilon_high", "clip_ratio_high", "eps_clip_high", "ratio_clip_max", "eps_clip_higher")
ENGINE_IS_KEYS = ("vllm_importance_sampling_correction", "use_importance_sampling_correction", "use_tis",
                  "is_correction_level", "rollout_is", "tis_ratio_type", "rs_level")
OPSM_KEYS = ("off_policy_mask_threshold", "use_opsm")


def _items(cfg: dict, depth: int = 3):
    """(key, value) of a config and of the dicts nested in it (verl's hook keeps `rollout_correction` as one)."""
    for key, value in cfg.items():
        yield str(key), value
        if isinstance(value, dict) and depth > 1:
            yield from _items(value, depth - 1)


def _config_value(manifest: Any, names: tuple[str, ...]) -> Any:
    """The first of `names` the manifest config holds (a key, a dotted key's last part, or a key of a
    nested dict), else None."""
    cfg = getattr(manifest, "config", None) or {}
    for name in names:
        for key, value in _items(cfg):
            if value is not None and (key == name or key.endswith("." + name)):
                return value
    return None


def clip_high(manifest: Any) -> float | None:
    """The run's upper PPO clip epsilon: epsilon_high (TRL), clip_ratio_high (verl), eps_clip_high
    (slime), ratio_clip_max (NeMo-RL), eps_clip_low_high's second value (OpenRLHF), else clip_range's."""
    value = _config_value(manifest, CLIP_HIGH_KEYS)
    if value is None:
        pair = _config_value(manifest, ("eps_clip_low_high", "clip_range"))
        value = pair[-1] if isinstance(pair, (list, tuple)) and pair else None
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _on(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("", "off", "none", "null", "false", "0")
    return bool(value)


# What a fix would set, checked on the run's manifest: when it is already there, the framework's
# IF_SET text replaces its FIXES text (a fix never names the value the run already has).
SETTINGS = {
    "clip_higher": lambda m: (clip_high(m) or 0.0) >= DAPO_CLIP_HIGH - 1e-9,
    "engine_is": lambda m: _on(_config_value(m, ENGINE_IS_KEYS)),
    "opsm": lambda m: _on(_config_value(m, OPSM_KEYS)),
}


def _text(module: Any, cause: str, manifest: Any) -> str:
    alt = getattr(module, "IF_SET", {}).get(cause)
    if alt is not None and SETTINGS[alt[0]](manifest):
        return alt[1]
    return module.FIXES.get(cause, "")


def fix_for(cause: str, manifest: Any, **values: float) -> str:
    """The fix for `cause` phrased for the run's trainer; plain-torch advice otherwise. A framework's
    IF_SET alternative replaces the fix when the run's manifest already has what it would set.

    values fill the fix's placeholders (`t`: an implied temperature; `clip_high` is the run's own).
    """
    text = _text(MODULES[family(manifest)], cause, manifest) or _text(plain, cause, manifest)
    if "{" not in text:
        return text
    return text.format(**{"clip_high": clip_high(manifest) or 0.0, "t": float("nan"), **values})


from kldiag.frameworks import rollouts as _rollouts  # noqa: E402,F401 - the rollout causes' fixes, into each FIXES
