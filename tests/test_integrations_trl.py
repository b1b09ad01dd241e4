"""kldiag.integrations.trl against a real TRL GRPOTrainer on a tiny CPU model.

The model (2-layer Qwen2, hidden 32, WordLevel vocabulary of ~30 words) is built once per
module and saved to a temp dir, since TRL loads the policy and reference model by path.
Each run is a few optimizer steps with num_iterations=2, so old and current log-probs
differ, and beta > 0, so TRL logs `kl`.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import trl
from transformers import TrainerCallback

import kldiag
from kldiag import estimators as E
from kldiag.errors import IntegrationError
from kldiag.integrations import trl as kt

pytestmark = pytest.mark.slow

# The example builds the tiny model; the test reuses it, so both stay in step.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from trl_grpo import WORDS, build_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


def count_cats(completions, **kwargs):
    return [float(c.split().count("cat")) - 0.1 * len(c.split()) for c in completions]


def make_trainer(model_dir, out_dir, trainer_cls=None, **overrides):
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast

    options = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "num_generations": 4,
                   "max_completion_length": 8, "num_iterations": 2, "beta": 0.1, "learning_rate": 5e-2, "max_steps": 4,
                   "logging_steps": 1, "report_to": [], "use_cpu": True, "seed": 0, "save_strategy": "no",
                   "disable_tqdm": True}
    options.update(overrides)
    prompts = [" ".join(WORDS[i % 20:i % 20 + 3]) for i in range(64)]
    return (trainer_cls or trl.GRPOTrainer)(
        model=str(model_dir), reward_funcs=count_cats, args=trl.GRPOConfig(output_dir=str(out_dir), **options),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        # Not AutoTokenizer: it would pick Qwen2Tokenizer from config.json and rebuild a BPE.
        processing_class=PreTrainedTokenizerFast.from_pretrained(model_dir))


def train_attached(model_dir, tmp_path, trainer_cls=None, **overrides):
    trainer = make_trainer(model_dir, tmp_path / "out", trainer_cls, **overrides)
    run = tmp_path / "run"
    rec = kt.attach(trainer, run, rotate_steps=2)
    trainer.train()
    return trainer, run, rec


def train_keeping_first_batch(trainer) -> tuple[dict, dict]:
    """Train `trainer` (kldiag attached) and return the policy's weights and the inputs of its first loss call, as
    the loss saw them, so that a test can replay that forward; the hook counted no failure."""
    seen = {}
    hooked = trainer.compute_loss

    def keep_first_batch(model, inputs, *args, **kwargs):
        if not seen:
            seen["state"] = copy.deepcopy(trainer.model.state_dict())
            seen["inputs"] = {k: v.clone() if torch.is_tensor(v) else v for k, v in inputs.items()}
        return hooked(model, inputs, *args, **kwargs)

    trainer.compute_loss = keep_first_batch
    trainer.train()
    assert trainer._kldiag_hook.failures == 0
    return seen["state"], seen["inputs"]

def logged(trainer, key):
    """{step: value} of a metric in trainer.state.log_history (training logs only)."""
    return {h["step"]: h[key] for h in trainer.state.log_history if key in h}


def recorded_trainer_kl(run):
    """TRL's `kl` recomputed from the rows: masked mean per micro-batch, mean over micro-batches."""
    r = kldiag.open_run(run)
    estimator = r.manifest.config["estimator"]
    t = r.read().to_pandas()
    t = t[t["mask"]]
    old = t["logp_old"].to_numpy(dtype=np.float64, na_value=np.nan)
    old = np.where(np.isnan(old), t["logp"], old)
    t = t.assign(kl=E.value(estimator, t["logp"].to_numpy(), t["logp_ref"].to_numpy(), old))
    micro_means = t.groupby(["step", "micro"])["kl"].mean()
    return micro_means.groupby(level="step").mean().to_dict()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """One attached run per use_bias_correction_kl value."""
    out = {}
    for corrected in (False, True):
        tmp = tmp_path_factory.mktemp(f"run_bc_{corrected}")
        out[corrected] = train_attached(tiny_model_dir, tmp, use_bias_correction_kl=corrected)
    return out


