"""`kldiag mcp`: every tool through the mcp SDK's own client (in-memory, and one stdio session of
`python -m kldiag mcp`) on the shipped sample runs, against the CLI's --json of the same run."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

import anyio
import pytest

pytest.importorskip("mcp")

from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters  # noqa: E402

import kldiag  # noqa: E402
from kldiag.agents import Workspace  # noqa: E402
from kldiag.agents.server import build_server  # noqa: E402
from kldiag.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ("demo_k3", "demo_k3_is", "trl_grpo_tiny")
TOOLS = ["list_runs", "diagnose", "steps", "worst_tokens", "sequence", "crosswalk", "audit", "compare", "explain"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The sample runs copied (the analysis cache is written beside a run), plus trainer logs for audit."""
    base = tmp_path_factory.mktemp("agents")
    for name in SAMPLES:
        shutil.copytree(ROOT / "sample_logs" / name, base / "runs" / name, ignore=shutil.ignore_patterns(".kldiag"))
    return base


def cli_json(capsys, *argv) -> object:
    capsys.readouterr()
    assert main(list(argv)) in (0, 1)
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def analyzed(root):
    """`kldiag analyze RUN --json` of the demo pair (module-wide: the runs' analyses are cached)."""
    out = {}
    for name in ("demo_k3", "demo_k3_is"):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["analyze", str(root / "runs" / name), "--json"]) == 0
        out[name] = json.loads(buf.getvalue())
    return out


def call(root, *calls, roots=None):
    """[(tool, args)] -> the structured results (or ("error", text)) from one in-memory SDK session."""
    async def session():
        results = []
        async with Client(build_server(Workspace(roots or [root / "runs"]))) as c:
            for name, args in calls:
                r = await c.call_tool(name, args)
                results.append(("error", r.content[0].text) if r.is_error else json.loads(r.content[0].text))
        return results

    return anyio.run(session)


def pages(root, tool, args, limit):
    """Every page of a paged tool in one session, concatenated (the list: the result's first list)."""
    async def session():
        got, offset = [], 0
        async with Client(build_server(Workspace([root / "runs"]))) as c:
            while offset is not None:
                r = json.loads((await c.call_tool(tool, {**args, "offset": offset, "limit": limit})).content[0].text)
                items = next(v for k, v in r.items() if isinstance(v, list) and k != "metrics")
                assert 0 < len(items) <= limit
                got += items
                offset = r["next_offset"]
        return got

    return anyio.run(session)


def test_tool_list_is_read_only_and_documented(root):
    async def session():
        async with Client(build_server(Workspace([root / "runs"]))) as c:
            return (await c.list_tools()).tools

    tools = anyio.run(session)
    assert [t.name for t in tools] == TOOLS
    assert all(t.annotations.read_only_hint and t.description for t in tools)


def test_list_runs_finds_the_samples(root):
    (r,) = call(root, ("list_runs", {}))
    assert [x["run"] for x in r["runs"]] == list(SAMPLES) and r["next_offset"] is None
    assert r["runs"][0]["steps"] == [0, 199] and r["runs"][2]["trainer"]["name"] == "trl"
    (first,) = call(root, ("list_runs", {"limit": 1, "offset": 1}))
    assert [x["run"] for x in first["runs"]] == ["demo_k3_is"] and first["next_offset"] == 2


def test_diagnose_is_the_cli_diagnosis(root, analyzed):
    got = call(root, ("diagnose", {"run": "demo_k3"}), ("diagnose", {"run": str(root / "runs" / "demo_k3_is")}))
    for r, name in zip(got, ("demo_k3", "demo_k3_is"), strict=True):
        want = analyzed[name]["diagnosis"]
        assert r["run"] == name and r["verdict"] == want["verdict"] and r["causes"] == want["causes"]
        assert r["alerts"] == len(analyzed[name]["alerts"]) and r["steps"] == [0, 199]
    assert got[0]["verdict"] == "unstable" and got[0]["causes"][0]["cause"] == "k3_weight_blowup"


def test_steps_pages_through_the_cli_steps(root, analyzed):
    want = analyzed["demo_k3"]["steps"]
    assert pages(root, "steps", {"run": "demo_k3"}, limit=64) == want
    (r,) = call(root, ("steps", {"run": "demo_k3", "metrics": ["weight_k3_abs_max", "k3_mean"], "start": 40,
                                 "end": 49}))
    assert r["metrics"] == ["step", "weight_k3_abs_max", "k3_mean"] and r["total"] == 10
    assert r["steps"] == [{k: w[k] for k in r["metrics"]} for w in want if 40 <= w["step"] <= 49]
    (bad,) = call(root, ("steps", {"run": "demo_k3", "metrics": ["nope"]}))
    assert bad[0] == "error" and "unknown step metrics ['nope']" in bad[1]


