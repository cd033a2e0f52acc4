"""Words for numbers in messages and reports: `counted` puts a noun in the number it needs."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and the noun in the number it needs: "1 incident", "2 incidents", "1 root cause"."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
