"""slime train dumps (`--save-debug-train-data PATH`, `--dump-details DIR`) into a kldiag run.

Read at THUDM/slime@624b824a (2026-08-21), slime/observability/train_data_utils.py:
`save_debug_train_data` (l. 191-242) has the last-PP-stage, TP0, CP0 data-parallel source
rank gather every DP shard's `rollout_data` and `torch.save` `_build_dump_payload` (l. 112-188):

    {"format_version": 2, "rollout_id": R, "rank": writer_rank, "dp_shards": [layout per DP rank],
     "samples": [{"data_parallel_rank", "sample_index", "rollout_position", "tokens",
                  "response_lengths", "total_lengths", "loss_masks", "log_probs",
                  "ref_log_probs", "rollout_log_probs", "advantages", "entropy", ...}, ...]}

one file per rollout (`--dump-details DIR` writes DIR/train_data/{rollout_id}.pt, l. 1890 of
slime/utils/arguments.py, next to the rollout dump DIR/rollout_data/{rollout_id}.pt whose
`samples[rollout_position]` is the same sample, with its `group_index`). `tokens` is prompt +
response; every per-token field covers the `response_lengths` response tokens.
Mapping: step = rollout_id, rank = data_parallel_rank, seq = rollout_id * 2**32 +
rollout_position (else sample_index), group = the rollout dump's group_index, else
rollout_position // group_size; logp = log_probs (slime's pi_old recompute, or the
training forward's log-probs captured when it was not recomputed, actor.py l. 521-541),
logp_ref = ref_log_probs, logp_sampler = rollout_log_probs, advantage = advantages,
mask = loss_masks, entropy = entropy, token_id = the response tokens; policy_version (format v1.3)
from a sample's `weight_versions` where it has them (`slime_policy_version`): slime's train dumps do
not (slime keeps `Sample.weight_versions` in the rollout dumps only), Miles' train data does.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kldiag.errors import DumpError, UnsupportedDumpVersionError
from kldiag.frameworks import slime as slime_frameworks
from kldiag.importers.sink import TOKEN_FIELDS, Sequence

NAME = "slime"
DUMP_VERSION = "2"
KNOWN_VERSIONS = (2,)
PATTERN = "train_data/*.pt or *.pt files of --save-debug-train-data"
COLUMNS = TOKEN_FIELDS
MISSING = ("logp_old",)
SEQ_STEP_SHIFT = 32


def list_files(src: Path) -> tuple[list[Path], list[Path]]:
    """(dump files in rollout order, []): slime writes each file in one torch.save."""
    if src.is_file():
        return [src], []
    root = src / "train_data" if (src / "train_data").is_dir() else src
    files = [p for p in root.rglob("*.pt") if "rollout_data" not in p.relative_to(root).parts]
    return sorted(files, key=_natural), []


def _natural(p: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.as_posix())]


def config(options: dict[str, Any]) -> dict[str, Any]:
    """Manifest config keys: slime's KL options when given (the dumps do not carry args)."""
    out: dict[str, Any] = {"kl_semantics": "slime"}
    for key in ("kl_loss_type", "use_unbiased_kl", "kl_loss_coef"):
        if options.get(key) is not None:
            out[key] = options[key]
    estimator = slime_frameworks.estimator_name(options.get("kl_loss_type"), options.get("use_unbiased_kl"))
    if estimator is not None:
        out["estimator"] = estimator
    if options.get("kl_loss_coef") is not None:
        out["beta"] = options["kl_loss_coef"]
    return out