def test_worst_tokens_are_the_cli_flags(root, analyzed):
    (r,) = call(root, ("worst_tokens", {"run": "demo_k3"}))
    assert r["tokens"] == analyzed["demo_k3"]["flags"] and r["next_offset"] == 20
    (at,) = call(root, ("worst_tokens", {"run": "demo_k3", "n": 5, "step": 86}))
    assert len(at["tokens"]) == 5 and {t["step"] for t in at["tokens"]} == {86}
    weights = [abs(t["weight_k3"]) for t in at["tokens"]]
    assert weights == sorted(weights, reverse=True)


def test_sequence_returns_the_recorded_log_probs_as_data(root, analyzed):
    worst = analyzed["demo_k3"]["flags"][0]
    (r,) = call(root, ("sequence", {"run": "demo_k3", "step": worst["step"], "seq": worst["seq"]}))
    t = kldiag.open_run(root / "runs" / "demo_k3").read().to_pandas()
    rows = t[(t["step"] == worst["step"]) & (t["seq"] == worst["seq"])].sort_values(["iteration", "pos"])
    assert [x["pos"] for x in r["tokens"]] == rows["pos"].tolist()
    for col in ("logp", "logp_old", "logp_ref", "logp_sampler"):
        assert [x[col] for x in r["tokens"]] == pytest.approx(rows[col].tolist(), rel=1e-7)
    hit = next(x for x in r["tokens"] if x["pos"] == worst["pos"])
    assert hit["piece"] == worst["piece"] and "never an instruction" in r["note"]


def test_crosswalk_is_the_cli_crosswalk(root, capsys):
    run = str(root / "runs" / "demo_k3")
    want = cli_json(capsys, "crosswalk", run, "--framework", "verl", "--set", "kl_loss_type=low_var_kl", "--json")
    got = pages(root, "crosswalk", {"run": "demo_k3", "framework": "verl", "settings": {"kl_loss_type": "low_var_kl"}},
                limit=100)
    assert got == want and len(got) == 200


def test_audit_is_the_cli_audit(root, capsys):
    run = str(root / "runs" / "trl_grpo_tiny")
    logged = [{"step": r["step"], "kl": r["kl"] * (2.0 if r["step"] == 3 else 1.0)}
              for r in cli_json(capsys, "crosswalk", run, "--json") if r.get("kl") is not None]
    logs = root / "runs" / "trl_logs.jsonl"
    logs.write_text("\n".join(json.dumps(x) for x in logged))
    want = cli_json(capsys, "audit", run, "--logs", str(logs), "--json")
    (r,) = call(root, ("audit", {"run": "trl_grpo_tiny", "logs": "trl_logs.jsonl"}))
    assert r.pop("run_label") == "trl_grpo_tiny" and r == want
    kl = next(m for m in r["metrics"] if m["name"] == "kl")
    assert kl["verdict"] == "disagree" and kl["differing_steps"] == [3]


def test_compare_puts_the_cli_verdicts_side_by_side(root, analyzed):
    (r,) = call(root, ("compare", {"runs": ["demo_k3", "demo_k3_is"]}))
    for got, name in zip(r["runs"], ("demo_k3", "demo_k3_is"), strict=True):
        want = analyzed[name]
        assert got["verdict"] == want["diagnosis"]["verdict"]
        assert [c["cause"] for c in got["causes"]] == [c["cause"] for c in want["diagnosis"]["causes"]]
        assert got["headline"]["k3_mean"] == want["steps"][-1]["k3_mean"]
        assert got["headline"]["weight_k3_abs_max"] == max(s["weight_k3_abs_max"] for s in want["steps"])


def test_explain_gives_rule_fix_and_the_runs_evidence(root, analyzed):
    cause = analyzed["demo_k3"]["diagnosis"]["causes"][0]
    r, verl, bad = call(root, ("explain", {"cause": "k3_weight_blowup", "run": "demo_k3"}),
                        ("explain", {"cause": "k3_weight_blowup", "framework": "verl"}),
                        ("explain", {"cause": "no_such_cause"}))
    assert r["fix"] == cause["fix"] and r["in_run"] == cause and r["evidence_keys"] == sorted(cause["evidence"])
    assert "blowup_weight" in r["detected_when"]
    assert "kl_loss_type" in verl["fix"] and "in_run" not in verl  # phrased in verl's option names
    assert verl["evidence_keys"] is None and "pass run=" in verl["note"]
    assert bad[0] == "error" and "k3_weight_blowup" in bad[1]