@pytest.mark.parametrize("corrected", [False, True])
def test_recorded_rows_reproduce_trl_kl(runs, corrected):
    trainer, run, _rec = runs[corrected]
    trl_kl = logged(trainer, "kl")
    assert sorted(trl_kl) == [1, 2, 3, 4]
    assert max(trl_kl.values()) > 1e-3  # the policy moved away from the reference
    mine = recorded_trainer_kl(run)
    assert sorted(mine) == sorted(trl_kl)
    for step, value in trl_kl.items():
        assert mine[step] == pytest.approx(value, rel=1e-5, abs=1e-9), step


@pytest.mark.parametrize("corrected", [False, True])
def test_analyze_trainer_compatible_reproduces_trl_kl(runs, corrected):
    trainer, run, _ = runs[corrected]
    analysis = kldiag.analyze(run, kldiag.AnalysisConfig(trainer_compatible=True))
    assert analysis.trainer_kl is not None
    tk = analysis.trainer_kl.to_pydict()
    ours = dict(zip(tk["step"], tk["kl"], strict=True))
    trl_kl = logged(trainer, "kl")
    assert sorted(ours) == sorted(trl_kl)
    for step, value in trl_kl.items():
        assert ours[step] == pytest.approx(value, rel=1e-5, abs=1e-9), step


@pytest.mark.parametrize("layout", [
    {"steps_per_generation": 1, "max_steps": 2},  # both passes over a batch inside one optimizer step
    {"importance_sampling_level": "sequence", "max_steps": 4},  # TRL's coef_1 is per sequence
    {"num_iterations": 1, "max_steps": 2},  # on-policy: logp_old null
], ids=["reuse_in_step", "sequence_is", "on_policy"])
def test_analyze_trainer_compatible_in_other_layouts(tiny_model_dir, tmp_path, layout):
    trainer, run, _ = train_attached(tiny_model_dir, tmp_path, **layout)
    tk = kldiag.analyze(run, kldiag.AnalysisConfig(trainer_compatible=True)).trainer_kl.to_pydict()
    ours = dict(zip(tk["step"], tk["kl"], strict=True))
    trl_kl = logged(trainer, "kl")
    assert sorted(ours) == sorted(trl_kl)
    for step, value in trl_kl.items():
        assert ours[step] == pytest.approx(value, rel=1e-5, abs=1e-9), step


def test_manifest_config_and_vocab(runs):
    for corrected, (trainer, run, rec) in runs.items():
        m = kldiag.open_run(run).manifest
        assert m.trainer == {"name": "trl", "version": trl.__version__}
        c = m.config
        assert c["estimator"] == ("k3_is" if corrected else "k3")
        assert c["beta"] == pytest.approx(0.1) and c["use_bias_correction_kl"] is corrected
        assert c["num_iterations"] == 2 and c["loss_type"] == trainer.args.loss_type
        assert c["importance_sampling_level"] == "token" and c["off_policy_mask_threshold"] is None
        assert c["clip_range"] == [pytest.approx(0.2), pytest.approx(0.2)]
        import transformers
        assert c["transformers_version"] == transformers.__version__
        assert c["engine_sampling"]["temperature"] == trainer.args.temperature and c["engine_sampling"]["top_k"] is None
        assert c["engine_sampling"]["source"]["top_p"] == "GRPOConfig.top_p"  # kldiag.frameworks.sampling
        vocab = kldiag.open_run(run).vocab()
        assert vocab[trainer.processing_class.convert_tokens_to_ids("cat")] == "cat"
        assert rec.stats["rows"] > 0 and rec.stats["write_errors"] == 0


def test_rows_carry_steps_iterations_and_stable_sequence_ids(runs):
    trainer, run, _ = runs[True]
    t = kldiag.open_run(run).read().to_pandas()
    assert sorted(t["step"].unique()) == [1, 2, 3, 4]
    assert sorted(t["micro"].unique()) == [0, 1]
    # steps 1, 3: first pass over a generation batch; steps 2, 4: its reuse
    assert dict(t.groupby("step")["iteration"].unique().map(list)) == {1: [0], 2: [1], 3: [0], 4: [1]}
    assert t["logp_old"].notna().all() and t["logp_ref"].notna().all() and t["logp_sampler"].isna().all()
    assert t["entropy"].notna().all()
    for first, reuse in ((1, 2), (3, 4)):
        a = t[t["step"] == first].set_index(["seq", "pos"]).sort_index()
        b = t[t["step"] == reuse].set_index(["seq", "pos"]).sort_index()
        assert a.index.equals(b.index)  # the same sequences, under the same ids
        np.testing.assert_array_equal(a["token_id"], b["token_id"])
        np.testing.assert_array_equal(a["logp_old"], b["logp_old"])  # old log-probs are computed once
        assert not np.allclose(a["logp"], b["logp"])  # the policy moved in between
    assert (t.groupby("seq")["group"].nunique() == 1).all()
    assert (t.groupby("group")["seq"].nunique() == trainer.num_generations).all()
    assert t.groupby("seq")["advantage"].nunique().max() == 1


