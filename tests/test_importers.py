"""`kldiag import`: slime, NeMo-RL and prime-rl dumps built as their writers build them
(tests/importer_fixtures.py), imported, analysed, and checked against numpy."""

from __future__ import annotations

import warnings

import importer_fixtures as fx
import numpy as np
import pytest
import torch

import kldiag
from kldiag.cli import main
from kldiag.errors import DumpError, UnsupportedDumpVersionError
from kldiag.importers import import_dumps


def k3(s, r):
    d = np.asarray(r, np.float64) - np.asarray(s, np.float64)
    return np.exp(d) - d - 1


def steps_of(run):
    return {r["step"]: r for r in kldiag.analyze(run).steps.to_pylist()}


# ---- slime ------------------------------------------------------------------------------

def test_slime_import_matches_numpy(tmp_path):
    truth = fx.write_slime(tmp_path / "dump", [1, 2, 3], dp_size=2)
    run = tmp_path / "run"
    res = import_dumps("slime", tmp_path / "dump", run)
    assert res.imported == ["train_data/1.pt", "train_data/2.pt", "train_data/3.pt"] and res.skipped == []
    assert "logp_old" in res.missing and "logp_ref" not in res.missing
    steps = steps_of(run)
    assert sorted(steps) == [1, 2, 3]
    for rid, samples in truth.items():
        m = [x["mask"] != 0 for x in samples]
        want_k3 = np.concatenate([k3(x["logp"], x["ref"])[mk] for x, mk in zip(samples, m, strict=True)])
        o_m = np.concatenate([(x["logp"].astype(np.float64) - x["sampler"])[mk] for x, mk in zip(samples, m,
                                                                                                 strict=True)])
        row = steps[rid]
        assert row["tokens"] == sum(int(mk.sum()) for mk in m)
        assert row["sequences"] == len(samples)
        assert row["k3_mean"] == pytest.approx(want_k3.mean(), rel=1e-5)
        assert row["mismatch_kl"] == pytest.approx((np.exp(o_m) - o_m - 1).mean(), rel=1e-4)
    t = kldiag.open_run(run).read().to_pandas()
    assert sorted(t["rank"].unique()) == [0, 1]  # the data-parallel ranks that trained the samples
    one = t[(t.step == 2) & (t.seq == (2 << 32) + 3)].sort_values("pos")
    assert (one["rank"] == 1).all() and (one["group"] == 201).all()  # group_index of the rollout dump
    x = truth[2][3]
    np.testing.assert_array_equal(one["token_id"], x["tokens"][-x["resp"]:])
    np.testing.assert_allclose(one["logp_ref"], x["ref"])
    np.testing.assert_array_equal(one["mask"], x["mask"] != 0)
    assert kldiag.open_run(run).manifest.trainer["name"] == "slime"


def test_slime_kl_options_reach_the_manifest_and_trainer_kl(tmp_path, capsys):
    truth = fx.write_slime(tmp_path / "dump", [1, 2])
    run = tmp_path / "run"
    assert main(["import", "slime", str(tmp_path / "dump"), str(run), "--kl-loss-type", "low_var_kl",
                 "--use-unbiased-kl", "--kl-loss-coef", "0.01"]) == 0
    cfg = kldiag.open_run(run).manifest.config
    assert (cfg["kl_semantics"], cfg["estimator"], cfg["beta"]) == ("slime", "k3_is", 0.01)
    a = kldiag.analyze(run, kldiag.AnalysisConfig(trainer_compatible=True))
    for row in a.trainer_kl.to_pylist():  # no logp_old in a dump: rho = 1, low_var_kl clamped at 10
        means = [np.minimum(k3(x["logp"], x["ref"]), 10)[x["mask"] != 0].mean() for x in truth[row["step"]]]
        assert row["kl"] == pytest.approx(np.mean(means), rel=1e-6)


