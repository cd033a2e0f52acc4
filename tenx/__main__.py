"""`python -m tenx` runs the `tenx` command."""

import sys

from tenx.cli import main

sys.exit(main())