def test_kldiag_metrics_appear_in_log_history(runs):
    trainer, _, _ = runs[True]
    steps = sorted(logged(trainer, "kl"))
    for name in ("k3_mean", "k3_is_mean", "weight_k3_abs_max", "flagged_frac", "blame_share", "rho_max"):
        values = logged(trainer, kt.METRIC_PREFIX + name)
        assert sorted(values) == steps, name
        assert all(math.isfinite(v) for v in values.values()), name
    assert all(0.0 <= v <= 1.0 for v in logged(trainer, "kldiag/blame_share").values())
    assert max(logged(trainer, "kldiag/rho_max").values()) > 1.0  # reuse iterations are off-policy


@pytest.mark.parametrize("corrected", [False, True])
def test_log_metrics_agree_with_analysis(runs, corrected):
    trainer, run, _ = runs[corrected]
    steps = kldiag.analyze(run).steps.to_pandas().set_index("step")
    for name in ("k3_mean", "k3_is_mean", "weight_k3_abs_max", "weight_k3_is_abs_max", "flagged_frac",
                 "blame_share", "rho_max", "nonfinite_count"):
        for step, value in logged(trainer, kt.METRIC_PREFIX + name).items():
            expected = steps.loc[step, name]
            if name == "blame_share" and steps.loc[step, "weight_k3_abs_max"] == 0:
                expected = 0.0  # no weight at all: the table says NaN, logs get 0 (JSON loggers reject NaN)
            assert value == pytest.approx(expected, rel=1e-6, abs=1e-12), (name, step)


def test_on_policy_batches_have_null_logp_old(tiny_model_dir, tmp_path):
    trainer, run, _ = train_attached(tiny_model_dir, tmp_path, num_iterations=1, max_steps=2)
    t = kldiag.open_run(run).read().to_pandas()
    assert t["logp_old"].isna().all() and (t["iteration"] == 0).all()
    mine = recorded_trainer_kl(run)
    for step, value in logged(trainer, "kl").items():
        assert mine[step] == pytest.approx(value, rel=1e-5, abs=1e-9)


def test_reuse_within_one_optimizer_step(tiny_model_dir, tmp_path):
    # steps_per_generation=1 < gradient_accumulation_steps: both passes over a batch share a step.
    trainer, run, _ = train_attached(tiny_model_dir, tmp_path, steps_per_generation=1, max_steps=2)
    t = kldiag.open_run(run).read().to_pandas()
    per_micro = t.groupby(["step", "micro"]).agg(iteration=("iteration", "first"), seqs=("seq", frozenset))
    for step in (1, 2):
        assert list(per_micro.loc[step, "iteration"]) == [0, 1]
        assert per_micro.loc[(step, 0), "seqs"] == per_micro.loc[(step, 1), "seqs"]
    assert t["logp_old"].isna().all()  # no optimizer step between the passes: TRL reuses logp
    mine = recorded_trainer_kl(run)
    for step, value in logged(trainer, "kl").items():
        assert mine[step] == pytest.approx(value, rel=1e-5, abs=1e-9)


class SubclassedGRPOTrainer(trl.GRPOTrainer):
    """A user subclass overriding the methods the hook wraps (and still calling them)."""

    calls = 0

    def _compute_loss(self, model, inputs):
        type(self).calls += 1
        return super()._compute_loss(model, inputs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, *args, **kwargs):
        return super()._get_per_token_logps_and_entropies(model, input_ids, *args, **kwargs)


