"""`python -m tenx` runs the `tenx` command."""

from tenx.cli import entry

entry()
