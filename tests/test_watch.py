"""`kldiag watch`: driven in a pseudo-terminal against a run that grows while it watches."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import numpy as np
import pytest

from kldiag.cli import main
from kldiag.live.watch import Watcher
from kldiag.tools.synth import SynthConfig, make_run

SMALL = {"seqs_per_step": 8, "seq_len": (8, 24), "vocab_size": 0}
HEALTHY = SynthConfig(steps=60, **SMALL)
BLOWN = SynthConfig(steps=60, blowup_step=0, blowup_frac=0.1, **SMALL)


class Terminal:
    """A child process on a pseudo-terminal; read() collects what it printed so far."""

    def __init__(self, argv: list[str]):
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
        os.close(slave)
        self.master, self.text = master, ""

    def read_until(self, pattern: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.text):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{pattern!r} not printed within {timeout}s; got:\n{self.text}")
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                try:
                    self.text += os.read(self.master, 65536).decode(errors="replace")
                except OSError:  # the child exited and closed the terminal
                    if self.proc.poll() is not None and not re.search(pattern, self.text):
                        msg = f"exited {self.proc.returncode} before {pattern!r}:\n{self.text}"
                        raise AssertionError(msg) from None
        return self.text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


def test_watch_follows_a_growing_run_in_a_pty(tmp_path):
    run = tmp_path / "run"
    term = Terminal([sys.executable, "-m", "kldiag", "watch", str(run), "--interval", "0.2", "--fail-on", "blowup"])
    try:
        term.read_until(r"waiting: no run yet")  # started before the trainer: it waits
        make_run(run, HEALTHY, steps=range(0, 10))
        term.read_until(r"step 9 +tokens [\d,]+ .*\(1 part\(s\)\)")  # the first look: no "new"
        term.read_until(r"verdict: HEALTHY")
        make_run(run, HEALTHY, steps=range(10, 20), manifest=False)
        term.read_until(r"step 19 .*\(1 new part\(s\)\)")  # incremental: only the new part was read
        make_run(run, BLOWN, steps=range(20, 25), manifest=False)
        # `blowup` names the episode and the cause k3_weight_blowup (as report's --fail-on): the cause, equally
        # critical, is named first
        text = term.read_until(r"failing on k3_weight_blowup \(critical\): .*above 100 from step 20")
        assert re.search(r">> started \[critical\] blowup: from step 20", text)
        assert "verdict: UNSTABLE: k3_weight_blowup from step 20" in text
        assert term.proc.wait(30) == 1
    finally:
        term.close()


def test_watcher_reports_episode_start_and_end(tmp_path):
    make_run(tmp_path, HEALTHY, steps=range(0, 10))
    w = Watcher(str(tmp_path))
    first = w.poll()
    assert first.parts_new == 1 and first.started == [] and first.diagnosis.verdict == "healthy"
    assert w.poll().diagnosis is None  # nothing new: nothing read
    make_run(tmp_path, BLOWN, steps=range(10, 14), manifest=False)
    up = w.poll()
    assert up.parts_new == 1 and [(e.kind, e.start, e.end) for e in up.started if e.kind == "blowup"] == [
        ("blowup", 10, None)]
    make_run(tmp_path, HEALTHY, steps=range(14, 30), manifest=False)
    up = w.poll()
    assert [(e.kind, e.start, e.end) for e in up.ended if e.kind == "blowup"] == [("blowup", 10, 13)]
    assert not [e for e in up.started if e.kind == "blowup"]


def test_watch_once_for_cron(tmp_path, capsys):
    make_run(tmp_path, HEALTHY, steps=range(0, 10))
    assert main(["watch", str(tmp_path), "--once", "--fail-on", "all"]) == 0
    make_run(tmp_path, SynthConfig(steps=12, nonfinite=((10, "logp"),), **SMALL), steps=range(10, 12),
             manifest=False)
    assert main(["watch", str(tmp_path), "--once", "--fail-on", "nonfinite"]) == 1
    assert "failing on numerical_fault (critical)" in capsys.readouterr().err  # the cause `nonfinite` names
    assert main(["watch", str(tmp_path), "--once"]) == 0  # no rule given: look, print, never fail
    assert "verdict" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["watch", str(tmp_path), "--fail-on", "explode"])
    assert e.value.code == 2


def test_watcher_on_an_s3_run_reads_only_new_parts(s3, tmp_path, monkeypatch):
    import kldiag

    monkeypatch.setenv("KLDIAG_CACHE_DIR", str(tmp_path / "cache"))
    uri = f"s3://{s3.bucket()}/runs/w"

    def record(steps, blow=False):
        rng = np.random.default_rng(steps.start)
        with kldiag.Recorder(uri, beta=0.04, estimator="k3", rotate_seconds=None) as rec:
            for step in steps:
                logp = -rng.exponential(0.7, (4, 12)).astype(np.float32)
                ref = logp.copy()
                if blow:  # pi_ref/pi_theta = e^8 on one token: |k3 weight| ~ 3000
                    logp[:, 3], ref[:, 3] = -9.0, -1.0
                rec.record(step=step, logp=logp, logp_ref=ref, logp_old=logp)

    record(range(0, 6))
    w = Watcher(uri)
    first = w.poll()
    assert first.parts_new == 1 and first.diagnosis.verdict == "healthy" and "scan" in first.analysis.reduced
    record(range(6, 9), blow=True)
    up = w.poll()
    assert up.parts_new == 1 and [(e.kind, e.start) for e in up.started if e.kind == "blowup"] == [("blowup", 6)]
    assert up.diagnosis.verdict == "unstable"


def test_fail_on_takes_cause_names_and_names_the_most_severe_first():
    from types import SimpleNamespace

    from kldiag.analysis.rules.episodes import Episode
    from kldiag.cli.watch import failing, parse_fail_on
    from kldiag.diagnosis.types import Cause, Diagnosis

    assert "k3_weight_blowup" in parse_fail_on("k3_weight_blowup") and "early_weight_trend" in parse_fail_on("early")
    assert "latent" in parse_fail_on("latent")
    mismatch = Episode("mismatch", 1, None, 2, 0.02, "warning", "mismatch from step 1")
    broken = Cause("routing_replay_broken", 0, "critical", {}, "fix", summary="replay did not take")
    up = SimpleNamespace(diagnosis=Diagnosis("unstable", [broken], [mismatch]), started=[mismatch])
    w = SimpleNamespace(known={("mismatch", 1): mismatch})
    assert failing(up, w, parse_fail_on("all"), True, set()) == "routing_replay_broken (critical): replay did not take"
    assert failing(up, w, parse_fail_on("mismatch"), True, set()).startswith("mismatch (step 1)")
    assert failing(up, w, parse_fail_on("blowup"), True, set()) == ""


def test_a_restarted_watch_tells_no_past_episode_as_news(tmp_path, capsys):
    make_run(tmp_path, HEALTHY, steps=range(0, 10))
    make_run(tmp_path, BLOWN, steps=range(10, 14), manifest=False)
    make_run(tmp_path, HEALTHY, steps=range(14, 40), manifest=False)  # the blow-up is over
    assert main(["watch", str(tmp_path), "--once"]) == 0
    main(["watch", str(tmp_path), "--once"])  # the cache is warm: the first look still counts the parts
    out = capsys.readouterr().out
    assert ">> started" not in out and "<< ended" not in out
    assert re.search(r"episodes so far: \d+ \(\d+ ended, \d+ ongoing\)", out)
    assert sum("(3 part(s))" in line for line in out.splitlines()) == 2
    assert "(0 new part(s))" not in out