class LogsSeenByCallbacks(TrainerCallback):
    """What W&B/TensorBoard callbacks receive: the dict passed to on_log."""

    def __init__(self):
        self.logs = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def test_user_subclass_is_recorded(tiny_model_dir, tmp_path):
    seen = LogsSeenByCallbacks()
    trainer = make_trainer(tiny_model_dir, tmp_path / "out", SubclassedGRPOTrainer, max_steps=2)
    trainer.add_callback(seen)
    run = tmp_path / "run"
    kt.attach(trainer, run)
    trainer.train()
    assert [any(k.startswith("kldiag/") for k in logs) for logs in seen.logs] == [True, True, False]
    assert SubclassedGRPOTrainer.calls == 4
    mine = recorded_trainer_kl(run)
    trl_kl = logged(trainer, "kl")
    assert sorted(mine) == sorted(trl_kl) == [1, 2]
    for step, value in trl_kl.items():
        assert mine[step] == pytest.approx(value, rel=1e-5, abs=1e-9)


def test_attaching_does_not_change_training(tiny_model_dir, tmp_path):
    plain = make_trainer(tiny_model_dir, tmp_path / "plain", max_steps=2)
    plain.train()
    attached, _, _ = train_attached(tiny_model_dir, tmp_path, max_steps=2)
    for key in ("loss", "kl", "reward", "grad_norm"):
        assert logged(attached, key) == logged(plain, key), key


def test_unsupported_trl_version_fails_at_attach(tiny_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path / "out")
    monkeypatch.setattr(trl, "__version__", "1.14.3")
    with pytest.raises(IntegrationError, match=r"trl>=1\.15,<1\.17"):
        kt.attach(trainer, tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_missing_private_method_fails_at_attach(tiny_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path / "out")
    monkeypatch.delattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies")
    with pytest.raises(IntegrationError, match=r"_get_per_token_logps_and_entropies.*trl>=1\.15,<1\.17"):
        kt.attach(trainer, tmp_path / "run")


def test_changed_signature_fails_at_attach(tiny_model_dir, tmp_path, monkeypatch):
    trainer = make_trainer(tiny_model_dir, tmp_path / "out")
    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", lambda self, batch: None)
    with pytest.raises(IntegrationError, match=r"_compute_loss.*\['model', 'inputs'\]"):
        kt.attach(trainer, tmp_path / "run")


def test_attach_twice_and_wrong_trainer(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path / "out")
    rec = kt.attach(trainer, tmp_path / "run")
    with pytest.raises(IntegrationError, match="already attached"):
        kt.attach(trainer, tmp_path / "run2")
    rec.close()
    with pytest.raises(IntegrationError, match="GRPOTrainer"):
        kt.attach(object(), tmp_path / "run3")


def test_recording_failure_warns_and_training_goes_on(tiny_model_dir, tmp_path):
    trainer = make_trainer(tiny_model_dir, tmp_path / "out", max_steps=2)
    rec = kt.attach(trainer, tmp_path / "run")

    def broken(**kwargs):
        raise OSError("disk full")

    rec.record = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    assert trainer.state.global_step == 2
    assert sum("recording failed" in str(w.message) for w in caught) == 1
    assert trainer._kldiag_hook.failures == 4


def test_batch_partials_and_log_metrics_flag_blowups():
    logp = np.array([[-1.0, -12.0, -2.0]])
    ref = np.array([[-1.0, -1.0, -2.0]])  # token 1: pi_theta e^11 below pi_ref
    old = np.array([[-1.0, -12.0, -2.5]])
    mask = np.array([[True, True, False]])
    p = kt.batch_partials(logp, ref, old, mask)
    assert p["tokens"] == 2 and p["flagged"] == 1
    assert p["weight_k3_abs_max"] == pytest.approx(math.expm1(11.0))
    m = kt.log_metrics(kt.merge_partials(p, kt.batch_partials(logp, ref, None, mask)), has_ref=True)
    assert m["kldiag/flagged_frac"] == pytest.approx(0.5)
    assert m["kldiag/blame_share"] == pytest.approx(1.0)
    assert m["kldiag/k3_mean"] == pytest.approx(E.k3(-12.0, -1.0) / 2)
    nan = kt.batch_partials(np.array([[np.nan, -1.0]]), np.array([[-1.0, -1.0]]), None, np.ones((1, 2), bool))
    assert nan["nonfinite"] == 1 and math.isfinite(nan["k3_sum"])
    assert set(kt.log_metrics(nan, has_ref=False)) == {"kldiag/rho_max", "kldiag/nonfinite_count"}
