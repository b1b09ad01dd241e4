"""The engine's sampling settings in the run manifest, each framework's keys for them, and the fix for
truncated sampling (top-k / top-p / min-p) that the trainer does not replay.

The manifest key (written by the TRL, verl and slime hooks and the NeMo-RL importer; by hand otherwise):

    manifest.config["engine_sampling"] = {
        "temperature": float | None,    # the engine's sampling temperature
        "top_k": int | None,            # None: no top-k (the frameworks' -1 / 0 / null)
        "top_p": float | None,          # None: no top-p (1.0)
        "min_p": float | None,          # None: no min-p (0 / None)
        "logprobs_mode": str | None,    # vLLM's logprobs_mode where the framework sets it
        "mask_replay": list[str] | None,  # the truncations the trainer re-applies to its own log-probs
                                        # (["top_p"], ["top_k", "top_p"]); [] none; None unknown
        "engine": str | None,           # "vllm", "sglang", "transformers", ...
        "source": {name: framework key},  # where each value was read, in the framework's spelling
    }                                   # (verl adds "calculate_log_probs": whether the engine's log-probs are used)

Framework facts (checked in the sources named): TRL 1.16.0 `GRPOConfig.temperature/top_k/top_p/min_p`
(top_k 0 = off) scores the full vocabulary and starts vLLM with logprobs_mode="processed_logprobs"
(`trl/generation/vllm_generation.py`); verl 0.9.1 `actor_rollout_ref.rollout.temperature/top_k/top_p/
logprobs_mode/calculate_log_probs` (`verl/trainer/config/_generated_ppo_trainer.yaml`, top_k -1 = off) has no
sampling-mask replay in the actor; slime@624b824a `--rollout-temperature/--rollout-top-p/--rollout-top-k`
(`slime/utils/arguments.py`) renormalises the trainer's log-probs over SGLang's kept top-p ids whenever
rollout_top_p != 1 (`slime/backends/megatron_utils/loss.py` get_rollout_top_p_logprob_kwargs), not over top-k;
NeMo-RL@7ea279ab `policy.generation.temperature/top_p/top_k` (`examples/configs/grpo_math_1B.yaml`) re-applies
top-k and top-p to the training log-probs (`nemo_rl/distributed/model_utils.py`, apply_top_k_top_p); OpenRLHF
0.11.2 `--rollout.top_p` / `--rollout.temperature` (`openrlhf/cli/train_ppo_ray.py`), no top-k, no replay.
"""

from __future__ import annotations

from typing import Any

KEY = "engine_sampling"  # manifest.config[KEY] (run.json "sampling" is the recorder's own subsampling)
NAMES = ("temperature", "top_k", "top_p", "min_p", "logprobs_mode", "mask_replay", "engine", "source")
TRUNCATIONS = ("top_k", "top_p", "min_p")


def _get(cfg: Any, key: str) -> Any:
    """cfg[key] for a dict or a dict-like config (OmegaConf), else the attribute (argparse, dataclass)."""
    if cfg is None:
        return None
    if isinstance(cfg, dict):
        return cfg.get(key)
    getter = getattr(cfg, "get", None)
    if callable(getter):
        try:
            return getter(key, None)
        except Exception:  # noqa: BLE001 - a dataclass whose get() differs: the attribute below
            pass
    return getattr(cfg, key, None)


def _num(x: Any, kind: type) -> Any:
    try:
        return kind(x) if x is not None else None
    except (TypeError, ValueError):
        return None


def settings(temperature: Any = None, top_k: Any = None, top_p: Any = None, min_p: Any = None,
             logprobs_mode: Any = None, mask_replay: list[str] | None = None, engine: str | None = None,
             source: dict[str, str] | None = None) -> dict[str, Any]:
    """The manifest's sampling dict (module doc), with each framework's "off" value as None:
    top_k <= 0, top_p >= 1, min_p <= 0."""
    k, p, mp = _num(top_k, int), _num(top_p, float), _num(min_p, float)
    return {"temperature": _num(temperature, float), "top_k": k if k is not None and k > 0 else None,
            "top_p": p if p is not None and p < 1.0 else None, "min_p": mp if mp is not None and mp > 0 else None,
            "logprobs_mode": None if logprobs_mode is None else str(logprobs_mode),
            "mask_replay": None if mask_replay is None else list(mask_replay), "engine": engine,
            "source": dict(source or {})}


def truncations(s: dict | None) -> list[str]:
    """The truncations a sampling dict turns on ("top_k", "top_p", "min_p")."""
    return [t for t in TRUNCATIONS if s and s.get(t) is not None]


def unreplayed(s: dict | None) -> list[str] | None:
    """The truncations on that the trainer does not replay; None when the replay is unknown."""
    if s is None or s.get("mask_replay") is None:
        return None
    return [t for t in truncations(s) if t not in s["mask_replay"]]


def of(manifest: Any) -> dict | None:
    """The run's sampling dict from its manifest config, None when not recorded."""
    cfg = getattr(manifest, "config", None) or {}
    s = cfg.get(KEY) if isinstance(cfg, dict) else None
    return s if isinstance(s, dict) else None


def from_trl(args: Any) -> dict[str, Any]:
    """From a TRL GRPOConfig: TRL scores over the full vocabulary (no mask replay); with vLLM the engine
    returns processed (post-temperature, truncated, renormalised) log-probs."""
    vllm = bool(_get(args, "use_vllm"))
    return settings(_get(args, "temperature"), _get(args, "top_k"), _get(args, "top_p"), _get(args, "min_p"),
                    "processed_logprobs" if vllm else None, [], "vllm" if vllm else "transformers",
                    {n: f"GRPOConfig.{n}" for n in ("temperature", "top_k", "top_p", "min_p", "use_vllm")})


