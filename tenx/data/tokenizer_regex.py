"""The regular expressions inside a Hugging Face tokenizer.json, and the ones tenx refuses to run.

`tokenizers` matches Split pre-tokenizers and Replace normalizers/decoders with Oniguruma, a backtracking
engine. A group that repeats and itself repeats or alternates (`(a+)+$`, `(a|aa)*`) can take exponential time
on some text; Oniguruma then stops at its retry limit by panicking inside the worker that encodes. The
pre-tokenizer patterns of byte-level BPE (GPT-2's, Llama 3's, Qwen's, DeepSeek's, o200k's) never do this: their
only repeated atoms are single characters and character classes, and their only quantified group is optional
(`(?i:'s|'t|...)?`). So tenx refuses such a pattern, naming it, before any text is encoded; a pattern that
passes this check and still hits the retry limit on some document ends the run with an error naming it
(tenx/data/prepare/stream.py), never a hang."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

MAX_REGEX_CHARS = 4096
"""The longest pattern accepted (GPT-2's is 80 characters, DeepSeek-V3's longest 190)."""


def tokenizer_regexes(tokenizer_json: str) -> list[tuple[str, str]]:
    """(where, pattern) of every regular expression in a tokenizer.json text: `{"Regex": ...}` objects, which
    Split pre-tokenizers and Replace normalizers and decoders hold (a `{"String": ...}` is matched literally)."""
    try:
        tree = json.loads(tokenizer_json)
    except ValueError:
        return []
    return list(_walk(tree, ""))


def _walk(node: Any, where: str) -> Iterator[tuple[str, str]]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "Regex" and isinstance(value, str):
                yield where or "Regex", value
            elif key not in ("model", "added_tokens"):  # the vocabulary and merges hold no patterns
                yield from _walk(value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{where}[{i}]")


def backtracking_problem(pattern: str) -> str | None:
    """Why `pattern` can backtrack exponentially (a repeated group that repeats or alternates inside, a
    backreference), or None when its repetitions are all of single atoms. Oniguruma syntax: escapes, nested
    character classes, (?...) groups, and the quantifiers * + ? {n} {n,} {n,m} {,m} with lazy/possessive
    suffixes."""
    if len(pattern) > MAX_REGEX_CHARS:
        return f"it is {len(pattern):,} characters long (at most {MAX_REGEX_CHARS:,})"
    # One frame per open group: [has a quantifier inside, has an alternation inside].
    stack: list[list[bool]] = [[False, False]]
    last_group: list[bool] | None = None  # the group just closed, which a quantifier would repeat
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        closed: list[bool] | None = None
        if c == "\\":
            nxt = pattern[i + 1 : i + 3]
            if nxt[:1] in tuple("123456789") or nxt in ("k<", "k'", "g<", "g'"):
                return "it has a backreference or a subroutine call"
            i = _escape_end(pattern, i)
        elif c == "[":
            i = _class_end(pattern, i)
        elif c == "(":
            i, opens = _group_start(pattern, i)
            if opens:
                stack.append([False, False])
        elif c == ")":
            if len(stack) > 1:
                closed = stack.pop()
                stack[-1][0] |= closed[0]
                stack[-1][1] |= closed[1]
            i += 1
        elif c == "|":
            stack[-1][1] = True
            i += 1
        elif c in "*+?{":
            end, repeats = _quantifier(pattern, i)
            if end == i:  # a literal "{"
                i += 1
            else:
                stack[-1][0] = True
                if repeats and last_group is not None and (last_group[0] or last_group[1]):
                    inside = "a repetition" if last_group[0] else "an alternation"
                    return f"a group holding {inside} is itself repeated (it can backtrack exponentially)"
                i = end
                last_group = None
                continue
        else:
            i += 1
        last_group = closed
    return None


def _group_start(pattern: str, i: int) -> tuple[int, bool]:
    """(index after the opening at i of a group and its (?...) prefix, whether a group opens): (?#...) comments
    and (?imx) option switches open none."""
    n = len(pattern)
    if pattern[i + 1 : i + 2] != "?":
        return i + 1, True
    j = i + 2
    if pattern[j : j + 1] == "#":
        close = pattern.find(")", j)
        return (n if close < 0 else close + 1), False
    if pattern[j : j + 1] in ("=", "!", ">", ":"):
        return j + 1, True
    if pattern[j : j + 1] == "<":
        if pattern[j + 1 : j + 2] in ("=", "!"):
            return j + 2, True
        close = pattern.find(">", j)
        return (n if close < 0 else close + 1), True
    while j < n and (pattern[j].isalpha() or pattern[j] == "-"):
        j += 1
    if pattern[j : j + 1] == ")":
        return j + 1, False
    return min(j + 1, n), True


def _escape_end(pattern: str, i: int) -> int:
    """The index after an escape at i: \\p{...}, \\x{...} or a two-character escape."""
    if pattern[i + 1 : i + 2] in ("p", "P", "x", "o") and pattern[i + 2 : i + 3] == "{":
        close = pattern.find("}", i + 3)
        return len(pattern) if close < 0 else close + 1
    return min(i + 2, len(pattern))


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at i (classes nest in Oniguruma)."""
    depth, j, n = 0, i, len(pattern)
    while j < n:
        c = pattern[j]
        if c == "\\":
            j += 2
            continue
        if c == "[":
            depth += 1
            j += 1
            if j < n and pattern[j] == "^":
                j += 1
            if j < n and pattern[j] == "]":  # a "]" first in a class is a literal
                j += 1
            continue
        if c == "]":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return n


def _quantifier(pattern: str, i: int) -> tuple[int, bool]:
    """(index after the quantifier at i, whether it can repeat more than once); (i, False) when the "{" at i
    is a literal."""
    c, n = pattern[i], len(pattern)
    if c == "{":
        close = pattern.find("}", i)
        body = pattern[i + 1 : close] if close > 0 else ""
        low, comma, high = body.partition(",")
        if (
            close < 0
            or not (low.isdigit() or (comma and high.isdigit()))
            or not all(part == "" or part.isdigit() for part in (low, high))
        ):
            return i, False
        repeats = (comma and (high == "" or int(high) > 1)) or (not comma and int(low) > 1)
        end = close + 1
    else:
        repeats = c in "*+"
        end = i + 1
    if end < n and pattern[end] in "?+":  # lazy or possessive
        end += 1
    return end, bool(repeats)
