"""Which rows a run's ``--rows`` selects: the rule bench.run applies before a row runs and
bench.results applies when it reads back whose row a page's line is (no torch here)."""

from __future__ import annotations


def row_entries(rows: str) -> tuple[str, ...]:
    """The entries of a ``--rows`` value (comma-separated; empty ones dropped)."""
    return tuple(s for s in rows.split(",") if s)


def row_selected(name: str, entry: str) -> bool:
    """Whether one ``--rows`` entry selects row ``name``: ``=NAME`` the row of exactly that
    name, any other entry every row whose name holds it (``q1`` also holds ``q1 gfx942 tiles``)."""
    return name == entry[1:] if entry.startswith("=") else entry in name
