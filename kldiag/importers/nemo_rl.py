"""NeMo-RL `train_data_step{N}.jsonl` (GRPO's per-step training-data log) into a kldiag run.

Read at NVIDIA-NeMo/RL@7ea279ab (2026-08-22). nemo_rl/algorithms/grpo.py l. 3631-3653 builds
`log_data` from the step's `train_data` (`.tolist()` of [B, S] tensors):
content, rewards, input_lengths, token_ids (= input_ids, prompt + response, right padded),
token_loss_mask (1 on generated assistant tokens, grpo.py l. 1934-1937), sample_loss_mask
(the loss multiplier), advantages, generation_logprobs (the inference engine's, 0 off the
generated tokens), prev_logprobs (the trainer's recompute before the update; zeros when
force_on_policy_ratio skips it, l. 3247). nemo_rl/utils/logger.py l. 1071-1096
(`log_batched_dict_as_jsonl`) writes one line per sample, from `make_microbatch_iterator(1)`:
every value is a one-element list (`{"token_ids": [[...]], "input_lengths": [L], ...,
"idx": i}`), to {log_dir}/train_data_step{total_steps + 1}.jsonl, the driver only.
Log-probs are aligned with the token they score (position t holds log p(token_t | <t);
dtensor_policy_worker.py l. 1281 prepends 0). No reference or current-policy log-probs.

Mapping: step = N of the file name, rank = 0 (one driver-side file per step), seq = N * 2**32
+ idx, group = idx // group_size (GRPO repeats each prompt num_generations_per_prompt times,
contiguously: BatchedDataDict.repeat_interleave), tokens from the first loss-mask token to
input_length; logp = prev_logprobs (generation_logprobs when prev_logprobs is all zeros),
logp_sampler = generation_logprobs, advantage = advantages, mask = token_loss_mask *
sample_loss_mask, token_id = token_ids.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kldiag.errors import DumpError, UnsupportedDumpVersionError
from kldiag.frameworks import sampling as sampling_settings
from kldiag.importers.sink import TOKEN_FIELDS, Sequence

NAME = "nemo-rl"
DUMP_VERSION = "grpo-train-data-jsonl"
PATTERN = "train_data_step{N}.jsonl"
COLUMNS = TOKEN_FIELDS
MISSING = ("logp_old", "logp_ref", "entropy")
FILE_RE = re.compile(r"^train_data_step(\d+)\.jsonl$")
REQUIRED = ("input_lengths", "token_ids", "token_loss_mask", "generation_logprobs", "prev_logprobs")
SEQ_STEP_SHIFT = 32


def list_files(src: Path) -> tuple[list[Path], list[Path]]:
    """(train_data_step files in step order, []). A file is written in one go by the driver."""
    if src.is_file():
        return [src], []
    files = [p for p in src.rglob("train_data_step*.jsonl") if FILE_RE.match(p.name)]
    return sorted(files, key=lambda p: (int(FILE_RE.match(p.name).group(1)), p.as_posix())), []


# The run config's keys the crosswalk's NeMo-RL reduction and the fixes read: (section, key) -> manifest key.
# A step of several global batches is logged as the mean of their token means (grpo.py's train loop).
RUN_CONFIG_KEYS = {("policy", "train_global_batch_size"): "train_global_batch_size",
                   ("grpo", "num_prompts_per_step"): "num_prompts_per_step",
                   ("grpo", "num_generations_per_prompt"): "num_generations_per_prompt",
                   ("loss_fn", "reference_policy_kl_type"): "reference_policy_kl_type",
                   ("loss_fn", "force_on_policy_ratio"): "force_on_policy_ratio",
                   ("loss_fn", "reference_policy_kl_penalty"): "beta"}


def read_run_config(path: str | Path) -> dict[str, Any]:
    """The run's own NeMo-RL config (the YAML it was launched with, e.g. grpo_math_1B.yaml, or a JSON
    dump of it) as import options: the RUN_CONFIG_KEYS, `generation` (policy.generation) and group_size
    (grpo.num_generations_per_prompt). OmegaConf interpolations (${...}) are left out."""
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        cfg = json.loads(text)
    else:
        try:
            import yaml
        except ImportError as e:
            raise DumpError(f"{path}: reading a YAML config needs PyYAML: pip install pyyaml "
                            "(or pass the config as JSON)") from e
        cfg = yaml.safe_load(text)
    if not isinstance(cfg, dict):
        raise DumpError(f"{path}: not a NeMo-RL config (expected a mapping with policy:, grpo:, loss_fn:)")
    out: dict[str, Any] = {}
    for (section, key), name in RUN_CONFIG_KEYS.items():
        value = (cfg.get(section) or {}).get(key)
        if value is not None and not (isinstance(value, str) and "${" in value):
            out[name] = value
    generation = (cfg.get("policy") or {}).get("generation")
    if isinstance(generation, dict):
        out["generation"] = {k: v for k, v in generation.items() if not (isinstance(v, str) and "${" in v)}
    if out.get("num_generations_per_prompt"):
        out["group_size"] = int(out["num_generations_per_prompt"])
    return out


def config(options: dict[str, Any]) -> dict[str, Any]:
    """The manifest config from the import options: group_size, the run config's RUN_CONFIG_KEYS
    (read_run_config), and `generation` (the run's policy.generation dict: temperature, top_p, top_k,
    backend) as config["engine_sampling"]."""
    out = {"group_size": options["group_size"]} if options.get("group_size") else {}
    out.update({k: options[k] for k in RUN_CONFIG_KEYS.values() if options.get(k) is not None})
    if options.get("generation"):
        out["engine_sampling"] = sampling_settings.from_nemo_rl(options["generation"])
    return out


def world_size(files: list[Path], options: dict[str, Any]) -> int:
    return 1


def read_file(path: Path, options: dict[str, Any]) -> Iterator[Sequence]:
    m = FILE_RE.match(path.name)
    if m is None:
        raise DumpError(f"{path.name} is not named train_data_step{{N}}.jsonl")
    step = int(m.group(1))
    group_size = options.get("group_size")
    for line_no, row in jsonl_rows(path):
        yield to_sequence(row, step, line_no, group_size)


def jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-empty line of a whole JSONL file (NeMo-RL and prime-rl dumps)."""
    check_tail(path)
    with path.open("rb") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except ValueError as e:
                raise DumpError(f"line {line_no} is not JSON ({e})") from e


