"""Fixes name real options, in each framework's own spelling, and never the value a run already has.

TRL: every backticked name is a `trl.GRPOConfig` field. verl: every dotted key exists in verl's trainer
config (the installed verl 0.9.1's `verl/trainer/config/_generated_ppo_trainer.yaml`, the flattened hydra
config of `ppo_trainer.yaml`). OpenRLHF: every flag is an `add_argument` of `openrlhf/cli/train_ppo_ray.py`
in the 0.11.2 wheel, parsed with ast, never imported: `make setup` downloads it to .venv/wheels; or set
OPENRLHF_SRC to the wheel, a folder holding it, or the unpacked package; an installed openrlhf is read too.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re
import zipfile
from pathlib import Path

import pytest

from kldiag.diagnosis import CAUSE_NAMES
from kldiag.format import Manifest
from kldiag.frameworks import MODULES, SETTINGS, fix_for
from kldiag.frameworks import nemo_rl as nemo_fw
from kldiag.frameworks import openrlhf as openrlhf_fw
from kldiag.frameworks import trl as trl_fw
from kldiag.frameworks import verl as verl_fw

SPAN = re.compile(r"`([^`]+)`")


def texts(module) -> list[str]:
    """Every fix text of a framework module: FIXES and the IF_SET alternatives."""
    return [*module.FIXES.values(), *(text for _, text in getattr(module, "IF_SET", {}).values())]


def spans(module) -> list[str]:
    return [s for t in texts(module) for s in SPAN.findall(t)]


def test_every_fix_is_for_a_known_cause_and_setting():
    for name, module in MODULES.items():
        assert set(module.FIXES) <= set(CAUSE_NAMES), name
        for cause, (setting, text) in getattr(module, "IF_SET", {}).items():
            assert cause in CAUSE_NAMES and setting in SETTINGS and text != module.FIXES.get(cause), (name, cause)
    assert set(MODULES["plain"].FIXES) == set(CAUSE_NAMES)  # every cause has a fix for a plain torch loop
    assert set(trl_fw.FIXES) == set(CAUSE_NAMES)


def _trl_key(span: str) -> str:
    key = span.removeprefix("GRPOConfig(").removeprefix("GRPOConfig.").removesuffix(")")
    return key.split("=")[0].strip()


def test_trl_fixes_name_grpoconfig_fields():
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    named = {_trl_key(s) for s in spans(trl_fw)}
    assert len(named) >= 15 and all(k.isidentifier() for k in named), named
    assert named <= fields, named - fields


def _verl_config() -> dict:
    yaml = pytest.importorskip("yaml")
    spec = importlib.util.find_spec("verl")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("verl is not installed (make installs verl==0.9.1)")
    path = Path(next(iter(spec.submodule_search_locations)), "trainer", "config", "_generated_ppo_trainer.yaml")
    return yaml.safe_load(path.read_text())


def _verl_megatron_config() -> dict:
    """verl's Megatron trainer config (the backend that has `actor.megatron.router_replay`), beside the default one."""
    yaml = pytest.importorskip("yaml")
    spec = importlib.util.find_spec("verl")
    path = Path(next(iter(spec.submodule_search_locations)), "trainer", "config", "_generated_ppo_megatron_trainer.yaml")
    return yaml.safe_load(path.read_text())


def _has(config: dict, key: str) -> bool:
    node = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_verl_fixes_name_keys_of_its_config():
    config = _verl_config()
    keys = [s.split("=")[0] for s in spans(verl_fw)]
    dotted = [k for k in keys if "." in k]
    assert len(set(dotted)) >= 10
    assert all(k in ("kl_cov",) for k in keys if "." not in k)  # the rest are values (a loss mode)
    megatron = _verl_megatron_config()
    missing = sorted({k for k in dotted if not _has(config, k) and not _has(megatron, k)})
    assert not missing, missing
    assert _has(megatron, "actor_rollout_ref.actor.megatron.router_replay.mode")
    assert _has(config, "actor_rollout_ref.actor.policy_loss.loss_mode")


def _openrlhf_parser_source() -> str:
    src = os.environ.get("OPENRLHF_SRC") or str(Path(__file__).resolve().parent.parent / ".venv" / "wheels")
    member = "openrlhf/cli/train_ppo_ray.py"
    if src:
        p = Path(src)
        wheels = sorted(p.glob("openrlhf-*.whl")) if p.is_dir() else [p] if p.suffix == ".whl" else []
        if wheels:
            with zipfile.ZipFile(wheels[-1]) as z:
                name = next(n for n in z.namelist() if n.endswith(member))
                return z.read(name).decode()
        hit = next(iter(p.rglob("train_ppo_ray.py")), None)
        if hit is not None:
            return hit.read_text()
    spec = importlib.util.find_spec("openrlhf")  # an installed copy, read as text
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)), "cli", "train_ppo_ray.py").read_text()
    pytest.skip("no OpenRLHF source: pip download openrlhf==0.11.2 --no-deps -d DIR and set OPENRLHF_SRC=DIR")


