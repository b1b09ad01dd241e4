"""Pages of a list result, bounded in size: an agent's context is small and a run's tables are not."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kldiag.errors import KldiagError

DEFAULT_LIMIT = 50  # items per page unless asked
MAX_LIMIT = 500  # items per page at most
MAX_CHARS = 60_000  # JSON characters of one page's items at most (about 15k tokens)


class AgentToolError(KldiagError, ValueError):
    """A bad tool argument (the message names the fix)."""


def page(items: Sequence[Any], offset: int = 0, limit: int = DEFAULT_LIMIT, key: str = "items",
         max_chars: int = MAX_CHARS) -> dict[str, Any]:
    """{key: items[offset:offset+limit], "total", "offset", "next_offset"} with at most `max_chars` of
    JSON items (at least one item per page); next_offset is None on the last page."""
    offset, limit = int(offset), int(limit)
    if offset < 0 or not 1 <= limit <= MAX_LIMIT:
        raise AgentToolError(f"offset={offset}, limit={limit}: use offset >= 0 and 1 <= limit <= {MAX_LIMIT}")
    out: list[Any] = []
    size = 0
    for item in items[offset:offset + limit]:
        size += len(json.dumps(item, default=str)) + 2
        if out and size > max_chars:
            break
        out.append(item)
    end = offset + len(out)
    return {key: out, "total": len(items), "offset": offset, "next_offset": end if end < len(items) else None}
