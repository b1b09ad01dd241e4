"""Alert webhooks (kldiag/live/notify.py): `kldiag watch --notify` and `kldiag.Guard(notify=URL)` against a
local HTTP server (127.0.0.1, started and stopped here) that accepts, fails (5xx) or hangs."""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

import kldiag
from kldiag.cli import main
from kldiag.live.notify import Notifier, NotifyConfig
from kldiag.live.watch import Watcher
from kldiag.tools.synth import SynthConfig, make_run

SMALL = {"seqs_per_step": 8, "seq_len": (8, 24), "vocab_size": 0}
HEALTHY = SynthConfig(steps=60, **SMALL)
BLOWN = SynthConfig(steps=60, blowup_step=0, blowup_frac=0.1, **SMALL)
TOKEN = "T0KEN-kldiag-webhook-secret-77"  # the secret part of the URL: never in a log, an error or a manifest
FAST = NotifyConfig(min_interval_s=0.0, retries=2, backoff_s=0.05, timeout_s=0.5)


@contextmanager
def webhook(mode: str = "ok"):
    """A webhook on 127.0.0.1: `ok` records each JSON body, `fail` answers 500, `hang` never answers
    (until the test ends). Yields (url, received bodies, request count)."""
    received, hits, release = [], [0], threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            hits[0] += 1
            if mode == "hang":
                release.wait(10)
                return
            if mode == "fail":
                self.send_response(500)
                self.end_headers()
                return
            received.append(json.loads(body) | {"_at": time.monotonic()})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args):  # keep the server's own request log off stderr
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/hooks/{TOKEN}", received, hits
    finally:
        release.set()
        server.shutdown()
        server.server_close()


def blown_run(path):
    make_run(path, HEALTHY, steps=range(0, 10))
    make_run(path, BLOWN, steps=range(10, 14), manifest=False)
    return str(path)


def test_watch_notify_posts_each_cause_and_critical_episode_once(tmp_path, capsys, caplog):
    run = tmp_path / "run"
    make_run(run, HEALTHY, steps=range(0, 10))
    with webhook() as (url, received, _):
        caplog.set_level(logging.DEBUG)
        n = Notifier(url, run=str(run), config=FAST)
        w = Watcher(str(run))
        assert n.diagnosis(w.poll().diagnosis) == 0  # healthy: nothing to say
        make_run(run, BLOWN, steps=range(10, 14), manifest=False)
        assert n.diagnosis(w.poll().diagnosis) == 2  # the cause and its critical episode
        make_run(run, BLOWN, steps=range(14, 16), manifest=False)
        assert n.diagnosis(w.poll().diagnosis) == 0  # the same episode goes on: no second message
        assert n.flush(10)
        n.close()
        for m in received:
            m.pop("_at")
        assert sorted((m["kind"], m["cause"]) for m in received) == [("cause", "k3_weight_blowup"),
                                                                     ("episode", "blowup")]
        cause = next(m for m in received if m["kind"] == "cause")
        assert cause["text"].startswith("kldiag [critical] k3_weight_blowup in ") and "from step 10" in cause["text"]
        assert cause["run"] == str(run) and cause["onset"] == 10 and cause["severity"] == "critical"
        assert cause["fix"] and cause["evidence"] and cause["fix"] in cause["text"]
        assert main(["watch", str(run), "--once", "--notify", url]) == 0  # the CLI: a fresh watcher, one look
        assert sorted(m["cause"] for m in received[2:]) == ["blowup", "k3_weight_blowup"]  # one each
        assert TOKEN not in repr(n) and n.sent == 2
    out = capsys.readouterr()
    assert TOKEN not in out.out + out.err + caplog.text
    assert not [p for p in run.rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]  # nor the cache


def test_a_failing_server_is_retried_then_given_up_quietly(caplog):
    caplog.set_level(logging.WARNING, "kldiag.live.notify")
    e = kldiag.diagnosis.Episode("blowup", 5, None, 5, 1e4, "critical", "max |k3 weight| 1e4")
    with webhook("fail") as (url, received, hits):
        n = Notifier(url, run="runs/x", config=FAST)
        t0 = time.perf_counter()
        assert n.episode(e) == 1 and n.episode(e) == 0  # once per episode
        assert time.perf_counter() - t0 < 0.05  # queued: the caller never waits for the server
        assert n.flush(10)
        n.close()
        assert hits[0] == 1 + FAST.retries and not received and n.failed == 1 and n.sent == 0
    assert "not delivered (HTTP 500); given up" in caplog.text and TOKEN not in caplog.text


