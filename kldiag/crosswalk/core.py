"""The crosswalk's computation: settings, the loss calls of a step, the table and its null reasons.

kldiag.crosswalk is its public face (`kldiag.crosswalk(run, framework, **settings)`); docs/crosswalk.md.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
import pyarrow as pa

from kldiag.crosswalk import areal, nemo_rl, openrlhf, skyrl, slime, trl, verl
from kldiag.crosswalk.batch import StepBatch, pad
from kldiag.errors import KldiagError
from kldiag.format import open_run
from kldiag.frameworks import family
from kldiag.mismatch import sample as SS
from kldiag.mismatch import tokenset as TS

FRAMEWORKS = {"verl": verl, "trl": trl, "slime": slime, "nemo-rl": nemo_rl, "openrlhf": openrlhf, "skyrl": skyrl,
              "areal": areal}
ALIASES = {"nemo_rl": "nemo-rl", "nemorl": "nemo-rl", "nemo": "nemo-rl"}


class CrosswalkError(KldiagError, ValueError):
    """A bad framework name or setting (the message names the valid ones)."""


def module(framework: str):
    name = ALIASES.get(framework.lower(), framework.lower())
    if name not in FRAMEWORKS:
        raise CrosswalkError(f"unknown framework {framework!r}: use one of {', '.join(FRAMEWORKS)}")
    return FRAMEWORKS[name]


def framework_of(manifest) -> str | None:
    """The crosswalk framework of a run's own trainer (kldiag.frameworks.family of its manifest's
    trainer name, spelt as --framework takes it: "nemo-rl"), None when it is not one of FRAMEWORKS."""
    name = family(manifest).replace("_", "-")
    return name if name in FRAMEWORKS else None


def framework_names(last: str = "or") -> str:
    """FRAMEWORKS as a message lists them: 'verl, trl, ..., skyrl or areal' (every list in one place)."""
    names = list(FRAMEWORKS)
    return f"{', '.join(names[:-1])} {last} {names[-1]}"


def require_framework(manifest, framework: str | None, how: str = "--framework") -> str:
    """`framework` when given, else the run's own (framework_of); CrosswalkError naming every framework
    and how to pass one (`how`: the caller's flag or argument) when neither is known."""
    fw = framework or framework_of(manifest)
    if fw is None:
        raise CrosswalkError(f"the run's trainer is not one of the crosswalk's frameworks: pass {how} "
                             f"{framework_names()}")
    return fw

def _coerce(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    low = text.strip().lower()
    if low in ("null", "none", "~"):
        return None
    if low in ("true", "false"):
        return low == "true"
    if "_" in low:  # a band such as verl's "0.5_2": float() would read it as 0.52
        return text.strip()
    try:
        return float(text) if any(c in low for c in ".e") or not low.lstrip("-").isdigit() else int(text)
    except ValueError:
        return text.strip()


def parse_settings(framework: str, pairs: dict[str, Any] | list[str] | None = None, manifest=None):
    """The framework's Settings from KEY=VALUE strings or a dict; unset keys come from the run's
    manifest config when it has them (e.g. TRL's use_bias_correction_kl), else the framework's default."""
    mod = module(framework)
    names = {f.name for f in dataclasses.fields(mod.Settings)}
    given: dict[str, Any] = {}
    for item in pairs or []:
        if isinstance(pairs, dict):
            key, value = item, pairs[item]
        else:
            if "=" not in item:
                raise CrosswalkError(f"--set {item!r}: write KEY=VALUE, e.g. --set rollout_is=token")
            key, value = item.split("=", 1)
        key = key.strip().replace("-", "_")
        if key not in names:
            raise CrosswalkError(f"{mod.NAME} has no setting {key!r}; known: {', '.join(sorted(names))}")
        given[key] = _coerce(value)
    config = dict(getattr(manifest, "config", None) or {})
    for key in names - set(given):
        if key in config and config[key] is not None:
            given[key] = config[key]
    try:
        return mod.Settings(**given)
    except (TypeError, ValueError) as e:  # ValueError: a configuration the framework itself refuses
        raise CrosswalkError(f"{mod.NAME} settings: {e}") from e


def loss_calls(ts_all: TS.TokenSet, step: int, sl: slice) -> list[StepBatch]:
    """The step's loss calls: one padded batch per (iteration, rank, micro) group of all-iteration rows
    (each rank makes its own call on its own micro-batch)."""
    micro, it, rank = ts_all.micro[sl], ts_all.iteration[sl], ts_all.rank[sl]
    key = (it.astype(np.int64) * 1_000_000 + rank) * 1_000_000 + micro
    out = []
    for k in np.unique(key):
        idx = np.flatnonzero(key == k) + sl.start
        sub = ts_all.take(idx)
        order = np.lexsort((sub.pos, sub.seq))
        out.append(pad(sub.take(order), slice(0, len(order)), step))
    return out


LOGPS = ("logp", "logp_old", "logp_ref", "logp_sampler")


def nonfinite_inputs(batches: list[StepBatch]) -> str:
    """'logp_ref: 1 inf' for the log-probs of a step's trained tokens that are NaN or +-inf, in the
    columns the step recorded (some finite value, or an inf: an unrecorded column is all NaN); '' if none."""
    parts = []
    cols = {name: np.concatenate([getattr(b, name)[b.mask] for b in batches]) for name in LOGPS}
    for name, v in cols.items():
        if name == "logp_old" and np.array_equal(v, cols["logp"], equal_nan=True):
            continue  # not recorded: the batch holds pi_theta there
        fin = np.isfinite(v)
        n_nan, n_inf = int(np.isnan(v).sum()), int(np.isinf(v).sum())
        if (fin.any() or n_inf) and (n_nan or n_inf):
            parts.append(f"{name}: " + ", ".join(f"{n} {w}" for n, w in ((n_nan, "NaN"), (n_inf, "inf")) if n))
    return "; ".join(parts)


def _absence_claims(mod) -> dict[str, str]:
    """{a module's "the run has no <column>" reason: that column}."""
    return {getattr(mod, const): col for const, col in (("NO_REF", "logp_ref"), ("NO_SAMPLER", "logp_sampler"))
            if hasattr(mod, const)}


def _null(v: Any) -> bool:
    return v is None or not np.isfinite(v)


def _step_reasons(mod, names, b: StepBatch, calls, values, why) -> dict[str, str]:
    """{name: "non-finite inputs at step S (...)"} for the step's null metrics when the step holds NaN/inf
    log-probs and the module gave no reason, or claimed the absence of a column the step did record."""
    batches = calls or [b]  # the loss calls hold every iteration, the first included
    bad = nonfinite_inputs(batches)
    if not bad:
        return {}
    claims = _absence_claims(mod)
    out = {}
    for n in names:
        if not _null(values.get(n)):
            continue
        given = why.get(n)
        col = claims.get(given)
        recorded = col is not None and any(np.isfinite(getattr(x, col)[x.mask]).any() for x in batches)
        if given is None or recorded:
            out[n] = f"non-finite inputs at step {b.step} ({bad})"
    return out


def crosswalk(run, framework: str, max_tokens: int = TS.MAX_TOKENS, sample: SS.Sample | None = None,
              **settings: Any) -> pa.Table:
    """Per step, `framework`'s metrics under its exact names (float64, null where the run lacks the data).

    `sample`: a token sample already read (a face's shared one); else the run is read here."""
    r = open_run(run) if not hasattr(run, "iter_batches") else run
    mod = module(framework)
    s = parse_settings(framework, settings, r.manifest)
    ts = sample.tokens() if sample is not None else TS.load(r, max_tokens=max_tokens)
    calls_by_step: dict[int, list[StepBatch]] = {}
    if getattr(mod, "NEEDS_ALL_ITERATIONS", False):
        ts_all = sample.tokens(True) if sample is not None else TS.load(r, all_iterations=True, max_tokens=max_tokens)
        calls_by_step = {step: loss_calls(ts_all, step, sl) for step, sl in ts_all.step_slices()}
    rows, reasons, by_step = [], {}, {}
    first = dict(ts.step_slices())
    known = mod.metric_names(s)
    for step in sorted(set(first) | set(calls_by_step)):
        b = pad(ts, first.get(step, slice(0, 0)), step)  # empty: a step that only reuses earlier sequences
        if step in calls_by_step:
            values, why = mod.step_metrics(b, s, calls_by_step[step])
        else:
            values, why = mod.step_metrics(b, s)
        rows.append((step, values))
        own = _step_reasons(mod, [*known, *values, *why], b, calls_by_step.get(step), values, why)
        if own:
            by_step[step] = own
        for k, v in why.items():
            if step in first and k not in own:
                reasons.setdefault(k, v)
    for name, override in (mod.run_overrides(r, s) if hasattr(mod, "run_overrides") else {}).items():
        for step, values in rows:
            if step in override:
                values[name] = override[step]
    names = list(dict.fromkeys([*mod.metric_names(s), *(k for _, v in rows for k in v)]))
    cols = {"step": pa.array([st for st, _ in rows], pa.int64())}
    for n in names:
        cols[n] = pa.array([None if v.get(n) is None or not np.isfinite(v[n]) else float(v[n]) for _, v in rows],
                           pa.float64())
    for n in names:  # a metric null only where inputs are non-finite: its reason lists those steps
        bad = [st for st, own in by_step.items() if n in own]
        if bad and n not in reasons:
            reasons[n] = by_step[bad[0]][n] if len(bad) == 1 else (
                f"non-finite inputs at steps {', '.join(map(str, bad[:10]))}{', ...' if len(bad) > 10 else ''} "
                "(NaN/inf log-probs; --json names them per step)")
    all_null = {n: reasons.get(n, "not computed for these settings") for n in names
                if cols[n].null_count == len(rows)}
    reasons = {**{k: v for k, v in reasons.items() if k in names}, **all_null}
    steps_why = {str(st): {k: v for k, v in own.items() if k in names} for st, own in by_step.items()}
    meta = {"kldiag.framework": mod.NAME, "kldiag.settings": json.dumps(dataclasses.asdict(s), default=str),
            "kldiag.null_reasons": json.dumps(reasons), "kldiag.step_null_reasons": json.dumps(steps_why),
            "kldiag.step_stride": str(ts.step_stride), "kldiag.group_share": repr(float(ts.group_share))}
    return pa.table(cols).replace_schema_metadata(meta)


def null_reasons(table: pa.Table) -> dict[str, str]:
    meta = table.schema.metadata or {}
    return json.loads(meta.get(b"kldiag.null_reasons", b"{}"))


STEP_NULL = "this step has no tokens this metric needs (e.g. only reuse iterations of earlier sequences)"


def records(table: pa.Table, reasons: bool = True) -> list[dict[str, Any]]:
    """The JSON list `kldiag crosswalk --json` prints (docs/crosswalk.md): one object per step,
    {"step": S, "<name>": value or null, ...}; with `reasons`, a step with null metrics also has
    "null_reasons": {name: why}."""
    why = null_reasons(table)
    at_step = json.loads((table.schema.metadata or {}).get(b"kldiag.step_null_reasons", b"{}"))
    rows = table.to_pylist()
    if reasons:
        for row in rows:
            own = at_step.get(str(row["step"]), {})
            nulls = {k: own.get(k) or why.get(k, STEP_NULL) for k, v in row.items() if v is None}
            if nulls:
                row["null_reasons"] = nulls
    return rows