def check_tail(path: Path) -> None:
    """A file cut short (a crash mid-write) ends without a newline: refuse it before reading."""
    with path.open("rb") as f:
        f.seek(0, 2)
        if f.tell() == 0:
            raise DumpError("empty file")
        f.seek(-1, 2)
        if f.read(1) != b"\n":
            raise DumpError("truncated (the last line has no newline)")


def _one(row: dict[str, Any], key: str) -> Any:
    """The sample's value: log_batched_dict_as_jsonl stores every key as a one-element list."""
    v = row[key]
    if not isinstance(v, list) or len(v) != 1:
        raise UnsupportedDumpVersionError(
            f"field {key!r} is not a one-element list as NeMo-RL@7ea279ab writes it (got "
            f"{type(v).__name__}); this kldiag reads the {DUMP_VERSION} layout of that version")
    return v[0]


def to_sequence(row: Any, step: int, line_no: int, group_size: int | None) -> Sequence:
    if not isinstance(row, dict) or any(k not in row for k in REQUIRED):
        missing = [k for k in REQUIRED if not isinstance(row, dict) or k not in row]
        raise DumpError(f"line {line_no} is not a NeMo-RL train_data record (no {', '.join(missing)})")
    idx = int(row.get("idx", line_no - 1))
    length = int(_one(row, "input_lengths"))
    tokens = np.asarray(_one(row, "token_ids"), np.int64)[:length]
    loss = np.asarray(_one(row, "token_loss_mask"), np.int64)[:length] != 0
    sample_mask = float(_one(row, "sample_loss_mask")) if "sample_loss_mask" in row else 1.0
    gen = _floats(_one(row, "generation_logprobs"))[:length]
    prev = _floats(_one(row, "prev_logprobs"))[:length]
    first = int(np.argmax(loss)) if loss.any() else length
    sl = slice(first, length)
    logp, sampler = prev[sl], gen[sl]
    if not np.any(prev[loss]):  # force_on_policy_ratio: prev_logprobs were zeros, never computed
        logp, sampler = gen[sl], None
    adv = None
    if "advantages" in row:
        a = _one(row, "advantages")
        adv = _floats(a)[:length][sl] if isinstance(a, list) else np.full(length - first, a, np.float32)
    return Sequence(step=step, rank=0, seq=(step << SEQ_STEP_SHIFT) + idx,
                    group=idx // int(group_size) if group_size else None, logp=logp,
                    mask=loss[sl] & (sample_mask != 0), logp_sampler=sampler, advantage=adv,
                    token_ids=tokens[sl].astype(np.int32))


def _floats(v: Any) -> np.ndarray:
    """float32 array; JSON null (json.dumps wrote a non-finite value as a string or null) is NaN."""
    return np.array([np.nan if x is None or isinstance(x, str) else x for x in v], np.float32) \
        if any(x is None or isinstance(x, str) for x in v) else np.asarray(v, np.float32)