def load(path: Path, trust_pickle: bool = False) -> Any:
    """torch.load with weights_only=True; full unpickling only with trust_pickle."""
    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as e:
        if not trust_pickle and "Unsupported global" in str(e):
            raise DumpError(f"{path} needs more than torch.load(weights_only=True) to open (it pickles "
                            f"{_global(str(e))}); pass --trust-pickle to load it fully, only for a run you "
                            "trust (unpickling runs code)") from e
        raise DumpError(f"{path} is not a torch.save file ({_weights_error(str(e))})") from e
    except (RuntimeError, EOFError, ValueError, OSError, AttributeError, ImportError) as e:
        raise DumpError(f"{path} is truncated or not a torch.save file ({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _weights_error(message: str) -> str:
    m = re.search(r"WeightsUnpickler error:\s*(.+?)\n", message)
    return m.group(1).strip() if m else _first_line(RuntimeError(message))


def _global(message: str) -> str:
    m = re.search(r"GLOBAL ([\w.]+)", message)
    return m.group(1) if m else "an object other than tensors and plain containers"


_LOADED: dict[Path, Any] = {}  # the file world_size loaded, handed to read_file once


def world_size(files: list[Path], options: dict[str, Any]) -> int:
    """The DP world size from the layout of the first readable file (1 when none reads)."""
    _LOADED.clear()
    for path in files:
        try:
            payload = load(path, bool(options.get("trust_pickle")))
        except DumpError:
            continue
        _LOADED[path] = payload
        if isinstance(payload, dict):
            shards = payload.get("dp_shards") or []
            ranks = [int(s.get("data_parallel_rank", 0)) for s in shards if isinstance(s, dict)]
            samples = payload.get("samples") or []
            ranks += [int(s.get("data_parallel_rank", 0)) for s in samples if isinstance(s, dict)]
            return max([len(shards), *(r + 1 for r in ranks), 1])
    return 1


def read_file(path: Path, options: dict[str, Any]) -> Iterator[Sequence]:
    payload = _LOADED.pop(path, None)
    if payload is None:
        payload = load(path, bool(options.get("trust_pickle")))
    check_payload(payload, path)
    rollout_id = int(payload["rollout_id"])
    groups = rollout_groups(path, rollout_id, options)
    for i, sample in enumerate(payload["samples"]):
        yield to_sequence(sample, rollout_id, i, groups, options.get("group_size"))


def check_payload(payload: Any, path: Path) -> None:
    """The format guard: a dict with format_version 2, rollout_id and a samples list."""
    if not isinstance(payload, dict) or "samples" not in payload:
        raise DumpError(f"{path} is not a slime train dump (no 'samples'; a rollout dump or another file)")
    version = payload.get("format_version")
    if version is None or "rollout_id" not in payload:
        raise DumpError(f"{path} is not a slime train dump (no format_version/rollout_id)")
    if version not in KNOWN_VERSIONS:
        raise UnsupportedDumpVersionError(
            f"{path} is a slime train dump of format_version {version!r}; this kldiag reads format_version "
            f"{', '.join(map(str, KNOWN_VERSIONS))} (slime@624b824a); upgrade kldiag or convert the dump")


def rollout_groups(path: Path, rollout_id: int, options: dict[str, Any]) -> list[int | None] | None:
    """group_index per rollout position from DIR/rollout_data/{rollout_id}.pt (--dump-details)."""
    candidate = path.parent.parent / "rollout_data" / f"{rollout_id}.pt"
    if path.parent.name != "train_data" or not candidate.is_file():
        return None
    try:
        dump = load(candidate, bool(options.get("trust_pickle")))
        return [s.get("group_index") if isinstance(s, dict) else None for s in dump["samples"]]
    except (DumpError, KeyError, TypeError):
        return None


def to_sequence(sample: dict[str, Any], rollout_id: int, i: int, groups: list[int | None] | None,
                group_size: int | None) -> Sequence:
    """One sample dict of the payload as a Sequence (response tokens only)."""
    n = int(sample["response_lengths"])
    position = sample.get("rollout_position")
    index = position if position is not None else sample.get("sample_index")
    index = int(index) if index is not None else i
    seq = (rollout_id << SEQ_STEP_SHIFT) + index
    group = None
    if groups is not None and position is not None and position < len(groups):
        group = groups[position]
    elif group_size and position is not None:
        group = int(position) // int(group_size)
    tokens = _arr(sample.get("tokens"), np.int64)
    logp = _token(sample, "log_probs", n)
    sampler = _token(sample, "rollout_log_probs", n)
    if logp is None:  # neither recomputed nor captured: the sampler's are all there is
        logp, sampler = sampler, None
    if logp is None:
        raise DumpError(f"sample {i} of rollout {rollout_id} has neither log_probs nor rollout_log_probs")
    mask = _token(sample, "loss_masks", n)
    return Sequence(step=rollout_id, rank=int(sample.get("data_parallel_rank", 0)), seq=seq, group=group,
                    logp=logp, mask=np.ones(n, bool) if mask is None else mask != 0,
                    logp_ref=_token(sample, "ref_log_probs", n), logp_sampler=sampler,
                    entropy=_token(sample, "entropy", n), advantage=_token(sample, "advantages", n),
                    token_ids=tokens[-n:].astype(np.int32) if tokens is not None and n else None,
                    experts_sampler=response_routes(sample.get("rollout_routed_experts"), n),
                    policy_version=sample_versions(sample, n, None if mask is None else mask != 0))


def response_routes(routes: Any, n: int) -> np.ndarray | None:
    """The engine's routes of the n response tokens' log-probs, [n, L, k], from slime's `rollout_routed_experts`
    [len(tokens) - 1, L, k] int32 (one row per token fed to SGLang, none for the last sampled token;
    THUDM/slime@624b824a `slime/utils/types.py` `_apply_meta_info`): response token j's log-prob comes from
    input position len(tokens) - n + j - 1, so the last n rows."""
    a = _arr(routes, np.int64)
    if a is None or a.ndim != 3 or n == 0 or len(a) < n:
        return None
    return a[-n:]


def sample_versions(sample: dict[str, Any], n: int, mask: np.ndarray | None) -> int | np.ndarray | None:
    """The sample's policy_version: per token [n] from Miles' `response_weight_version_segments` where they cover
    its response (`segment_versions`), else one from `weight_versions` (`slime_policy_version`)."""
    per_token = segment_versions(sample.get("response_weight_version_segments"), n, mask)
    return per_token if per_token is not None else slime_policy_version(sample.get("weight_versions"))


def segment_versions(segments: Any, n: int, mask: np.ndarray | None) -> np.ndarray | None:
    """[n] int64 policy_version per response token from Miles' `Sample.response_weight_version_segments`: per SGLang
    generate call, `[[start, end, version], ...]` over that call's output tokens (offsets from 0 in each call;
    `--sglang-enable-response-weight-version-segments`, radixark/miles `miles/utils/types.py`). The calls' tokens,
    in order, are the n response tokens (one call) or the response tokens in the loss (multi-turn: tool tokens
    between calls take the version before them). Versions shift by one as in `slime_policy_version`. None when
    the segments are absent or do not cover the response so."""
    if not segments or n == 0:
        return None
    try:
        calls = [segments] if np.ndim(segments[0]) == 1 else segments
        flat = np.concatenate([np.repeat(np.int64(v), int(b) - int(a)) for call in calls for a, b, v in call])
    except (TypeError, ValueError, IndexError):
        return None
    if len(flat) == n:
        return flat - 1
    keep = mask if mask is not None else np.ones(n, bool)
    if len(flat) != int(keep.sum()) or not len(flat):
        return None
    at = np.maximum(np.cumsum(keep) - 1, 0)  # the last generated token at or before each position
    return flat[at] - 1


def slime_policy_version(weight_versions: Any) -> int | None:
    """A sample's `weight_versions` (list of str, one per SGLang generate call, slime/utils/types.py) as
    the rollout id whose weights generated it: the oldest numeric version - 1. slime's update_weights
    increments its version before each sync (update_weight_from_distributed.py) and train.py syncs once
    before rollout 0, so a synchronous rollout r is generated by version r + 1. None without a number."""
    if weight_versions is None or isinstance(weight_versions, (str, bytes)):
        weight_versions = [weight_versions] if weight_versions is not None else []
    nums = [int(v) for v in weight_versions if str(v).strip().lstrip("-").isdigit()]
    return min(nums) - 1 if nums else None


def _arr(v: Any, dtype: Any) -> np.ndarray | None:
    if v is None:
        return None
    if hasattr(v, "detach"):  # a torch tensor, possibly on the GPU (the live hook)
        v = (v.detach().float() if v.is_floating_point() else v.detach()).cpu().numpy()
    return np.asarray(v, dtype=dtype)


def _token(sample: dict[str, Any], key: str, n: int) -> np.ndarray | None:
    """A per-response-token field as float32 [n]; a scalar (per-sample) value is broadcast."""
    v = _arr(sample.get(key), np.float32)
    if v is None:
        return None
    if v.ndim == 0:
        return np.full(n, v, np.float32)
    if v.shape != (n,):
        raise DumpError(f"field {key!r} has shape {v.shape}, expected ({n},) (response_lengths)")
    return v
