"""The token ids around given tokens of a run: as the analysis's pass kept them, else read where they are.

The report lists a run's worst tokens (largest |k3 weight|, from the analysis's flags table) with
`width` token ids on each side in their sequence. A token is keyed by (step, rank, seq, iteration,
pos). The analysis's pass keeps the context of every flagged token as it reads its batch
(kldiag.analysis.core.around, Analysis.flag_context): `of_flagged` takes it from there, so the
report reads no part again. A token it lacks (a width above around.WIDTH, rows out of pos order) is
read by `around`: its sequence lives in the parts of its rank whose step range holds its step, and
within a part in the row groups whose `step` statistics (written for every part) hold it
(format.Run.read_rows); only those row groups are read, five columns of them.

Rows superseded by a later attempt of their rank are not context (format.parts.superseded_mask), as
the analysis does not read them. A position outside the sequence has no token and is left out; a
null token id is -1.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag.analysis.core import around as kept
from kldiag.analysis.runtime import runner
from kldiag.format import PartInfo, Run

Key = tuple[int, int, int, int, int]  # (step, rank, seq, iteration, pos)
COLUMNS = ("step", "seq", "iteration", "pos", "token_id")
NULL_TOKEN = -1


def of_flagged(analysis, keys: Iterable[Key], width: int) -> dict[Key, tuple[list[int], list[int]]]:
    """`around` of the analysis's flagged tokens `keys`: from the context its pass kept (Analysis.flag_context),
    the parts it read (runner.parts_of) read only for a token whose context the pass could not keep."""
    keys = list(dict.fromkeys(tuple(int(x) for x in k) for k in keys))
    out = {}
    for k in keys:
        ctx = analysis.flag_context.get(k) if width <= kept.WIDTH else None
        if ctx is not None and not (ctx == kept.UNKNOWN).any():
            out[k] = ([int(t) for t in ctx[kept.WIDTH - width:kept.WIDTH] if t != kept.ABSENT],
                      [int(t) for t in ctx[kept.WIDTH:kept.WIDTH + width] if t != kept.ABSENT])
    rest = [k for k in keys if k not in out]
    if rest:
        out.update(around(*runner.parts_of(analysis), rest, width))
    return out


def around(run: Run, parts: Sequence[PartInfo], keys: Iterable[Key],
           width: int) -> dict[Key, tuple[list[int], list[int]]]:
    """Of `parts` of `run`: key -> (token ids of the `width` positions before, of the `width` after), each in pos order,
    positions the sequence does not have left out. A key whose sequence no part holds maps to ([], []).
    """
    keys = list(dict.fromkeys(tuple(int(x) for x in k) for k in keys))
    ids: dict[tuple[int, int, int, int], dict[int, int]] = defaultdict(dict)  # sequence -> {pos: token id}
    for part, wanted in _parts_for(parts, keys).items():
        seqs = {(s, q, it) for s, _r, q, it, _p in wanted}
        t = _read(run, part, sorted({s for s, *_ in wanted}), sorted({q for _s, q, _it in seqs}))
        for s, q, it, p, tok in zip(*(t[c] for c in COLUMNS), strict=True):
            if (s, q, it) in seqs:
                ids[(s, part.rank, q, it)][p] = tok
    out = {}
    for s, r, q, it, p in keys:
        rows = ids.get((s, r, q, it), {})
        out[(s, r, q, it, p)] = ([rows[x] for x in range(p - width, p) if x in rows],
                                 [rows[x] for x in range(p + 1, p + width + 1) if x in rows])
    return out


def _parts_for(parts: Sequence[PartInfo], keys: list[Key]) -> dict[PartInfo, list[Key]]:
    """The parts that can hold each key's sequence: its rank's parts whose step range holds its step."""
    out: dict[PartInfo, list[Key]] = defaultdict(list)
    for part in parts:
        for k in keys:
            if k[1] == part.rank and part.step_min <= k[0] <= part.step_max:
                out[part].append(k)
    return out


def _read(run: Run, part: PartInfo, steps: list[int], seqs: list[int]) -> dict[str, list[int]]:
    """COLUMNS of the part's rows at `steps` whose seq is one of `seqs`, as lists (a few sequences' rows:
    Run.read_rows), superseded rows dropped; iteration 0 and token id NULL_TOKEN where null."""
    want = pa.array(seqs, pa.int64())
    t = run.read_rows([part], steps, lambda b: pc.is_in(b.column("seq"), want), list(COLUMNS))
    fill = {"token_id": NULL_TOKEN}
    return {c: np.asarray(pc.fill_null(t.column(c), fill.get(c, 0)).to_numpy(zero_copy_only=False), np.int64).tolist()
            for c in COLUMNS}
