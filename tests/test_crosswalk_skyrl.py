"""kldiag's SkyRL crosswalk equals SkyRL 0.4.0's own code (the installed package, unmodified) on the same tokens:
`RayPPOTrainer.fwd_logprobs_values_reward` (its forward passes replaced by given log-probs: the trainer method
itself computes `policy/rollout_train_logprobs_abs_diff_*`), and the worker's `compute_off_policy_correction` per
micro-batch reduced by `reduce_metrics` / `all_reduce_metrics` (`policy/loss_metrics/is_ratio_*`).
skyrl 0.4.0 declares Python >= 3.12: on 3.11, pydantic needs `typing_extensions.TypedDict` for the TypedDicts of
`skyrl/tinker/types.py` (which the trainer module imports through its generators), so the test substitutes it
before importing skyrl; no skyrl file is changed."""

from __future__ import annotations

import importlib.util
import json
import typing
from types import SimpleNamespace as NS

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("skyrl") is None:
    pytest.skip("skyrl 0.4.0 is not installed (make setup)", allow_module_level=True)

import kldiag.crosswalk as X  # noqa: E402
from kldiag.crosswalk import skyrl as SX  # noqa: E402
from kldiag.crosswalk.audit import audit  # noqa: E402
from kldiag.record.recorder import Recorder  # noqa: E402


@pytest.fixture(scope="module")
def skyrl():
    import typing_extensions

    saved = typing.TypedDict
    typing.TypedDict = typing_extensions.TypedDict  # Python 3.11 only: see the module doc
    try:
        from omegaconf import OmegaConf
        from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch
        from skyrl.backends.skyrl_train.utils.off_policy_correction_utils import compute_off_policy_correction
        from skyrl.backends.skyrl_train.workers.worker_utils import reduce_metrics
        from skyrl.train.trainer import RayPPOTrainer
    finally:
        typing.TypedDict = saved
    yield NS(Trainer=RayPPOTrainer, Batch=TrainingInputBatch, correction=compute_off_policy_correction,
             reduce=reduce_metrics, conf=OmegaConf)


def step_batch(seed: int, b: int = 8, r: int = 7):
    """A step's driver batch: [b, r] response block (right-padded), mu and the trainer's pi_old."""
    g = np.random.default_rng(seed)
    mask = np.arange(r)[None, :] < g.integers(1, r + 1, b)[:, None]
    old = np.where(mask, -g.exponential(1.0, (b, r)), 0.0).astype(np.float32)
    mu = np.where(mask, old + g.normal(0, 0.4, (b, r)), 0.0).astype(np.float32)
    mu[0, 0] = old[0, 0] - 25.0  # past SkyRL's +-20 clamp of the log ratio
    return old, mu, mask


CORRECTIONS = {"tis-token": dict(tis_ratio_type="token"),
               "token-mask": dict(token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0)}


def skyrl_step(s, old, mu, mask, correction, micro=2, minis=2):
    """SkyRL's own figures for one step: the trainer method, then per micro-batch of each mini-batch the worker's
    correction metrics, reduced per mini-batch and then over mini-batches as _execute_training_step does."""
    t = {k: torch.from_numpy(np.asarray(v)) for k, v in (("old", old), ("mu", mu), ("mask", mask.astype(np.int64)))}
    b, r = old.shape
    batch = s.Batch({"sequences": torch.ones(b, r + 3, dtype=torch.long), "attention_mask": torch.ones(b, r + 3),
                     "loss_mask": t["mask"], "response_mask": t["mask"], "rollout_logprobs": t["mu"]})
    batch.metadata = {"response_length": r}
    fake = NS(has_critic=False, ref_model=None, _skip_policy_forward=lambda ti: False, all_metrics={},
              _execute_forward_pass=lambda *a, **k: t["old"], dispatch=NS(empty_cache=lambda *a: None))
    s.Trainer.fwd_logprobs_values_reward(fake, batch)
    logged = dict(fake.all_metrics)
    cfg = s.conf.create({"tis_ratio_type": None, "sequence_mask_metric": None, "outlier_token_is_threshold_low": None,
                         "outlier_token_is_threshold_high": None, "token_mask_is_threshold_low": None,
                         "token_mask_is_threshold_high": None, "token_tis_ratio_clip_high": 2.0,
                         "sequence_tis_ratio_clip_high": 5.0, **correction})
    per_mini, calls = [], []
    size = b // minis
    for m in range(minis):
        metrics = {}
        for start in range(m * size, (m + 1) * size, micro):
            rows = slice(start, start + micro)
            _, got, _ = s.correction(t["old"][rows], t["mu"][rows], t["mask"][rows].float(), cfg)
            for k, v in got.items():
                metrics.setdefault(k, []).append(v)
            calls.append((m, start))
        per_mini.append(s.reduce(metrics))
    allm = {}
    for d in per_mini:
        for k, v in d.items():
            allm.setdefault(k, []).append(v)
    logged.update({f"policy/loss_metrics/{k}": v for k, v in s.reduce(allm).items()})
    return logged, calls


