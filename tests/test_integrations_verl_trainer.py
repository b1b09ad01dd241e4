"""The one-line verl attach: kldiag's "verl.plugins" entry point, the kldiag_* V1 trainer modes in verl's
own registry, `attach` on verl's default config (hydra compose of ppo_trainer.yaml), the step tag
through verl's real `_update_actor`, and the loss surviving pickling (Ray ships it to the workers).

The trainer is created without its __init__ (that starts Ray, datasets and GPU worker groups); its
worker group is a stand-in that records what verl's trainer code hands it.
"""

from __future__ import annotations

import os
import pickle
from functools import partial

import pytest

torch = pytest.importorskip("torch")
verl = pytest.importorskip("verl")
v1 = pytest.importorskip("verl.trainer.ppo.v1")

import kldiag  # noqa: E402
from kldiag.integrations import verl as hook  # noqa: E402
from kldiag.integrations.verl import plugin as verl_plugin  # noqa: E402
from kldiag.integrations.verl.trainer import run_of  # noqa: E402


@pytest.fixture(scope="module")
def config():
    from hydra import compose, initialize_config_dir

    conf_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        return compose("ppo_trainer", overrides=[
            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.05",
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "algorithm.rollout_correction.rollout_is=token", "trainer.v1.trainer_mode=kldiag_sync"])


class WorkerGroup:
    """Stands in for the actor RayWorkerGroup: keeps what the trainer calls it with."""

    def __init__(self):
        self.loss_fn = None
        self.batches = []

    def set_loss_fn(self, loss_fn):
        self.loss_fn = pickle.loads(pickle.dumps(loss_fn))  # what Ray does to the argument

    def update_actor(self, batch):
        self.batches.append(batch)
        return {"metrics": {"mfu": [0.5], "kl_loss": [0.25]}}


def trainer_of(config, tmp_path):
    import copy

    from omegaconf import open_dict

    cls = v1.get_trainer_cls(config.trainer.v1.trainer_mode)
    trainer = object.__new__(cls)
    config = copy.deepcopy(config)
    with open_dict(config):
        config.kldiag = {"run": str(tmp_path / "run")}  # what `+kldiag.run=...` on the command line gives
    trainer.config, trainer.actor_rollout_wg, trainer.global_steps = config, WorkerGroup(), 7
    return trainer


def test_plugin_entry_point_registers_the_modes_in_verls_registry():
    from importlib.metadata import entry_points

    assert [ep.value for ep in entry_points(group="verl.plugins") if ep.name == "kldiag"] == [verl_plugin.__name__]
    for mode, base in verl_plugin.MODES.items():
        cls = v1.get_trainer_cls(mode)
        assert issubclass(cls, getattr(v1, base)) and cls is not getattr(v1, base)
    assert verl_plugin.register() == list(verl_plugin.MODES)  # idempotent


def test_attach_installs_the_recording_loss_with_the_runs_settings(config, tmp_path):
    trainer = trainer_of(config, tmp_path)
    assert run_of(trainer.config) == str(tmp_path / "run")
    hook.attach(trainer, run_of(trainer.config))
    fn = trainer.actor_rollout_wg.loss_fn
    assert isinstance(fn, partial) and fn.func is hook.ppo_loss and fn.keywords["run"] == str(tmp_path / "run")
    cfg = fn.keywords["manifest_config"]
    assert cfg["kl_loss_coef"] == 0.05 and cfg["loss_agg_mode"] == "seq-mean-token-mean"
    assert cfg["kl_loss_type"] == "low_var_kl" and cfg["policy_loss.loss_mode"] == "vanilla"
    assert cfg["rollout_correction"]["rollout_is"] == "token" and cfg["verl_version"] == verl.__version__
    assert fn.keywords["config"].loss_agg_mode == "seq-mean-token-mean"  # verl's ActorConfig, as the worker builds


def test_update_actor_tags_the_batch_with_the_global_step(config, tmp_path):
    from transfer_queue import KVBatchMeta

    trainer = trainer_of(config, tmp_path)
    metrics = {}
    batch = KVBatchMeta(keys=["a", "b"], tags=[{}, {}], partition_id="train")
    trainer._update_actor(batch, metrics)  # verl's PPOTrainer._update_actor under the kldiag subclass
    sent = trainer.actor_rollout_wg.batches[0]
    assert sent.extra_info["kldiag_step"] == 7 and sent.extra_info["epochs"] == 1
    assert metrics["actor/kl_loss"] == 0.25


def test_unsupported_verl_fails_when_the_mode_attaches(config, tmp_path, monkeypatch):
    monkeypatch.setattr(verl, "__version__", "0.10.2")
    with pytest.raises(kldiag.KldiagError, match=r"supports verl>=0.9,<0.10, found verl 0.10.2"):
        hook.attach(trainer_of(config, tmp_path))


def test_attach_on_a_plain_verl_trainer_tags_steps_too(config, tmp_path):
    from transfer_queue import KVBatchMeta

    trainer = object.__new__(v1.get_trainer_cls("sync"))
    trainer.config, trainer.actor_rollout_wg, trainer.global_steps = config, WorkerGroup(), 3
    hook.attach(trainer, tmp_path / "run")
    assert isinstance(trainer, v1.PPOTrainerSync) and trainer.kldiag_tags_steps
    trainer._update_actor(KVBatchMeta(keys=["a"], tags=[{}], partition_id="train"), {})
    assert trainer.actor_rollout_wg.batches[0].extra_info["kldiag_step"] == 3
