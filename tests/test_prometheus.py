"""`kldiag serve-metrics`: the exporter on growing, missing and damaged runs, scraped by a real Prometheus
(Debian's `prometheus`, installed by `make prometheus`), its alerting rules checked and unit-tested by
`promtool`, and the Grafana dashboard checked against Grafana's dashboard schema.

No Grafana server is packaged for Debian 12 or on PyPI, so the dashboard is validated structurally: the
fields the dashboard kind requires (grafana/grafana docs/sources/developers/kinds/core/dashboard/
schema-reference.md: `schemaVersion`; a panel's `type`, `gridPos` {h, w, x, y}, `fieldConfig`
{defaults, overrides}, `options`, `transformations`; a target's `refId`; a template variable's `name`
and `type`), and every query is run against the real Prometheus below.
"""

from __future__ import annotations

import gc
import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kldiag.analysis.pipeline import analyze
from kldiag.analysis.types import Analysis, AnalysisConfig
from kldiag.cli import main
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers
from kldiag.export.prometheus import STEP_GAUGES, Exporter
from kldiag.tools.synth import SynthConfig, make_run

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "docs" / "grafana" / "kldiag.json"
RULES = ROOT / "docs" / "grafana" / "kldiag-rules.yml"
PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
SMALL = {"seqs_per_step": 8, "seq_len": (8, 24), "vocab_size": 0}
HEALTHY = SynthConfig(steps=60, **SMALL)
BLOWN = SynthConfig(steps=60, blowup_step=0, blowup_frac=0.1, **SMALL)


def scrape(exp: Exporter) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one scrape, through prometheus_client's own text format."""
    from prometheus_client import generate_latest

    text = generate_latest(exp.registry()).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples, name, run, **labels):
    return samples.get((name, tuple(sorted({"run": run, **labels}.items()))))


def test_exporter_follows_a_run_from_waiting_to_unstable(tmp_path):
    run = str(tmp_path / "run")
    exp = Exporter([run])
    exp.poll()
    s = scrape(exp)
    assert value(s, "kldiag_up", run) == 0.0 and value(s, "kldiag_verdict", run) is None  # waiting, no error
    make_run(run, HEALTHY, steps=range(0, 10))
    exp.poll()
    s = scrape(exp)
    assert value(s, "kldiag_up", run) == 1.0 and value(s, "kldiag_verdict", run) == 0.0
    assert value(s, "kldiag_last_step", run) == 9.0 and value(s, "kldiag_parts", run) == 1.0
    assert 0 <= value(s, "kldiag_seconds_since_last_part", run) < 120
    assert all(value(s, f"kldiag_{name}", run) is not None for name, _, _ in STEP_GAUGES if name != "mismatch_kl")
    assert exp.followers[0]._watcher.poll().diagnosis is None  # nothing new: nothing read
    make_run(run, BLOWN, steps=range(10, 14), manifest=False)
    exp.poll()
    s = scrape(exp)
    assert value(s, "kldiag_verdict", run) == 2.0 and value(s, "kldiag_last_step", run) == 13.0
    assert value(s, "kldiag_cause", run, cause="k3_weight_blowup", severity="critical") == 1.0
    assert value(s, "kldiag_episodes_total", run, kind="blowup") == 1.0
    assert value(s, "kldiag_weight_k3_abs_max", run) > 10
    exp.poll()  # no new part: the counter does not count the episode again
    assert value(scrape(exp), "kldiag_episodes_total", run, kind="blowup") == 1.0
    gc.collect()  # between looks no analysis is held (a few numbers per run): memory flat in run length
    # type(), not isinstance: a dead weakref.proxy among gc's objects raises ReferenceError on isinstance
    assert not [o for o in gc.get_objects() if type(o) is Analysis and str(o.run_dir) == run]


