"""HTML tables of the report: every cell escaped here (cells are plain text, token text included)."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from typing import Any


def html_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """An HTML table of `header` and `rows` (each cell shown as str())."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def frame_table(df: Any, cell: Callable[[Any], str]) -> str:
    """A pandas DataFrame as an HTML table: strings as they are, other values through `cell`."""
    rows = [[v if isinstance(v, str) else cell(v) for v in row] for row in df.itertuples(index=False)]
    return html_table([str(c) for c in df.columns], rows)
