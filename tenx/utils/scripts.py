"""What tenx writes into the shell and Slurm scripts it emits: values checked or quoted, never pasted.

A shell command line quotes each value with `shlex.quote` (anything is safe there: a newline stays inside
the quotes). A `#SBATCH` directive cannot be quoted that way: sbatch reads it up to the end of its line and
splits it at blanks, so a value with a newline would start a shell command of its own and one with a blank
would be cut. `sbatch_value` refuses any such value, naming where it came from.
"""

from __future__ import annotations

import re

from tenx.errors import ConfigError

SBATCH_SAFE = re.compile(r"[A-Za-z0-9_.,:/@%+=-]+")
"""The characters a `#SBATCH` value may hold: names, lists, times, paths without blanks."""


def sbatch_value(value: object, what: str) -> str:
    """`value` as text for a `#SBATCH` line, or a ConfigError naming `what` (a flag or field) when it holds a
    blank, a newline, a quote or any other character outside SBATCH_SAFE."""
    text = str(value)
    if not SBATCH_SAFE.fullmatch(text):
        bad = sorted({c for c in text if not SBATCH_SAFE.fullmatch(c)})
        shown = ", ".join(repr(c) for c in bad[:5]) or "nothing (it is empty)"
        raise ConfigError(
            f"{what} {text!r} cannot go into a #SBATCH line: it holds {shown}; use letters, digits and "
            "_ . , : / @ % + = - only (a path with blanks: choose or link one without)"
        )
    return text


SLURM_TIME = re.compile(
    r"(?:\d+-\d+(?::\d+(?::\d+)?)?|\d+(?::\d+(?::\d+)?)?|INFINITE|UNLIMITED)", re.IGNORECASE
)
"""The time limits sbatch accepts: minutes, minutes:seconds, hours:minutes:seconds, days-hours,
days-hours:minutes, days-hours:minutes:seconds, or INFINITE / UNLIMITED."""


def slurm_time(value: object, what: str) -> str:
    """`value` as a `#SBATCH --time` value, or a ConfigError naming `what` when sbatch would not read it as a
    time limit (`forever`: the job would be rejected at submission, after the script was written)."""
    text = sbatch_value(value, what)
    if not SLURM_TIME.fullmatch(text):
        raise ConfigError(
            f"{what} {text!r} is not a Slurm time limit: give MINUTES, HH:MM:SS, D-HH, D-HH:MM:SS (e.g. "
            "1-00:00:00) or UNLIMITED"
        )
    return text