def test_a_hanging_server_never_blocks_the_guard(tmp_path, caplog, capsys):
    caplog.set_level(logging.DEBUG)
    rng = np.random.default_rng(0)
    with webhook("hang") as (url, _, hits):
        rec = kldiag.Recorder(str(tmp_path / "run"), beta=0.04, estimator="k3", rotate_seconds=None)
        g = kldiag.Guard(on="blowup", action="log", notify=Notifier(url, config=FAST), recorder=rec)
        times = []
        for step in range(12):
            logp = -rng.exponential(0.7, (4, 12)).astype(np.float32)
            ref = logp.copy()
            if step >= 8:  # pi_ref/pi_theta = e^8 on one token: |k3 weight| ~ 3000
                logp[:, 3], ref[:, 3] = -9.0, -1.0
            rec.record(step=step, logp=logp, logp_ref=ref, logp_old=logp)
            g.observe(step, logp, ref, logp)
            t0 = time.perf_counter()
            g.end_step(step)
            times.append(time.perf_counter() - t0)
        assert [(e.kind, e.start) for e in g.fired] == [("blowup", 8)] and "notify" in g.actions
        assert max(times) < 0.5 and g.failed is None  # the webhook hangs; the training step does not
        assert g.notifier.flush(10)  # each try times out after timeout_s, then the message is given up
        assert hits[0] == 1 + FAST.retries and g.notifier.failed == 1
        g.close()
        rec.close()
    err = capsys.readouterr().err
    assert "blowup episode started at step 8" in err
    assert "not delivered (TimeoutError); given up" in caplog.text
    assert TOKEN not in err + caplog.text + repr(g) + repr(vars(g))
    assert not [p for p in (tmp_path / "run").rglob("*") if p.is_file() and TOKEN.encode() in p.read_bytes()]


def test_messages_are_rate_limited():
    with webhook() as (url, received, _):
        n = Notifier(url, run="runs/x", config=NotifyConfig(min_interval_s=0.3))
        for start in (1, 5, 9):
            n.episode(kldiag.diagnosis.Episode("nonfinite", start, None, start, 3.0, "critical", "3 NaN log-probs"))
        assert n.flush(10)
        n.close()
        at = [m["_at"] for m in received]
        assert [m["onset"] for m in received] == [1, 5, 9] and min(np.diff(at)) >= 0.29