VERL_ROLLOUT = "actor_rollout_ref.rollout."


def from_verl(rollout: Any) -> dict[str, Any]:
    """From verl's `actor_rollout_ref.rollout` config (DictConfig, dict or dataclass): no mask replay in
    verl 0.9.1's actor; the engine's log-probs are used only with calculate_log_probs."""
    out = settings(_get(rollout, "temperature"), _get(rollout, "top_k"), _get(rollout, "top_p"), None,
                   _get(rollout, "logprobs_mode"), [], _get(rollout, "name"),
                   {n: VERL_ROLLOUT + n for n in ("temperature", "top_k", "top_p", "logprobs_mode", "name")})
    out["calculate_log_probs"] = _get(rollout, "calculate_log_probs")
    return out


def from_slime(args: Any) -> dict[str, Any]:
    """From slime's parsed arguments: the trainer replays top-p (SGLang's kept ids) whenever
    --rollout-top-p < 1, never top-k."""
    return settings(_get(args, "rollout_temperature"), _get(args, "rollout_top_k"), _get(args, "rollout_top_p"),
                    None, None, ["top_p"], "sglang",
                    {n: f"--rollout-{n.replace('_', '-')}" for n in ("temperature", "top_k", "top_p")})


def from_openrlhf(args: Any) -> dict[str, Any]:
    """From OpenRLHF 0.11.2's parsed arguments: vLLM samples with --rollout.temperature / --rollout.top_p
    (samples_generator.py), processed log-probs only with --algo.advantage.is_correction_level on
    (cli/train_ppo_ray.py l. 78); the actor divides its logits by the temperature and replays no truncation."""
    rollout, level = _get(args, "rollout"), _get(_get(_get(args, "algo"), "advantage"), "is_correction_level")
    mode = "processed_logprobs" if level not in (None, "off") else None
    return settings(_get(rollout, "temperature"), None, _get(rollout, "top_p"), None, mode, [],
                    "vllm", {"temperature": "--rollout.temperature", "top_p": "--rollout.top_p"})


def from_nemo_rl(generation: Any) -> dict[str, Any]:
    """From NeMo-RL's `policy.generation` config: the training log-probs get the same top-k/top-p filter."""
    return settings(_get(generation, "temperature"), _get(generation, "top_k"), _get(generation, "top_p"), None,
                    None, ["top_k", "top_p"], _get(generation, "backend"),
                    {n: f"policy.generation.{n}" for n in ("temperature", "top_k", "top_p", "backend")})


# The fix for `engine_truncated_sampling` (kldiag.diagnosis.truncation), in each framework's option names.
TRUNCATION_FIXES = {
    "trl": (
        "TRL scores the full vocabulary and does not replay vLLM's sampling mask, while vLLM returns the truncated, "
        "renormalised log-probs: sample the training completions without truncation, `GRPOConfig(top_k=0, "
        "top_p=1.0, min_p=None)` (truncate only at evaluation); `vllm_importance_sampling_correction` cannot undo it "
        "(the tokens outside the kept set are never drawn)."),
    "verl": (
        f"verl 0.9.1 does not replay the engine's sampling mask in the actor: sample training rollouts with "
        f"`{VERL_ROLLOUT}top_k=-1` and `{VERL_ROLLOUT}top_p=1` (keep truncation in `{VERL_ROLLOUT}val_kwargs` for "
        f"validation). `{VERL_ROLLOUT}logprobs_mode=raw_logprobs` (temperature 1 only) would hide the gap, not "
        "remove it: the tokens would still come from the truncated distribution."),
    "slime": (
        "slime replays top-p (the trainer renormalises over SGLang's `rollout_top_p_token_ids` when "
        "`--rollout-top-p` < 1) but not top-k: set `--rollout-top-k -1` for training rollouts and truncate with "
        "`--rollout-top-p` if you need to; with top-p alone, check that the rollout returns the kept ids."),
    "nemo_rl": (
        "NeMo-RL re-applies `policy.generation.top_k` / `policy.generation.top_p` to the training log-probs "
        "(apply_top_k_top_p in nemo_rl/distributed/model_utils.py): a gap means that filter is missing (an older "
        "NeMo-RL or a custom loss path): update it, or train with `policy.generation.top_k=null` and "
        "`policy.generation.top_p=1.0`."),
    "openrlhf": (
        "OpenRLHF 0.11.2 samples with vLLM's top-p (`--rollout.top_p`; it has no top-k flag) and scores the full "
        "vocabulary, with no replay of the kept set: train with `--rollout.top_p 1.0` (its default), and truncate "
        "only at evaluation."),
    "plain": (
        "The engine samples from a truncated distribution (top-k / top-p / min-p) and returns its renormalised "
        "log-probs, while the trainer scores the full vocabulary: apply the engine's kept set in the trainer "
        "(log-softmax over the kept ids, DeepSeek-V3.2's 'keep sampling mask', arXiv 2512.02556 sec. 3.1), or "
        "sample training rollouts without truncation."),
}


def truncation_fix(family: str) -> str:
    """The fix for a run of trainer family `family` (kldiag.frameworks.family), plain-torch advice otherwise."""
    return TRUNCATION_FIXES.get(family, TRUNCATION_FIXES["plain"])
