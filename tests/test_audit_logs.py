"""kldiag.crosswalk.audit.logs: each trainer log format read back per metric and step, its kind detected
from the path; names matched to crosswalk columns; a source it cannot read fails naming the fix."""

from __future__ import annotations

import json
import math

import pytest

from kldiag.crosswalk.audit.logs import LogsError, detect, match_names, read_logs

KL = {1: 0.5, 2: 0.25, 3: 0.125}


def test_tensorboard_dir(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path / "runs" / "Nov25_host"))
    for step, v in KL.items():
        w.add_scalar("train/kl", v, step)
        w.add_scalar("train/sampling/sampling_logp_difference/mean", v / 10, step)
    w.close()
    logs = read_logs(tmp_path)  # the output dir: events are found below it
    assert logs.kind == "tensorboard"
    assert logs.series["train/kl"] == pytest.approx(KL)
    assert logs.series["train/sampling/sampling_logp_difference/mean"][2] == pytest.approx(0.025)
    one = next(tmp_path.rglob("events.out.tfevents*"))
    assert read_logs(one).series["train/kl"] == pytest.approx(KL)  # an event file: its directory


def _state(path, steps):
    history = [{"kl": KL[s], "loss": 0.1, "step": s} for s in steps]
    history.append({"train_runtime": 3.2, "train_loss": 0.1, "step": steps[-1]})
    path.mkdir(parents=True, exist_ok=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": steps[-1], "log_history": history}))


def test_trainer_state_file_checkpoint_and_output_dir(tmp_path):
    _state(tmp_path / "out" / "checkpoint-2", [1, 2])
    _state(tmp_path / "out" / "checkpoint-10", [1, 2, 3])  # numerically last, not lexically
    assert read_logs(tmp_path / "out" / "checkpoint-2" / "trainer_state.json").series["kl"] == {1: 0.5, 2: 0.25}
    assert read_logs(tmp_path / "out" / "checkpoint-2").kind == "trainer_state"
    logs = read_logs(tmp_path / "out")
    assert logs.path.endswith("checkpoint-10/trainer_state.json") and logs.series["kl"] == KL
    assert logs.series["train_runtime"] == {3: 3.2}


def test_wandb_csv_uses_the_trainer_step(tmp_path):
    p = tmp_path / "history.csv"
    p.write_text("_step,train/global_step,train/kl,eval/loss\n"
                 "0,1,0.5,\n1,2,0.25,\n2,2,,0.9\n3,3,NaN,\n")
    logs = read_logs(p)
    assert logs.kind == "csv"
    assert logs.series["train/kl"][1] == 0.5 and logs.series["train/kl"][2] == 0.25
    assert math.isnan(logs.series["train/kl"][3])  # a logged NaN is kept: it is a finding
    assert logs.series["eval/loss"] == {2: 0.9}
    assert "_step" not in logs.series and "train/global_step" not in logs.series


def test_jsonl_and_json_list(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join(json.dumps({"step": s, "actor/kl_loss": v, "note": "text"}) for s, v in KL.items()))
    logs = read_logs(p)
    assert logs.kind == "jsonl" and logs.series == {"actor/kl_loss": KL}
    q = tmp_path / "metrics.json"
    q.write_text(json.dumps([{"_step": s, "kl": v} for s, v in KL.items()]))
    assert read_logs(q).series == {"kl": KL} and detect(q)[0] == "jsonl"


def test_names_match_columns_stripping_a_prefix_only_on_a_match():
    cols = ["kl", "actor/kl_loss", "rollout_corr/k3_kl"]
    logged = {"train/kl", "actor/kl_loss", "train/actor/kl_loss", "rollout_corr/k3_kl", "train/reward"}
    assert match_names(logged, cols) == {"kl": "train/kl", "actor/kl_loss": "actor/kl_loss",
                                         "rollout_corr/k3_kl": "rollout_corr/k3_kl"}
    assert match_names({"train/loss"}, cols) == {}


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "nope", "no such file"),
    (lambda d: (d / "x.txt").write_text("hi") and d / "x.txt", "unknown log format"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "neither events.out.tfevents"),
    (lambda d: (d / "bad.jsonl").write_text('{"step": 1}\n{oops\n') and d / "bad.jsonl", "bad.jsonl:2: not JSON"),
    (lambda d: (d / "nostep.jsonl").write_text('{"kl": 1.0}\n') and d / "nostep.jsonl",
     "no numeric metric with a step"),
    (lambda d: (d / "trainer_state.json").write_text('{"log_history": 3}') and d / "trainer_state.json",
     "no log_history list"),
], ids=["missing", "unknown_ext", "empty_dir", "bad_jsonl", "no_step", "bad_state"])
def test_bad_sources_name_the_fix(tmp_path, make, message):
    with pytest.raises(LogsError, match=message):
        read_logs(make(tmp_path))


def test_forced_kind(tmp_path):
    p = tmp_path / "log.txt"
    p.write_text(json.dumps({"step": 1, "kl": 0.5}) + "\n")
    assert read_logs(p, kind="jsonl").series == {"kl": {1: 0.5}}
    with pytest.raises(LogsError, match="unknown log kind"):
        read_logs(p, kind="parquet")