def record(path, steps, micro=2):
    """What kldiag's SkyRL hook records: the whole response block (padding: mask False) per micro-batch."""
    with Recorder(path, trainer="skyrl", config={"off_policy_correction": True}) as rec:
        for step, (old, mu, mask) in steps.items():
            for i, start in enumerate(range(0, len(mask), micro)):
                rows = slice(start, start + micro)
                rec.record(step=step, micro=i, logp=old[rows], logp_old=old[rows], logp_sampler=mu[rows],
                           mask=mask[rows], completion_mask=np.ones(mask[rows].shape, bool),
                           seq_ids=np.arange(start, start + micro))


@pytest.mark.parametrize("name", CORRECTIONS)
def test_crosswalk_equals_skyrls_trainer_and_worker_metrics_and_audit_agrees(skyrl, tmp_path, name):
    steps = {1: step_batch(1), 2: step_batch(2)}
    logged = {st: skyrl_step(skyrl, *batch, CORRECTIONS[name])[0] for st, batch in steps.items()}
    record(tmp_path / "run", steps)
    table = X.crosswalk(tmp_path / "run", "skyrl").to_pylist()
    worst = 0.0
    for row in table:
        for k in SX.DIFF + SX.IS:
            want = logged[row["step"]][k]
            assert row[k] == pytest.approx(want, rel=1e-5, abs=1e-7), (k, row["step"])
            if abs(want) > 1e-4:
                worst = max(worst, abs(row[k] - want) / abs(want))
    print(f"{name}: max rel diff {worst:.2e}")
    logs = tmp_path / "metrics.jsonl"  # SkyRL's tracker: the keys as logged, at global_step
    logs.write_text("".join(json.dumps({"step": st, **m}) + "\n" for st, m in logged.items()))
    result = audit(tmp_path / "run", logs, framework="skyrl")
    assert result.step_offset == 0
    verdicts = {m.name: m.verdict for m in result.metrics}
    assert all(verdicts[k] == "agree" for k in SX.DIFF + SX.IS), verdicts


def test_is_ratio_is_null_with_why_when_no_correction_is_on(tmp_path):
    record(tmp_path / "run", {1: step_batch(1)})
    table = X.crosswalk(tmp_path / "run", "skyrl", off_policy_correction=False)
    row = X.records(table)[0]
    assert row[SX.DIFF[2]] is not None and row[SX.IS[0]] is None
    assert "off_policy_correction" in row["null_reasons"][SX.IS[0]]


# ---- kldiag.integrations.skyrl: SkyRL's own callback API, fed SkyRL's own TrainingInputBatch ----

def test_the_hook_records_skyrls_micro_batches_and_its_crosswalk_equals_skyrl(skyrl, tmp_path):
    from omegaconf import OmegaConf
    from skyrl.train.utils.callbacks import CallbackInput, TrainingControl

    from kldiag.format import open_run
    from kldiag.integrations import skyrl as H

    cfg = OmegaConf.create({"trainer": {"algorithm": {"kl_estimator_type": "k3", "use_kl_loss": True,
                                                      "kl_loss_coef": 0.001, "eps_clip_low": 0.2, "eps_clip_high": 0.28,
                                                      "off_policy_correction": {"tis_ratio_type": "token",
                                                                                "token_tis_ratio_clip_high": 2.0}},
                                        "micro_train_batch_size_per_gpu": 1, "update_epochs_per_batch": 1},
                            "generator": {"sampling_params": {"temperature": 0.8, "top_p": 0.95, "top_k": -1}}})
    batches = {}
    trainer = NS(cfg=cfg, dispatch=NS(dp_size=lambda model: 2), callbacks=[],
                 convert_to_training_input=lambda out, uids: batches[out])
    trainer.add_callback = trainer.callbacks.append
    callback = H.attach(trainer, tmp_path / "run")
    logged = {}
    for step in (1, 2):
        old, mu, mask = step_batch(step)
        b, r = old.shape
        batch = skyrl.Batch({"sequences": torch.arange(b * (r + 3)).reshape(b, r + 3),
                             "attention_mask": torch.ones(b, r + 3, dtype=torch.long),
                             "loss_mask": torch.from_numpy(mask.astype(np.int64)),
                             "action_log_probs": torch.from_numpy(old), "rollout_logprobs": torch.from_numpy(mu),
                             "advantages": torch.ones(b, r)})
        batch.metadata = {"policy_mini_batch_boundaries": [(0, 4), (4, 8)], "response_length": r}
        batches[step] = batch
        trainer.convert_to_training_input(step, [f"u{i // 4}" for i in range(b)])
        callback.on_step_end(trainer, CallbackInput(global_step=step, epoch=0, total_steps=2, steps_per_epoch=2,
                                                    batch=batch), TrainingControl())
        # SkyRL with 2 DP ranks and micro-batches of 1 per rank: mini-batches of 4 rows, micro-batches of 1 row
        logged[step] = skyrl_step(skyrl, old, mu, mask, {"tis_ratio_type": "token"}, micro=1, minis=2)[0]
    callback.close()
    run = open_run(tmp_path / "run")
    assert run.manifest.config["off_policy_correction"] is True
    assert run.manifest.config["engine_sampling"]["top_p"] == 0.95
    table = X.crosswalk(run, "skyrl").to_pylist()
    for row in table:
        for k in SX.DIFF + SX.IS:
            assert row[k] == pytest.approx(logged[row["step"]][k], rel=1e-5, abs=1e-7), (k, row["step"])
    t = run.read(columns=["micro", "group", "seq"]).to_pandas()
    assert t.micro.nunique() == 8 and t["group"].nunique() == 2
