"""The demo: its training maths, its determinism, and the blow-up it exists to show."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import kldiag
from kldiag import estimators as E
from kldiag.cli import main
from kldiag.errors import KldiagError
from kldiag.tools import demo
from kldiag.tools import demo_train as T

SHORT_STEPS = 100  # the K3 run's weights first pass 100 near step 40 with the default seed


def test_kl_losses_have_the_gradient_weights_of_kldiag_estimators():
    rng = np.random.default_rng(0)
    logp = torch.tensor(-rng.uniform(0.01, 12, 64), dtype=torch.float64, requires_grad=True)
    logp_ref = torch.tensor(-rng.uniform(0.01, 12, 64), dtype=torch.float64)
    logp_old = torch.tensor(-rng.uniform(0.01, 12, 64), dtype=torch.float64)
    for name in ("k3", "k3_is"):
        (grad,) = torch.autograd.grad(T.kl_loss(name, logp, logp_ref, logp_old).sum(), logp)
        args = (logp.detach().numpy(), logp_ref.numpy(), logp_old.numpy())
        np.testing.assert_allclose(grad.numpy(), E.weight(name, *args), rtol=1e-10)
        np.testing.assert_allclose(T.kl_loss(name, logp, logp_ref, logp_old).detach().numpy(),
                                   E.value(name, *args), rtol=1e-10)
    with pytest.raises(ValueError, match="k3_is"):
        T.kl_loss("k2", logp, logp_ref, logp_old)


def test_group_advantages_and_ppo_clip():
    adv = T.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0]), 4)
    unbiased_std = np.sqrt(1 / 3)
    np.testing.assert_allclose(adv[:4].numpy(), np.array([1, -1, 1, -1]) * 0.5 / unbiased_std, rtol=1e-3)
    assert torch.all(adv[4:] == 0)
    logp_old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_()
    loss = T.ppo_surrogate(logp, logp_old, torch.tensor([1.0]), (0.2, 0.2))
    np.testing.assert_allclose(loss.detach().numpy(), [[-1.2, -0.5]], rtol=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), logp)
    assert grad[0, 0] == 0  # clipped: no gradient beyond 1 + eps for a positive advantage


def test_training_is_deterministic_and_records_every_column():
    cfg = T.DemoConfig(steps=6)
    seen: list[dict] = []
    first = T.train(cfg, record=lambda **kw: seen.append(kw))
    second = T.train(cfg)
    assert [dataclasses.astuple(s) for s in first.history] == [dataclasses.astuple(s) for s in second.history]
    batch = cfg.prompts_per_step * cfg.group_size
    rec = seen[-1]
    assert rec["step"] == 5 and rec["logp"].shape == (batch, cfg.length)
    for name in ("logp_old", "logp_ref", "logp_sampler", "mask", "token_ids"):
        assert rec[name].shape == (batch, cfg.length)
    assert rec["seq_ids"].unique().numel() == batch and rec["group_ids"].unique().numel() == cfg.prompts_per_step
    assert int(rec["token_ids"].min()) >= T.N_PROMPT  # completions never emit prompt tokens
    # the sampler is hotter and stale: its log-probs differ from the trainer's recompute
    assert not torch.allclose(rec["logp_sampler"], rec["logp_old"])


def test_vocab_override_is_checked():
    with pytest.raises(ValueError, match="pieces"):
        T.vocab(T.DemoConfig(pieces=("a", "b")))
    assert T.vocab()[T.N_PROMPT + T.FILLER_IDS[0]] == T.FILLERS[0]


def test_demo_refuses_to_replace_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "demo_k3").mkdir()
    (tmp_path / "demo_k3" / "thesis.tex").write_text("precious")
    with pytest.raises(KldiagError, match="not a kldiag demo run"):
        demo.run_pair(tmp_path, steps=2)
    assert (tmp_path / "demo_k3" / "thesis.tex").exists()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return out, demo.run_pair(out, steps=SHORT_STEPS)


@pytest.fixture(scope="module")
def pair(trained):
    return trained[0]


def test_k3_run_blows_up_and_its_corrected_twin_does_not(pair):
    k3, k3_is = kldiag.analyze(pair / "demo_k3"), kldiag.analyze(pair / "demo_k3_is")
    assert k3.manifest.config["estimator"] == "k3" and k3_is.manifest.config["estimator"] == "k3_is"
    w_k3 = np.asarray(k3.steps.column("weight_k3_abs_max").to_numpy(zero_copy_only=False), dtype=float)
    p99_k3 = np.asarray(k3.steps.column("weight_k3_abs_p99").to_numpy(zero_copy_only=False), dtype=float)
    w_is = np.asarray(k3_is.steps.column("weight_k3_is_abs_max").to_numpy(zero_copy_only=False), dtype=float)
    # K3's weights blow up: far above the rest of the run's tokens and above 100x a typical token
    assert np.nanmax(w_k3) > 100 and np.nanmax(w_k3) > 10 * np.nanmedian(p99_k3)
    # the corrected run's own loss weights stay an order of magnitude lower
    assert np.nanmax(w_is) < np.nanmax(w_k3) / 5
    flags = k3.flags.to_pydict()
    worst = int(np.argmax(np.abs(flags["weight_k3"])))
    assert flags["piece"][worst] in T.FILLERS  # the punished tokens the reference likes
    assert flags["weight_blowup"][worst] and flags["theta_ll_ref"][worst]


def test_demo_trains_the_pair_from_one_seed_and_the_corrected_run_learns_more(trained):
    pair, (k3, k3_is) = trained
    # K3 keeps pulling the punished tokens back up (towards pi_ref); k3_is lets them go
    assert k3_is.final_p_punished < k3.final_p_punished / 10
    assert k3_is.final_reward > k3.final_reward
    summaries = {}
    for est in demo.ESTIMATORS:
        run = kldiag.open_run(pair / demo.run_dir_name(est))
        assert run.manifest.config["seed"] == 0 and run.manifest.config["steps"] == SHORT_STEPS
        t = run.read(["step", "token_id"])
        assert t.num_rows == SHORT_STEPS * 64 * 8
        summaries[est] = t
    # same seed: the first step (before any update differs) samples the same tokens
    first = [s.filter(np.asarray(s.column("step")) == 0).column("token_id").to_pylist() for s in summaries.values()]
    assert first[0] == first[1]


def test_demo_command_prints_both_runs_and_writes_their_reports(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path), "--steps", "3", "--no-dashboard", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "demo_k3 " in out and "demo_k3_is" in out and "max |k3 weight|" in out and "verdict:" in out
    assert (tmp_path / "demo_k3.report.html").is_file() and (tmp_path / "demo_k3_is.report.html").is_file()


def test_sample_logs_readme_states_what_the_analysis_finds():
    """sample_logs/README.md's table of the committed demo pair: its maxima and verdicts, read from the runs."""
    import re

    import numpy as np

    from kldiag.analysis.pipeline import analyze
    from kldiag.analysis.types import AnalysisConfig
    from kldiag.diagnosis import diagnose
    from kldiag.diagnosis.core import reducers

    root = Path(__file__).resolve().parents[1] / "sample_logs"
    text = (root / "README.md").read_text()
    for name in ("demo_k3", "demo_k3_is"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        a = analyze(root / name, AnalysisConfig(use_cache=False), reducers())
        dg = diagnose(a)
        w = np.asarray(a.steps.column("weight_k3_abs_max").to_numpy(zero_copy_only=False), float)
        wi = np.asarray(a.steps.column("weight_k3_is_abs_max").to_numpy(zero_copy_only=False), float)
        assert cells[2].split()[0] == f"{w.max():.0f}" and cells[3] == f"{wi.max():.0f}"
        verdict = cells[-1]
        assert verdict.startswith(dg.verdict), (verdict, dg.verdict)
        for c in dg.causes:
            assert c.cause in verdict, (c.cause, verdict)
            m = re.search(rf"{c.cause} from step (\d+)", verdict)
            assert m is None or int(m.group(1)) == c.onset
