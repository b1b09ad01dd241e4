"""Importers: a framework's own per-token dumps into a kldiag run (`kldiag import FRAMEWORK SRC RUN`).

    from kldiag.importers import import_dumps
    result = import_dumps("slime", "/ckpt/dump_details", "runs/imported")

One module per framework, each owning its dump-format guard (docs/import.md has the
mapping tables): `slime` (torch.save payloads, format_version 2), `nemo_rl`
(train_data_step{N}.jsonl), `prime_rl` (token_exports/step_{N}/rank_{r}.jsonl). Each
module has `NAME`, `DUMP_VERSION`, `MISSING` (columns its dumps never have),
`list_files(src) -> (ready, pending)`, `world_size(files, options)` and
`read_file(path, options) -> Iterator[Sequence]`. Files are read one at a time and
streamed (jsonl line by line; a slime .pt file is one torch.load), so memory is bounded by
the largest dump file, not the run.
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path
from typing import Any

from kldiag.errors import DumpError, UnsupportedDumpVersionError
from kldiag.importers.sink import ImportResult, Sequence, Sink, previous_import

FRAMEWORKS = {"slime": "slime", "nemo-rl": "nemo_rl", "prime-rl": "prime_rl"}

__all__ = ["FRAMEWORKS", "ImportResult", "Sequence", "import_dumps", "module"]


def module(framework: str) -> Any:
    """The importer module of `framework` (a name of FRAMEWORKS)."""
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework {framework!r}; pass one of {', '.join(FRAMEWORKS)}")
    return importlib.import_module(f"kldiag.importers.{FRAMEWORKS[framework]}")


def import_dumps(framework: str, src: str | os.PathLike, run: str | os.PathLike, *, strict: bool = False,
                 **options: Any) -> ImportResult:
    """Import every dump file of `src` not imported into `run` before.

    A corrupt or foreign file is skipped with a warning naming it (strict: DumpError); an
    unknown dump format version and an empty source are errors. `options` go to the
    framework's reader (slime: trust_pickle, group_size, kl_loss_type, use_unbiased_kl;
    nemo-rl: group_size; ...).
    """
    mod = module(framework)
    src = Path(src)
    if not src.exists():
        raise DumpError(f"{src} does not exist; pass the directory the {framework} job dumped into")
    ready, pending = mod.list_files(src)
    if not ready and not pending:
        raise DumpError(f"{src} holds no {framework} dump files ({mod.PATTERN}); pass the directory "
                        f"the {framework} job dumped into")
    before = previous_import(run)
    if before and (before.get("framework"), before.get("source")) != (framework, str(src.resolve())):
        raise DumpError(f"{run} was imported from {before.get('framework')} {before.get('source')}; "
                        "import into a new run directory")
    done = dict(before.get("files") or {})
    result = ImportResult(run=str(run), framework=framework, pending=[_rel(p, src) for p in pending])
    todo = [p for p in ready if _rel(p, src) not in done]
    result.already = [_rel(p, src) for p in ready if _rel(p, src) in done]
    if not todo:
        result.missing = list(before.get("missing") or mod.MISSING)
        return result
    config = {**(before.get("config") or {}), **mod.config(options)}  # options given now win
    # run.json keeps the previous import record until this one ends (an interrupted import
    # leaves the files it did not finish to the next one)
    started = {"framework": framework, "source": str(src.resolve()), "dump_version": mod.DUMP_VERSION,
               "files": dict(done), **{k: v for k, v in before.items() if k not in ("files",)}}
    sink = Sink(run, framework=framework, dump_version=mod.DUMP_VERSION, config={**config, "import": started},
                world_size=max(int(mod.world_size(todo, options)), int(before.get("world_size") or 1)))
    try:
        for path in todo:
            name = _rel(path, src)
            why = read_one(mod, path, name, sink, options, strict, run)
            if why is not None:
                warnings.warn(f"kldiag import: skipping {name}: {why}", RuntimeWarning, stacklevel=2)
                result.skipped.append((name, why))
                continue
            done[name] = path.stat().st_size
            result.imported.append(name)
    except BaseException:
        sink.abort()
        raise
    present = set(before.get("present") or ()) | sink.present
    result.missing = [c for c in mod.COLUMNS if c not in present]
    state = {"framework": framework, "source": str(src.resolve()), "dump_version": mod.DUMP_VERSION,
             "files": done, "present": sorted(present),
             "missing": result.missing, "config": config}
    sink.close(state)
    result.sequences, result.tokens, result.steps = sink.sequences, sink.tokens, sorted(sink.steps)
    result.placeholders = sink.placeholders
    return result


def read_one(mod: Any, path: Path, name: str, sink: Sink, options: dict[str, Any], strict: bool,
             run: str | os.PathLike) -> str | None:
    """Feed one dump file to the sink; the reason it was skipped, or None.

    A file that breaks off after some of its sequences went to the run is an error (its rows
    cannot be taken back); so are unknown format versions and pickles that need trust.
    """
    added = 0
    try:
        try:
            for s in mod.read_file(path, options):
                sink.add(s)
                added += 1
        except (KeyError, TypeError, IndexError) as e:
            raise DumpError(f"a record lacks or mistypes a field the {mod.NAME} writer always sets "
                            f"({type(e).__name__}: {e})") from e
    except UnsupportedDumpVersionError:
        raise
    except DumpError as e:
        if added:
            raise DumpError(f"{name} broke off after {added} sequences had been imported ({e}); delete "
                            f"{run}, move the file away, and import again") from e
        if strict or "--trust-pickle" in str(e):
            raise
        return str(e)
    return None


def _rel(path: Path, src: Path) -> str:
    return path.name if src.is_file() else path.relative_to(src).as_posix()