def test_every_cause_of_the_diagnosis_is_exported_and_damage_never_crashes(tmp_path):
    run = tmp_path / "run"
    make_run(run, BLOWN, steps=range(0, 6))
    make_run(run, HEALTHY, steps=range(6, 12), manifest=False)
    part = sorted((run / "tokens").rglob("*.parquet"))[-1]
    part.write_bytes(b"PAR1 not a parquet file PAR1")  # an unreadable part: skipped, never a crash
    exp = Exporter([str(run)])
    exp.poll()
    s = scrape(exp)
    dg = diagnose(analyze(run, AnalysisConfig(), reducers=reducers()))
    exported = {dict(k[1])["cause"] for k in s if k[0] == "kldiag_cause"}
    assert exported == {c.cause for c in dg.causes} and exported  # by name: a new cause needs no exporter change
    assert value(s, "kldiag_up", str(run)) == 1.0 and value(s, "kldiag_parts_skipped", str(run)) == 1.0
    assert value(s, "kldiag_poll_errors_total", str(run)) == 0.0
    (run / "run.json").unlink()  # the run vanished: waiting again, not an error
    exp.poll()
    assert value(scrape(exp), "kldiag_up", str(run)) == 0.0


def test_exporter_follows_an_s3_run_started_after_it(s3, tmp_path, monkeypatch):
    import numpy as np

    import kldiag

    monkeypatch.setenv("KLDIAG_CACHE_DIR", str(tmp_path / "cache"))
    uri = f"s3://{s3.bucket()}/runs/p"
    exp = Exporter([uri])
    exp.poll()
    assert value(scrape(exp), "kldiag_up", uri) == 0.0  # the exporter starts before training
    rng = np.random.default_rng(0)
    with kldiag.Recorder(uri, beta=0.04, estimator="k3", rotate_seconds=None) as rec:
        for step in range(6):
            logp = -rng.exponential(0.7, (4, 12)).astype(np.float32)
            ref = logp.copy()
            if step >= 3:  # pi_ref/pi_theta = e^8 on one token: |k3 weight| ~ 3000
                logp[:, 3], ref[:, 3] = -9.0, -1.0
            rec.record(step=step, logp=logp, logp_ref=ref, logp_old=logp)
    exp.poll()
    s = scrape(exp)
    assert value(s, "kldiag_up", uri) == 1.0 and value(s, "kldiag_last_step", uri) == 5.0
    assert value(s, "kldiag_verdict", uri) == 2.0 and value(s, "kldiag_weight_k3_abs_max", uri) > 1000
    assert 0 <= value(s, "kldiag_seconds_since_last_part", uri) < 300  # the object's modification time


def test_serve_metrics_cli(tmp_path, capsys):
    make_run(tmp_path / "run", HEALTHY, steps=range(0, 5))
    assert main(["serve-metrics", str(tmp_path / "run"), "--port", "0", "--once"]) == 0
    out = capsys.readouterr()
    assert "/metrics" in out.err and f"{tmp_path / 'run'}: analysed, step 4, healthy, 1 part(s)" in out.out
    # a run not started is not a run that can be read: --once, a check, says so and exits 1
    assert main(["serve-metrics", str(tmp_path / "run"), str(tmp_path / "later"), "--port", "0", "--once"]) == 1
    assert f"{tmp_path / 'later'}: waiting: no run yet" in capsys.readouterr().out
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert main(["serve-metrics", str(tmp_path / "run"), "--port", str(busy.getsockname()[1]), "--once"]) == 2
    assert "choose another --port" in capsys.readouterr().err


@pytest.mark.parametrize("host", ["192.0.2.1", "no-such-host.invalid"])
def test_a_bad_host_is_named_not_the_port(tmp_path, capsys, host):
    make_run(tmp_path / "run", HEALTHY, steps=range(0, 3))
    assert main(["serve-metrics", str(tmp_path / "run"), "--host", host, "--port", "0", "--once"]) == 2
    err = capsys.readouterr().err
    assert f"--host {host}" in err and "--port" not in err and "127.0.0.1" in err


def broken_runs(root: Path) -> dict[str, str]:
    """A good run beside a missing one, one whose only part is truncated, one with garbage JSON as run.json,
    one whose run.json holds a list, and one whose directory name is not UTF-8."""
    good, trunc, garbage, listed = root / "good", root / "trunc", root / "garbage", root / "listed"
    make_run(good, HEALTHY, steps=range(0, 5))
    make_run(trunc, HEALTHY, steps=range(0, 5))
    part = next((trunc / "tokens").rglob("*.parquet"))
    part.write_bytes(part.read_bytes()[:500])
    for bad, text in ((garbage, "{not json"), (listed, "[1, 2]")):
        make_run(bad, HEALTHY, steps=range(0, 2))
        (bad / "run.json").write_text(text)
    odd = root / "bad\udcffname"  # the bytes b"bad\xffname", as Python names them
    make_run(root / "odd", HEALTHY, steps=range(0, 2))
    (root / "odd").rename(odd)  # kldiag records under UTF-8 names only; a user may rename one
    return {"good": str(good), "missing": str(root / "missing"), "trunc": str(trunc), "garbage": str(garbage),
            "listed": str(listed), "odd": str(odd)}