def test_reimport_adds_only_new_files(tmp_path):
    fx.write_slime(tmp_path / "dump", [1, 2])
    run = tmp_path / "run"
    import_dumps("slime", tmp_path / "dump", run)
    rows = kldiag.open_run(run).read().num_rows
    again = import_dumps("slime", tmp_path / "dump", run)
    assert again.imported == [] and again.already == ["train_data/1.pt", "train_data/2.pt"]
    assert kldiag.open_run(run).read().num_rows == rows
    fx.write_slime(tmp_path / "dump", [3], seed=5, dp_size=3)  # the job came back with 3 DP ranks
    third = import_dumps("slime", tmp_path / "dump", run)
    assert third.imported == ["train_data/3.pt"] and third.steps == [3]
    table = kldiag.open_run(run).read()
    assert table.num_rows > rows and sorted(set(table.column("step").to_pylist())) == [1, 2, 3]
    assert sorted(steps_of(run)) == [1, 2, 3]  # nothing superseded by the second attempt
    assert set(table.column("rank").to_pylist()) == {0, 1, 2}
    assert kldiag.open_run(run).manifest.world_size == 3
    source = kldiag.open_run(run).manifest.config["import"]
    assert source["framework"] == "slime" and source["source"] == str((tmp_path / "dump").resolve())


def test_slime_corrupt_and_foreign_files_are_named(tmp_path):
    fx.write_slime(tmp_path / "dump", [1, 2], with_rollout=False)
    bad = tmp_path / "dump" / "train_data" / "2.pt"
    bad.write_bytes(bad.read_bytes()[:100])
    (tmp_path / "dump" / "train_data" / "notes.pt").write_text("not a dump")
    run = tmp_path / "run"
    with pytest.warns(RuntimeWarning) as caught:
        res = import_dumps("slime", tmp_path / "dump", run)
    assert ["2.pt" in str(w.message) for w in caught] == [True, False]
    assert res.imported == ["train_data/1.pt"]
    assert [n for n, _ in res.skipped] == ["train_data/2.pt", "train_data/notes.pt"]
    with pytest.raises(DumpError, match="2.pt"):
        import_dumps("slime", tmp_path / "dump", tmp_path / "strict", strict=True)
    assert main(["import", "slime", str(tmp_path / "dump"), str(tmp_path / "strict2"), "--strict"]) == 2