def test_runs_outside_the_roots_are_refused(root, tmp_path):
    (tmp_path / "outside").mkdir()
    shutil.copytree(root / "runs" / "trl_grpo_tiny", tmp_path / "outside" / "run")
    os.symlink(tmp_path / "outside" / "run", root / "runs" / "link")
    try:
        got = call(root, ("diagnose", {"run": str(tmp_path / "outside" / "run")}),
                   ("diagnose", {"run": "../../" + str(tmp_path.relative_to(tmp_path.anchor)) + "/outside/run"}),
                   ("diagnose", {"run": "link"}),
                   ("sequence", {"run": "demo_k3/../../runs/../..", "step": 0, "seq": 0}),
                   ("audit", {"run": "trl_grpo_tiny", "logs": "/etc/passwd"}),
                   ("list_runs", {"root": str(tmp_path)}))
    finally:
        os.unlink(root / "runs" / "link")
    for r in got:
        assert r[0] == "error" and "outside the roots" in r[1], r


def test_stdio_session_of_the_kldiag_mcp_command(root, analyzed):
    params = StdioServerParameters(command=sys.executable, args=["-m", "kldiag", "mcp", "--root", str(root / "runs")],
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})

    async def session():
        async with Client(params) as c:
            names = [t.name for t in (await c.list_tools()).tools]
            r = await c.call_tool("diagnose", {"run": "demo_k3_is"})
            return names, json.loads(r.content[0].text)

    names, r = anyio.run(session)
    assert names == TOOLS
    assert r["verdict"] == analyzed["demo_k3_is"]["diagnosis"]["verdict"] == "warning"


def test_a_page_is_bounded_in_size_and_resumes_where_it_stopped():
    from kldiag.agents.paging import MAX_LIMIT, AgentToolError, page

    items = [{"i": i, "text": "x" * 100} for i in range(50)]
    first = page(items, 0, 50, max_chars=1_000)
    assert 1 <= len(first["items"]) < 10 and first["next_offset"] == len(first["items"])
    rest = page(items, first["next_offset"], 50, max_chars=10**6)
    assert first["items"] + rest["items"] == items and rest["next_offset"] is None
    with pytest.raises(AgentToolError, match=f"1 <= limit <= {MAX_LIMIT}"):
        page(items, 0, MAX_LIMIT + 1)


def test_bad_tool_arguments_are_errors_naming_the_fix(root, analyzed):
    got = call(root, ("explain", {"cause": "k3_weight_blowup", "framework": "pytorch-lightning"}),
               ("worst_tokens", {"run": "demo_k3", "n": 0}),
               ("diagnose", {"run": "demo_k3/run.json"}),
               ("steps", {"run": "demo_k3", "start": 150, "end": 100}),
               ("explain", {"cause": "k3_weight_blowup", "framework": "nemo-rl"}))
    explain, worst, diag, steps, nemo = got
    assert explain[0] == "error" and "unknown framework 'pytorch-lightning'" in explain[1] and "verl" in explain[1]
    assert worst[0] == "error" and "n=0" in worst[1] and "limit" not in worst[1]
    assert diag[0] == "error" and "is a file, not a run directory" in diag[1] and "'demo_k3'" in diag[1]
    assert "Errno" not in diag[1]
    assert steps[0] == "error" and "start=150 is after end=100" in steps[1]
    assert nemo["fix"]  # a framework spelt as the CLI spells it


def test_framework_lists_come_from_one_place(root, tmp_path):
    from kldiag.crosswalk import FRAMEWORKS, framework_names

    listed = framework_names()
    assert all(name in listed for name in FRAMEWORKS) and listed.endswith(f" or {list(FRAMEWORKS)[-1]}")
    (got,) = call(root, ("crosswalk", {"run": "demo_k3"}))  # the demo's trainer is none of them
    assert got[0] == "error" and listed in got[1]
    with pytest.raises(kldiag.KldiagError) as e:
        kldiag.audit(root / "runs" / "demo_k3", str(tmp_path / "nonexistent"))
    assert "nonexistent: no such file" in str(e.value) and "crosswalk's frameworks" not in str(e.value)  # logs first
