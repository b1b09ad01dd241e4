"""The engine's sampling settings in the manifest (config["engine_sampling"], kldiag.frameworks.sampling) from each
hook and importer, and the truncation fixes naming real options of each framework."""

from __future__ import annotations

import dataclasses
import re
import types
from pathlib import Path

import pytest

import kldiag
from kldiag.format import Manifest
from kldiag.frameworks import sampling as S

SPAN = re.compile(r"`([^`]+)`")


def test_settings_shape_and_off_values():
    s = S.settings(0.7, -1, 1.0, 0.0, None, [], "vllm", {"top_k": "x"})
    assert set(s) == set(S.NAMES)
    assert s["temperature"] == 0.7 and s["top_k"] is None and s["top_p"] is None and s["min_p"] is None
    assert S.truncations(s) == [] and S.unreplayed(s) == []
    s = S.settings(1.0, 20, 0.95, None, None, ["top_p"], None)
    assert S.truncations(s) == ["top_k", "top_p"] and S.unreplayed(s) == ["top_k"]
    assert S.unreplayed(S.settings(1.0, 20, mask_replay=None)) is None  # replay unknown
    assert S.of(Manifest(config={"engine_sampling": s})) == s and S.of(Manifest(config={})) is None


def test_trl_grpoconfig_to_manifest(tmp_path):
    trl = pytest.importorskip("trl")
    from kldiag.integrations import trl as kt

    args = trl.GRPOConfig(output_dir=str(tmp_path), temperature=0.9, top_k=20, top_p=0.95, min_p=0.05,
                          use_cpu=True, report_to=[])
    trainer = types.SimpleNamespace(args=args, epsilon_low=0.2, epsilon_high=0.28, num_generations=8,
                                    accelerator=types.SimpleNamespace(num_processes=1, process_index=0),
                                    processing_class=None)
    s = kt.recorder_defaults(trainer)["config"]["engine_sampling"]
    assert (s["temperature"], s["top_k"], s["top_p"], s["min_p"]) == (pytest.approx(0.9), 20, pytest.approx(0.95),
                                                                      pytest.approx(0.05))
    assert s["mask_replay"] == [] and s["engine"] == "transformers" and s["source"]["top_k"] == "GRPOConfig.top_k"
    default = S.from_trl(trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], use_vllm=True))
    assert S.truncations(default) == [] and default["logprobs_mode"] == "processed_logprobs"


def _verl_config():
    omegaconf = pytest.importorskip("omegaconf")
    verl = pytest.importorskip("verl")
    path = Path(verl.__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
    return omegaconf.OmegaConf.load(path)


def test_verl_rollout_config_to_manifest():
    from kldiag.integrations import verl as kv

    cfg = _verl_config()
    cfg.actor_rollout_ref.rollout.top_k = 50
    cfg.actor_rollout_ref.rollout.top_p = 0.9
    out = kv.settings(cfg.actor_rollout_ref.actor, None, "0.9.1", cfg.actor_rollout_ref.rollout)
    s = out["engine_sampling"]
    assert s["top_k"] == 50 and s["top_p"] == pytest.approx(0.9) and s["temperature"] == 1.0
    assert s["logprobs_mode"] == "processed_logprobs" and s["calculate_log_probs"] is True
    assert s["mask_replay"] == [] and s["source"]["top_k"] == "actor_rollout_ref.rollout.top_k"
    plain = kv.settings({"top_k": 5}, None, "0.9.1")  # no rollout config given: no sampling key
    assert "engine_sampling" not in plain
    d = S.from_verl({"temperature": 1.0, "top_k": -1, "top_p": 1})  # verl's defaults: no truncation
    assert S.truncations(d) == []


def test_slime_args_to_manifest(monkeypatch, tmp_path):
    from kldiag.integrations import slime as hook

    mpu = types.SimpleNamespace(get_data_parallel_rank=lambda with_context_parallel=False: 0,
                                get_data_parallel_world_size=lambda with_context_parallel=False: 1)
    monkeypatch.setenv(hook.ENV_RUN, str(tmp_path / "run"))
    monkeypatch.setattr(hook, "STATE", hook._State())
    args = types.SimpleNamespace(rollout_temperature=0.8, rollout_top_k=20, rollout_top_p=0.95, use_kl_loss=False,
                                 eps_clip=0.2, eps_clip_high=0.28)
    hook.recorder(args, mpu)
    hook.close()
    s = kldiag.open_run(tmp_path / "run").manifest.config["engine_sampling"]
    assert (s["temperature"], s["top_k"], s["top_p"]) == (pytest.approx(0.8), 20, pytest.approx(0.95))
    assert s["mask_replay"] == ["top_p"] and S.unreplayed(s) == ["top_k"]
    assert s["source"] == {"temperature": "--rollout-temperature", "top_k": "--rollout-top-k",
                           "top_p": "--rollout-top-p"}


def test_nemo_rl_generation_config_to_manifest(tmp_path):
    import importer_fixtures as fx

    from kldiag.importers import import_dumps

    fx.write_nemo(tmp_path / "logs", [1], group=2)
    generation = {"backend": "vllm", "temperature": 1.0, "top_p": 0.95, "top_k": None}
    import_dumps("nemo-rl", tmp_path / "logs", tmp_path / "run", group_size=2, generation=generation)
    s = kldiag.open_run(tmp_path / "run").manifest.config["engine_sampling"]
    assert s["top_p"] == pytest.approx(0.95) and s["top_k"] is None and s["engine"] == "vllm"
    assert s["mask_replay"] == ["top_k", "top_p"] and S.unreplayed(s) == []
    assert s["source"]["top_p"] == "policy.generation.top_p"


def test_trl_fix_names_grpoconfig_fields():
    trl = pytest.importorskip("trl")
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    named = set()
    for span in SPAN.findall(S.TRUNCATION_FIXES["trl"]):
        inner = span.removeprefix("GRPOConfig(").removesuffix(")")
        named |= {part.split("=")[0].strip() for part in inner.split(",")}
    assert named and named <= fields, named - fields


def test_verl_fix_keys_exist_in_verl_config():
    cfg = _verl_config()
    from omegaconf import OmegaConf

    keys = [s.split("=")[0] for s in SPAN.findall(S.TRUNCATION_FIXES["verl"])]
    assert len(keys) >= 3
    for key in keys:
        assert OmegaConf.select(cfg, key, default="<missing>") != "<missing>", key


def test_openrlhf_fix_names_flags_of_its_parser():
    from test_frameworks import _flags, _openrlhf_parser_source

    flags = _flags(_openrlhf_parser_source())
    named = {s.split()[0] for s in SPAN.findall(S.TRUNCATION_FIXES["openrlhf"]) if s.startswith("--")}
    assert named == {"--rollout.top_p"} and named <= flags