def test_slime_unknown_version_and_pickle_guard(tmp_path, capsys):
    d = tmp_path / "dump"
    d.mkdir()
    torch.save({"format_version": 7, "rollout_id": 0, "samples": []}, d / "0.pt")
    with pytest.raises(UnsupportedDumpVersionError, match="format_version 7"):
        import_dumps("slime", d, tmp_path / "run")
    assert main(["import", "slime", str(d), str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "format_version 7" in err[0]
    (d / "0.pt").unlink()
    payload = fx._build_dump_payload(fx.slime_rollout_data(np.random.default_rng(0), 0, 1, 2, 1)[0],
                                     rollout_id=0, writer_rank=0)
    payload["samples"][0]["extra"] = fx.Opaque(3)  # an object weights_only=True refuses
    torch.save(payload, d / "0.pt")
    with pytest.raises(DumpError, match="--trust-pickle"):
        import_dumps("slime", d, tmp_path / "run2")
    res = import_dumps("slime", d, tmp_path / "run2", trust_pickle=True)
    assert res.imported == ["0.pt"] and res.sequences == 2


def test_empty_and_missing_sources(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for fw in ("slime", "nemo-rl", "prime-rl"):
        with pytest.raises(DumpError, match="holds no"):
            import_dumps(fw, tmp_path / "empty", tmp_path / "run")
    assert main(["import", "nemo-rl", str(tmp_path / "nowhere"), str(tmp_path / "run")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- NeMo-RL ----------------------------------------------------------------------------

def test_nemo_rl_import_and_missing_reference(tmp_path, capsys):
    truth = fx.write_nemo(tmp_path / "logs", [1, 2], group=2)
    run = tmp_path / "run"
    assert main(["import", "nemo-rl", str(tmp_path / "logs"), str(run), "--group-size", "2"]) == 0
    assert "imported 2 nemo-rl file(s)" in capsys.readouterr().out
    steps = steps_of(run)
    for step, rows in truth.items():
        m = [x["loss"][x["p"]:].astype(bool) & (x["sample_mask"] != 0) for x in rows]
        z = np.concatenate([(x["prev"][x["p"]:].astype(np.float64) - x["gen"][x["p"]:])[mk]
                            for x, mk in zip(rows, m, strict=True)])
        assert steps[step]["tokens"] == sum(int(mk.sum()) for mk in m)
        assert steps[step]["mismatch_kl"] == pytest.approx((np.exp(z) - z - 1).mean(), rel=1e-4)
        assert steps[step]["k3_mean"] is None
    t = kldiag.open_run(run).read().to_pandas()
    assert set(t[t.seq == (1 << 32) + 3]["group"]) == {1}
    assert not t[t.seq == (1 << 32) + 1]["mask"].any()  # sample_loss_mask 0: stored, out of the loss
    assert main(["analyze", str(run)]) == 0
    out = capsys.readouterr().out
    assert "cannot compute the KL estimators" in out and "no logp_ref in this run (the nemo-rl dumps" in out


def test_nemo_rl_skipped_prev_logprobs_and_truncated_file(tmp_path):
    truth = fx.write_nemo(tmp_path / "logs", [1], skip_prev=True)
    fx.write_nemo(tmp_path / "logs", [2])
    f2 = tmp_path / "logs" / "train_data_step2.jsonl"
    f2.write_bytes(f2.read_bytes()[:-40])
    with pytest.warns(RuntimeWarning, match="train_data_step2.jsonl"):
        res = import_dumps("nemo-rl", tmp_path / "logs", tmp_path / "run")
    assert res.imported == ["train_data_step1.jsonl"]
    t = kldiag.open_run(tmp_path / "run").read().to_pandas()
    x = truth[1][0]
    one = t[t.seq == (1 << 32)].sort_values("pos")
    np.testing.assert_allclose(one["logp"], x["gen"][x["p"]:])  # prev_logprobs were zeros: never computed
    assert one["logp_sampler"].isna().all()


# ---- prime-rl ---------------------------------------------------------------------------

def test_prime_rl_import_stable_marker_and_mismatch(tmp_path):
    truth = fx.write_prime(tmp_path / "out", [0, 1])
    fx.write_prime(tmp_path / "out", [2], stable=False, seed=3)
    run = tmp_path / "run"
    res = import_dumps("prime-rl", tmp_path / "out", run)
    assert len(res.imported) == 4 and len(res.pending) == 2 and res.steps == [0, 1]
    steps = steps_of(run)
    for step in (0, 1):
        rows = [x for r in range(2) for x in truth[(step, r)]]
        m = [x["loss"][x["p"]:] for x in rows]
        own = np.concatenate([x["mismatch"][x["p"]:][mk] for x, mk in zip(rows, m, strict=True)])
        assert steps[step]["tokens"] == sum(int(mk.sum()) for mk in m)
        assert steps[step]["mismatch_kl"] == pytest.approx(own.mean(), rel=1e-4)  # prime-rl's own column
    t = kldiag.open_run(run).read().to_pandas()
    assert sorted(t["rank"].unique()) == [0, 1] and t["group"].isna().all()
    tasks = kldiag.open_run(run).read(columns=["task", "policy_version"]).to_pandas()
    assert set(tasks["task"]) == {"math"} and tasks["policy_version"].isna().all()  # env_name; no version
    (tmp_path / "out" / "token_exports" / "step_2" / "STABLE").touch()
    later = import_dumps("prime-rl", tmp_path / "out", run)
    assert later.steps == [2] and len(later.already) == 4
    assert sorted(steps_of(run)) == [0, 1, 2]


def test_prime_rl_unknown_schema_version(tmp_path):
    fx.write_prime(tmp_path / "out", [0], ranks=1)
    f = tmp_path / "out" / "token_exports" / "step_0" / "rank_0.jsonl"
    f.write_text(f.read_text().replace('"schema_version":1', '"schema_version":9'))
    with pytest.raises(UnsupportedDumpVersionError, match="schema_version 9"):
        import_dumps("prime-rl", tmp_path / "out", tmp_path / "run")


def test_importer_memory_is_chunked(tmp_path, monkeypatch):
    """The sink records a micro-batch every CHUNK_SEQUENCES sequences: a file is never held whole."""
    from kldiag.importers import sink as _sink

    monkeypatch.setattr(_sink, "CHUNK_SEQUENCES", 2)
    calls = []
    real = _sink.Recorder.record
    monkeypatch.setattr(_sink.Recorder, "record", lambda self, **kw: (calls.append(len(kw["seq_ids"])),
                                                                     real(self, **kw))[1])
    fx.write_nemo(tmp_path / "logs", [1], n_prompts=3, group=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import_dumps("nemo-rl", tmp_path / "logs", tmp_path / "run")
    assert calls == [2, 2, 2] and kldiag.open_run(tmp_path / "run").read().num_rows > 0


def test_refuses_a_run_of_another_source(tmp_path):
    fx.write_nemo(tmp_path / "a", [1])
    fx.write_nemo(tmp_path / "b", [1])
    import_dumps("nemo-rl", tmp_path / "a", tmp_path / "run")
    with pytest.raises(DumpError, match="new run directory"):
        import_dumps("nemo-rl", tmp_path / "b", tmp_path / "run")
    with kldiag.Recorder(tmp_path / "recorded") as rec:
        rec.record(step=0, logp=np.full((1, 2), -1.0, np.float32))
    with pytest.raises(DumpError, match="did not make"):
        import_dumps("nemo-rl", tmp_path / "a", tmp_path / "recorded")



def test_import_into_an_s3_run_equals_local(s3, tmp_path, monkeypatch):
    """RUN may be a URI: the recorder writes it (one PUT per part); re-import reads the manifest there."""
    monkeypatch.setenv("KLDIAG_CACHE_DIR", str(tmp_path / "cache"))
    fx.write_prime(tmp_path / "out", [0, 1])
    uri = f"s3://{s3.bucket()}/imported"
    assert main(["import", "prime-rl", str(tmp_path / "out"), uri]) == 0
    import_dumps("prime-rl", tmp_path / "out", tmp_path / "local")
    assert kldiag.analyze(uri).steps.equals(kldiag.analyze(tmp_path / "local").steps)
    again = import_dumps("prime-rl", tmp_path / "out", uri)
    assert again.imported == [] and len(again.already) == 4


NEMO_CONFIG = """\
grpo:
  num_prompts_per_step: 3
  num_generations_per_prompt: 2
loss_fn:
  reference_policy_kl_type: k2
  force_on_policy_ratio: false
policy:
  train_global_batch_size: 2
  generation:
    temperature: 0.9
    top_p: 1.0
    top_k: null
    val_temperature: ${.temperature}
"""


def test_nemo_rl_run_config_reaches_the_manifest_and_the_crosswalk(tmp_path):
    """--config: the run's YAML gives the group size, the KL type and the global batches per step
    (3 per step here: 6 samples, 2 per global batch), which the crosswalk's NeMo-RL reduction reads."""
    from kldiag.crosswalk import parse_settings

    fx.write_nemo(tmp_path / "logs", [1, 2], n_prompts=3, group=2)
    (tmp_path / "grpo.yaml").write_text(NEMO_CONFIG)
    run = tmp_path / "run"
    assert main(["import", "nemo-rl", str(tmp_path / "logs"), str(run), "--config", str(tmp_path / "grpo.yaml")]) == 0
    cfg = kldiag.open_run(run).manifest.config
    assert cfg["group_size"] == 2 and cfg["train_global_batch_size"] == 2 and cfg["num_prompts_per_step"] == 3
    assert cfg["engine_sampling"]["temperature"] == 0.9
    s = parse_settings("nemo-rl", None, kldiag.open_run(run).manifest)
    assert (s.train_global_batch_size, s.num_generations_per_prompt, s.reference_policy_kl_type) == (2, 2, "k2")
    table = kldiag.crosswalk(run, "nemo-rl")
    assert table.num_rows == 2 and table.column("token_mult_prob_error").null_count == 0


def test_import_config_is_refused_for_other_frameworks(tmp_path, capsys):
    (tmp_path / "c.yaml").write_text(NEMO_CONFIG)
    fx.write_slime(tmp_path / "dump", [0])
    assert main(["import", "slime", str(tmp_path / "dump"), str(tmp_path / "run"), "--config",
                 str(tmp_path / "c.yaml")]) == 2
    assert "nemo-rl imports only" in capsys.readouterr().err


def test_prime_rl_weight_version_segments_map_per_token(tmp_path):
    """A row carrying the engine's `[[version, output_offset], ...]` segments gets policy_version per completion
    token; malformed segments are left out."""
    from kldiag.importers import prime_rl

    assert prime_rl.segment_versions([[4, 0], [5, 3]], 5).tolist() == [4, 4, 4, 5, 5]
    assert prime_rl.segment_versions([[4, 1]], 5) is None and prime_rl.segment_versions([[4, 0], [5, 5]], 5) is None
    assert prime_rl.segment_versions(None, 5) is None
    row = {"schema_version": 1, "step": 7, "rank": 0, "token_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 0] + [1] * 4,
           "trainer_logprobs": [-1.0] * 6, "inference_logprobs": [-1.1] * 6, "weight_versions": [[5, 0], [6, 2]]}
    s = prime_rl.to_sequence(row, 1)
    assert s.policy_version.tolist() == [5, 5, 6, 6]
    with kldiag.Recorder(tmp_path / "r") as rec:
        from kldiag.importers.sink import pack

        args = pack([s, prime_rl.to_sequence({**row, "weight_versions": [[6, 0]]}, 2)])
        assert args["policy_version"].shape == (2, 4)
        rec.record(step=7, **{("advantages" if k == "advantage" else k): v for k, v in args.items()})
    t = kldiag.open_run(tmp_path / "r").read(columns=["seq", "pos", "policy_version"]).to_pandas()
    got = t.sort_values(["seq", "pos"]).groupby("seq")["policy_version"].apply(list).tolist()
    assert sorted(got) == [[5, 5, 6, 6], [6, 6, 6, 6]]


def test_miles_weight_version_segments_map_per_token():
    """Miles' `response_weight_version_segments` ([start, end, version] per generate call) per response token,
    shifted by one as slime's weight_versions; a multi-turn sample's tool tokens take the version before them."""
    from kldiag.importers import slime as dump

    one = dump.segment_versions([[[0, 2, 10], [2, 4, 11]]], 4, None)
    assert one.tolist() == [9, 9, 10, 10]
    mask = np.array([1, 1, 0, 0, 1, 1], bool)  # two calls of 2 tokens with 2 tool tokens between them
    assert dump.segment_versions([[[0, 2, 5]], [[0, 1, 5], [1, 2, 6]]], 6, mask).tolist() == [4, 4, 4, 4, 4, 5]
    assert dump.segment_versions([[[0, 3, 5]]], 4, None) is None and dump.segment_versions([], 4, None) is None
    sample = {"response_lengths": 4, "log_probs": [-0.1] * 4, "loss_masks": [1] * 4, "weight_versions": ["10"],
              "response_weight_version_segments": [[[0, 2, 10], [2, 4, 11]]]}
    assert dump.to_sequence(sample, 9, 0, None, None).policy_version.tolist() == [9, 9, 10, 10]
    sample.pop("response_weight_version_segments")
    assert dump.to_sequence(sample, 9, 0, None, None).policy_version == 9  # per sample from weight_versions