def test_one_bad_run_never_breaks_the_others(tmp_path, capsys, caplog):
    runs = broken_runs(tmp_path)
    exp = Exporter(list(runs.values()))
    for _ in range(3):
        exp.poll()
    s = scrape(exp)  # every label encodes: the scrape of the good run's figures succeeds
    good = runs["good"]
    assert value(s, "kldiag_up", good) == 1.0 and value(s, "kldiag_last_step", good) == 4.0
    odd = runs["odd"].encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    assert odd.endswith("bad\\xffname") and value(s, "kldiag_up", odd) == 0.0
    assert value(s, "kldiag_state", runs["missing"], state="waiting") == 1.0
    assert value(s, "kldiag_state", runs["trunc"], state="unreadable") == 1.0  # not "not started"
    assert value(s, "kldiag_parts_skipped", runs["trunc"]) == 1.0 and value(s, "kldiag_parts", runs["trunc"]) == 1.0
    for bad in ("garbage", "listed"):
        assert value(s, "kldiag_state", runs[bad], state="failing") == 1.0
        assert value(s, "kldiag_poll_errors_total", runs[bad]) == 3.0
    told = [r.getMessage() for r in caplog.records if r.name == "kldiag.export.prometheus"]
    assert sum(runs["garbage"] in m and "not valid JSON" in m for m in told) == 1  # once per cause, not per look
    assert sum(runs["listed"] in m and "holds a JSON list" in m for m in told) == 1
    assert main(["serve-metrics", *runs.values(), "--port", "0", "--once"]) == 1
    out = capsys.readouterr().out
    assert f"{good}: analysed, step 4, healthy, 1 part(s)" in out
    assert f"{runs['trunc']}: unreadable: " in out and f"{runs['garbage']}: failing: RunFormatError" in out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_for(fn, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            got = fn()
            if got:
                return got
        except OSError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    """`kldiag serve-metrics` on a blown-up run and a run not started yet, scraped every 0.5 s by a real
    Prometheus on 127.0.0.1 that loads the shipped rules; yields its query and alerts functions and the
    runs. Both processes are killed at teardown."""
    tmp = tmp_path_factory.mktemp("prom")
    run, later = str(tmp / "blown"), str(tmp / "later")
    make_run(run, BLOWN, steps=range(0, 8))
    exp_port, prom_port = free_port(), free_port()
    (tmp / "prometheus.yml").write_text(
        "global: {scrape_interval: 500ms, evaluation_interval: 500ms}\n"
        f"rule_files: ['{RULES}']\n"
        f"scrape_configs:\n  - job_name: kldiag\n    static_configs: [{{targets: ['127.0.0.1:{exp_port}']}}]\n")
    procs = [subprocess.Popen([sys.executable, "-m", "kldiag", "serve-metrics", run, later, "--port", str(exp_port),
                               "--interval", "0.5"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE),
             subprocess.Popen([PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
                               f"--storage.tsdb.path={tmp / 'db'}",
                               f"--web.listen-address=127.0.0.1:{prom_port}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    api = f"http://127.0.0.1:{prom_port}/api/v1/"

    def query(q: str) -> dict:
        return get_json(api + "query?" + urllib.parse.urlencode({"query": q}))

    def alerts() -> list[dict]:
        return get_json(api + "alerts")["data"]["alerts"]

    try:
        yield SimpleNamespace(query=query, alerts=alerts, run=run, later=later)
    finally:
        for p in procs:
            p.kill()
            p.wait(10)


def test_real_prometheus_answers_the_verdict(prometheus):
    query, run, later = prometheus.query, prometheus.run, prometheus.later
    res = wait_for(lambda: query(f'kldiag_verdict{{run="{run}"}}')["data"]["result"], 90,
                   "kldiag_verdict in Prometheus")
    assert res[0]["metric"]["job"] == "kldiag" and res[0]["value"][1] == "2"  # unstable: the run blew up
    assert query(f'kldiag_up{{run="{later}"}}')["data"]["result"][0]["value"][1] == "0"  # not started: waiting
    cause = query('kldiag_cause{cause="k3_weight_blowup"}')["data"]["result"]
    assert [c["metric"]["severity"] for c in cause] == ["critical"]
    fired = wait_for(lambda: [a for a in prometheus.alerts() if a["labels"]["alertname"] == "KldiagCriticalCause"],
                     30, "the critical-cause alert")
    assert fired[0]["labels"]["cause"] == "k3_weight_blowup" and fired[0]["state"] == "firing"


def test_dashboard_queries_run_on_prometheus_and_match_the_schema(prometheus):
    query, run = prometheus.query, prometheus.run
    wait_for(lambda: query(f'kldiag_verdict{{run="{run}"}}')["data"]["result"], 90, "the first scrape")
    dash = json.loads(DASHBOARD.read_text())
    assert isinstance(dash["schemaVersion"], int) and dash["title"] and dash["uid"]
    assert isinstance(dash["editable"], bool) and dash["graphTooltip"] in (0, 1, 2)
    assert {"from", "to"} <= set(dash["time"])
    names = [v["name"] for v in dash["templating"]["list"]]
    assert names == ["run"] and all(v["type"] == "query" for v in dash["templating"]["list"])
    ids, titles = set(), []
    for p in dash["panels"]:
        assert p["type"] in ("stat", "table", "timeseries") and p["id"] not in ids
        ids.add(p["id"])
        titles.append(p["title"])
        assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert {"defaults", "overrides"} <= set(p["fieldConfig"]) and isinstance(p["options"], dict)
        assert isinstance(p["transformations"], list) and p["targets"]
        for t in p["targets"]:
            assert t["refId"] and t["datasource"]["uid"] == "${DS_PROMETHEUS}"
            expr = t["expr"].replace("$__rate_interval", "1m").replace("$run", ".*")
            got = query(expr)
            assert got["status"] == "success", (p["title"], expr, got)
            if p["title"] in ("Verdict", "Causes named now", "|k3 weight|: max and p99"):
                assert got["data"]["result"], (p["title"], expr)
    metrics = set(re.findall(r"kldiag_\w+", json.dumps(dash)))
    assert metrics <= set(exported_names()), metrics - set(exported_names())
    joined = " ".join(titles).lower()
    assert all(w in joined for w in ("verdict", "causes", "weight", "mismatch", "staleness"))


def exported_names() -> list[str]:
    exp = Exporter([])
    return [n for fam in exp.collect() for n in (fam.name, fam.name + "_total")]


def test_rules_pass_promtool_check_and_unit_tests(tmp_path):
    out = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr
    description = ("kldiag's diagnosis names the critical cause k3_weight_blowup (the run is unstable). "
                   "`kldiag analyze a` gives its onset, evidence and the fix for this trainer.")
    (tmp_path / "test.yml").write_text(f"""
rule_files: ['{RULES}']
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'kldiag_cause{{run="a", cause="k3_weight_blowup", severity="critical"}}'
        values: '1x10'
      - series: 'kldiag_up{{run="a"}}'
        values: '1x60'
      - series: 'kldiag_seconds_since_last_part{{run="a"}}'
        values: '0+60x60'
    alert_rule_test:
      - eval_time: 2m
        alertname: KldiagCriticalCause
        exp_alerts:
          - exp_labels: {{severity: critical, run: a, cause: k3_weight_blowup}}
            exp_annotations:
              summary: "kldiag: k3_weight_blowup in run a"
              description: "{description}"
      - eval_time: 20m
        alertname: KldiagRunStuck
        exp_alerts: []
      - eval_time: 40m
        alertname: KldiagRunStuck
        exp_alerts:
          - exp_labels: {{severity: critical, run: a}}
            exp_annotations:
              summary: "kldiag: run a has published no part for 40m 0s"
              description: "The trainer stopped recording: stuck, crashed or hung on a collective. Check its logs."
""")
    out = subprocess.run([PROMTOOL, "test", "rules", str(tmp_path / "test.yml")], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