def test_bad_urls_are_user_errors_that_never_quote_the_url(tmp_path, capsys, monkeypatch):
    make_run(tmp_path / "run", HEALTHY, steps=range(0, 4))
    assert main(["watch", str(tmp_path / "run"), "--once", "--notify", f"ftp://hooks/{TOKEN}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kldiag: error: the notify URL must start with http") and TOKEN not in err
    monkeypatch.delenv("KLDIAG_TEST_HOOK", raising=False)
    with pytest.raises(ValueError, match="KLDIAG_TEST_HOOK is not set"):
        kldiag.Guard(on="blowup", notify="env:KLDIAG_TEST_HOOK")
    with pytest.raises(ValueError, match="needs notify=URL"):
        kldiag.Guard(on="blowup", action="log,notify")
    g = kldiag.Guard(on="blowup", action="log", notify=f"https://hooks.example/{TOKEN}")  # URL alone: the action
    assert g.actions == ("log", "notify") and TOKEN not in repr(vars(g))
    g.close()
    with webhook() as (url, received, _):
        monkeypatch.setenv("KLDIAG_TEST_HOOK", url)  # env:NAME keeps the URL out of `ps` and shell history
        assert main(["watch", blown_run(tmp_path / "blown"), "--once", "--notify", "env:KLDIAG_TEST_HOOK"]) == 0
        assert {m["cause"] for m in received} >= {"k3_weight_blowup", "blowup"}


def test_a_restarted_watch_sends_only_what_is_new(tmp_path, capsys):
    run = tmp_path / "run"
    make_run(run, HEALTHY, steps=range(0, 10))
    with webhook() as (url, received, hits):
        argv = ["watch", str(run), "--once", "--notify", url]
        assert main(argv) == 0 and hits[0] == 0  # healthy: nothing to say
        make_run(run, BLOWN, steps=range(10, 14), manifest=False)
        assert main(argv) == 0
        assert sorted(m["cause"] for m in received) == ["blowup", "k3_weight_blowup"]
        assert main(argv) == 0 and hits[0] == 2  # a cron's next look: nothing new, nothing sent
        make_run(run, SynthConfig(steps=16, nonfinite=((14, "logp"),), **SMALL), steps=range(14, 16), manifest=False)
        assert main(argv) == 0
        assert sorted(m["cause"] for m in received[2:]) == ["nonfinite", "numerical_fault"]  # only the new ones
    sent = list((run / ".kldiag" / "watch").glob("sent-*.json"))
    assert len(sent) == 1 and TOKEN not in sent[0].name and TOKEN.encode() not in sent[0].read_bytes()
    assert "127.0.0.1" not in sent[0].read_text()  # the destination is a digest, never the URL


def test_an_undelivered_message_is_named_and_sent_by_the_next_look(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "kldiag.live.notify")
    run = blown_run(tmp_path / "run")
    mode = {"fail": True}
    with webhook() as (url, received, hits):
        import kldiag.live.notify as N

        real = N.Notifier._deliver

        def flaky(self, msg):  # the server is down for the first look
            return False if mode["fail"] else real(self, msg)

        N.Notifier._deliver = flaky
        try:
            assert main(["watch", run, "--once", "--notify", url]) == 0
            assert not received
            assert "message for k3_weight_blowup not sent before exit; the next start sends it" in caplog.text
            assert "message for blowup not sent before exit" in caplog.text
            mode["fail"] = False
            assert main(["watch", run, "--once", "--notify", url]) == 0  # the server is back: both go out
            assert sorted(m["cause"] for m in received) == ["blowup", "k3_weight_blowup"]
        finally:
            N.Notifier._deliver = real
        n = Notifier(url, run=run, config=FAST)  # in one process: given up, then retried at the next look
        mode["fail"] = True
        N.Notifier._deliver = flaky
        try:
            dg = Watcher(run).poll().diagnosis
            assert n.diagnosis(dg) == 2 and n.flush(10)
            mode["fail"] = False
            assert n.diagnosis(None) == 2 and n.flush(10)  # the next look, even with nothing new
            assert n.diagnosis(dg) == 0 and n.flush(10)
        finally:
            N.Notifier._deliver = real
        n.close()
        assert len(received) == 4


@pytest.mark.parametrize(("value", "says"), [("http://", "names no host"), ("https:///path", "names no host"),
                                              ("env:", "names no variable")])
def test_notify_values_are_checked_at_start(tmp_path, capsys, value, says):
    make_run(tmp_path / "run", HEALTHY, steps=range(0, 4))
    assert main(["watch", str(tmp_path / "run"), "--once", "--notify", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kldiag: error: ") and says in err and "export =" not in err


def test_the_first_look_sends_no_episode_that_is_already_over(tmp_path):
    run = tmp_path / "run"
    make_run(run, HEALTHY, steps=range(0, 10))
    make_run(run, BLOWN, steps=range(10, 14), manifest=False)
    make_run(run, HEALTHY, steps=range(14, 40), manifest=False)  # the blow-up ended at step 13
    with webhook() as (url, received, _):
        assert main(["watch", str(run), "--once", "--notify", url]) == 0
        assert [(m["kind"], m["cause"]) for m in received] == [("cause", "k3_weight_blowup")]  # the cause, once
        make_run(run, BLOWN, steps=range(40, 43), manifest=False)  # a new episode after the first look: news
        make_run(run, HEALTHY, steps=range(43, 70), manifest=False)  # ... over again by the next look
        assert main(["watch", str(run), "--once", "--notify", url]) == 0
        assert [(m["kind"], m["cause"], m["onset"]) for m in received[1:]] == [("episode", "blowup", 40)]
