"""Turning an exception from a library (vLLM, DCP, pyarrow, TCPStore) into one line."""

from __future__ import annotations


def first_line(e: BaseException, limit: int = 300, empty: str | None = None) -> str:
    """The first line of `e`'s message, at most `limit` characters (library errors run to
    pages); for an empty message `empty`, or the exception type's name."""
    lines = str(e).strip().splitlines()
    if not lines:
        return type(e).__name__ if empty is None else empty
    return lines[0][:limit]