def _flags(source: str) -> set[str]:
    """Every flag passed to add_argument; f-strings over `prefix` expand to actor and critic, as the parser does."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args):
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            out.add(first.value)
        elif isinstance(first, ast.JoinedStr):
            for prefix in ("actor", "critic"):
                out.add("".join(v.value if isinstance(v, ast.Constant) else prefix for v in first.values))
    return out


def test_openrlhf_fixes_name_flags_of_its_parser():
    flags = _flags(_openrlhf_parser_source())
    assert "--algo.kl.estimator" in flags and "--actor.adam.lr" in flags  # the parse sees plain and f-string flags
    named = {s.split()[0] for s in spans(openrlhf_fw) if s.startswith("--")}
    assert len(named) >= 10
    assert named <= flags, sorted(named - flags)
    assert not {"--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type"} & flags


def test_nemo_rl_engine_fix_names_its_is_correction():
    text = fix_for("engine_mismatch", Manifest(trainer={"name": "nemo-rl"}))
    assert "`loss_fn.use_importance_sampling_correction=true`" in text
    assert all(s.startswith(("loss_fn.", "policy.")) for s in spans(nemo_fw))


CLIP_HIGH = {"trl": {"epsilon_high": 0.28}, "verl": {"clip_ratio_high": 0.28}, "slime": {"eps_clip_high": 0.28},
             "openrlhf": {"eps_clip_low_high": [0.2, 0.28]}, "nemo_rl": {"ratio_clip_max": 0.28},
             "plain": {"clip_range": [0.2, 0.28]}}
ENGINE_IS = {"trl": {"vllm_importance_sampling_correction": True}, "verl": {"rollout_is": "token"},
             "slime": {"use_tis": True}, "openrlhf": {"is_correction_level": "token"},
             "nemo_rl": {"use_importance_sampling_correction": True}, "plain": {"use_tis": True}}


@pytest.mark.parametrize("family", sorted(CLIP_HIGH))
def test_a_run_that_has_the_recommended_value_gets_another_recommendation(family):
    trainer = {"name": family.replace("_", "-")}
    default = fix_for("entropy_collapse", Manifest(trainer=trainer, config={"clip_range": [0.2, 0.2]}))
    assert "0.28" in default and "already" not in default  # clip-higher is the first advice ...
    for config in (CLIP_HIGH[family], {"clip_range": [0.2, 0.28]}):
        text = fix_for("entropy_collapse", Manifest(trainer=trainer, config=config))
        assert text != default and "is already" in text and "e.g. 0.28" not in text  # ... unless the run has it
        assert "0.28" in text  # it says what the run has
    on = fix_for("engine_mismatch", Manifest(trainer=trainer, config=ENGINE_IS[family]))
    assert on != fix_for("engine_mismatch", Manifest(trainer=trainer)) and "already" in on
    off = {k: False if v is True else "off" if isinstance(v, str) else v for k, v in ENGINE_IS[family].items()}
    assert fix_for("engine_mismatch", Manifest(trainer=trainer, config=off)) == fix_for(
        "engine_mismatch", Manifest(trainer=trainer))


def test_manifest_keys_with_a_prefix_or_nested_count():
    m = Manifest(trainer={"name": "verl"}, config={"actor_rollout_ref.actor.clip_ratio_high": 0.3})
    assert "is already `actor_rollout_ref.actor.clip_ratio_high=0.3`" in fix_for("entropy_collapse", m)
    hook = Manifest(trainer={"name": "verl"}, config={"rollout_correction": {"rollout_is": "token"}})  # as the hook
    assert "is already on" in fix_for("engine_mismatch", hook)
    off = Manifest(trainer={"name": "verl"}, config={"rollout_correction": {"rollout_is": None}})
    assert fix_for("engine_mismatch", off) == verl_fw.FIXES["engine_mismatch"]


GOLDEN = Path(__file__).resolve().parent / "golden"


def _golden(name: str) -> set[str]:
    return {line.strip() for line in (GOLDEN / name).read_text().splitlines() if line.strip() and line[0] != "#"}


def test_slime_fixes_name_flags_slime_has():
    """slime is not on PyPI: its flags at THUDM/slime@624b824a (slime/utils/arguments.py) are a golden file."""
    from kldiag.frameworks import slime

    flags = _golden("slime_arguments_624b824a.txt")
    named = {f for text in slime.FIXES.values() for f in re.findall(r"`(--[a-z0-9-]+)", text)}
    assert named and named <= flags, named - flags


def test_nemo_rl_fixes_name_keys_of_its_grpo_config():
    """NeMo-RL is not on PyPI: the keys of NVIDIA-NeMo/RL@7ea279ab examples/configs/grpo_math_1B.yaml are a
    golden file; every dotted key a fix names is one of them."""
    from kldiag.frameworks import nemo_rl

    keys = _golden("nemo_rl_grpo_math_1B_keys_7ea279ab.txt")
    named = {k for text in nemo_rl.FIXES.values() for k in re.findall(r"`([a-z_]+(?:\.[a-z_]+)+)", text)}
    assert named and named <= keys, named - keys
