"""prime-rl token exports (`trainer.enable_token_export=true`) into a kldiag run.

Read at PrimeIntellect-ai/prime-rl@559b4477 (2026-08-21), src/prime_rl/trainer/rl/token_export.py:
each trainer rank appends one JSON line per packed sequence that has a loss token
(`TokenExporter.export`, l. 42-74) to {output_dir}/token_exports/step_{N}/rank_{r}.jsonl
(l. 87-100), with `schema_version` 1, step, rank, micro_step, micro_sequence_idx,
export_sequence_idx (the line's index in the file), env_name and the per-token lists of
`_export_columns` (l. 128-157): token_ids, position_ids, loss_mask, advantages,
inference_logprobs, trainer_logprobs, entropy, mismatch_kl, log_importance_ratio,
importance_ratio, prob_delta, is_masked*. Non-finite floats are written as null
(`_json_float`, l. 247-253). After every rank wrote a step, rank 0's exporter touches
step_{N}/STABLE (`mark_stable`, called after a barrier, train.py l. 551-553): a step without
STABLE is still being written and is left for the next import. CP ranks other than 0 do not
export (l. 120). The RL loss has no reference model: no reference log-probs.

Mapping: step = step, rank = rank, micro = micro_step, seq = step * 2**40 + rank * 2**24 +
export_sequence_idx, group = null (the export has no example id), tokens from the first
loss-mask token to the end of the record; logp = trainer_logprobs (the update's own forward:
prime-rl takes one optimizer step per step, so pi_theta = pi_old), logp_sampler =
inference_logprobs, advantage = advantages, mask = loss_mask, entropy = entropy, token_id =
token_ids, task (format v1.3) = env_name; a null log-prob (a non-finite value in the trainer) is NaN,
counted by the analysis. The export has no weight version (prime-rl keeps `policy.start/end` on the
orchestrator's episode, not on the trainer's sample; still none at prime-rl@004274ec): policy_version stays null.
A row that carries the engine's per-token version segments, `weight_versions` = [[version, output_offset], ...]
(prime-rl's vLLM patch `inference/vllm/weight_version.py` at 4133139d: output tokens [offset_i, offset_i+1) were
sampled by version_i), gets policy_version per token from them (`segment_versions`), over the completion tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kldiag.errors import DumpError, UnsupportedDumpVersionError
from kldiag.importers.nemo_rl import jsonl_rows
from kldiag.importers.sink import TOKEN_FIELDS, Sequence

NAME = "prime-rl"
DUMP_VERSION = "1"
KNOWN_VERSIONS = (1,)
PATTERN = "token_exports/step_{N}/rank_{r}.jsonl"
COLUMNS = TOKEN_FIELDS
MISSING = ("logp_old", "logp_ref")
STEP_RE = re.compile(r"^step_(\d+)$")
FILE_RE = re.compile(r"^rank_(\d+)\.jsonl$")
REQUIRED = ("schema_version", "step", "rank", "token_ids", "loss_mask", "trainer_logprobs", "inference_logprobs")


def list_files(src: Path) -> tuple[list[Path], list[Path]]:
    """(files of finished steps, files of steps without STABLE), in (step, rank) order."""
    if src.is_file():
        return [src], []
    root = src / "token_exports" if (src / "token_exports").is_dir() else src
    ready, pending = [], []
    for d in root.iterdir() if root.is_dir() else ():
        m = STEP_RE.match(d.name)
        if m is None or not d.is_dir():
            continue
        files = [p for p in d.iterdir() if FILE_RE.match(p.name)]
        (ready if (d / "STABLE").exists() else pending).extend(files)
    key = lambda p: (int(STEP_RE.match(p.parent.name).group(1)), int(FILE_RE.match(p.name).group(1)))  # noqa: E731
    return sorted(ready, key=key), sorted(pending, key=key)


def config(options: dict[str, Any]) -> dict[str, Any]:
    return {}


def world_size(files: list[Path], options: dict[str, Any]) -> int:
    """1 + the largest rank in the file names."""
    ranks = [int(m.group(1)) for p in files if (m := FILE_RE.match(p.name))]
    return max(ranks, default=0) + 1


def read_file(path: Path, options: dict[str, Any]) -> Iterator[Sequence]:
    for line_no, row in jsonl_rows(path):
        yield to_sequence(row, line_no)


def to_sequence(row: Any, line_no: int) -> Sequence:
    if not isinstance(row, dict) or any(k not in row for k in REQUIRED):
        raise DumpError(f"line {line_no} is not a prime-rl token export record")
    version = row["schema_version"]
    if version not in KNOWN_VERSIONS:
        raise UnsupportedDumpVersionError(
            f"line {line_no} is a prime-rl token export of schema_version {version!r}; this kldiag reads "
            f"schema_version {', '.join(map(str, KNOWN_VERSIONS))} (prime-rl@559b4477); upgrade kldiag")
    step, rank = int(row["step"]), int(row["rank"])
    loss = np.asarray(row["loss_mask"], bool)
    first = int(np.argmax(loss)) if loss.any() else len(loss)
    idx = int(row.get("export_sequence_idx", line_no - 1))
    return Sequence(step=step, rank=rank, micro=int(row.get("micro_step", 0)),
                    seq=(step << 40) + (rank << 24) + idx, group=None,
                    logp=_floats(row["trainer_logprobs"])[first:], mask=loss[first:],
                    logp_sampler=_floats(row["inference_logprobs"])[first:],
                    entropy=_floats(row["entropy"])[first:] if "entropy" in row else None,
                    advantage=_floats(row["advantages"])[first:] if "advantages" in row else None,
                    token_ids=np.asarray(row["token_ids"], np.int64)[first:].astype(np.int32),
                    task=row["env_name"] if isinstance(row.get("env_name"), str) else None,
                    policy_version=segment_versions(row.get("weight_versions"), len(loss) - first))


def segment_versions(segments: Any, n: int) -> np.ndarray | None:
    """[n] int64 per-token versions from `[[version, output_offset], ...]` (offsets ascending from 0: the tokens
    from one offset to the next were sampled by that version); None when absent or malformed."""
    if not segments or n <= 0:
        return None
    try:
        versions = np.array([int(v) for v, _ in segments], np.int64)
        offsets = np.array([int(o) for _, o in segments], np.int64)
    except (TypeError, ValueError):
        return None
    if offsets[0] != 0 or (np.diff(offsets) <= 0).any() or offsets[-1] >= n:
        return None
    return np.repeat(versions, np.diff(np.append(offsets, n)))


def _floats(v: list[Any]) -> np.ndarray:
    """float32; JSON null (prime-rl's non-finite value) becomes NaN."""
    try:
        return np.array(v, np.float32)
    except TypeError:  # a null among the values
        return np.array([np.nan if x is None else x for x in v], np.float32)
