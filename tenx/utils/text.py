"""Text for messages and reports: `counted` puts a noun in the number it needs; `first_line` shortens an
error to what one message line can hold."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it needs: "1 incident", "2 incidents", "1 root cause"."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error's text (its type's name when it has none), at most `limit` characters."""
    text = str(error).strip().splitlines()
    return (text[0] if text else type(error).__name__)[:limit]
