"""A plain-text table: the console output when rich is not installed."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def format_table(
    title: str,
    header: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    right: Iterable[int] = (),
) -> str:
    """``title``, then the header and rows in aligned columns (two spaces apart).

    Args:
        title: the first line ("" for none).
        header: the column names.
        rows: the cells, as strings, one sequence per row.
        right: indices of the columns aligned right (numbers).
    """
    body = [list(header), *(list(row) for row in rows)]
    widths = [max(len(row[i]) for row in body) for i in range(len(header))]
    right = set(right)
    lines = [title] if title else []
    for row in body:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
