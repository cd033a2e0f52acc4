"""A warm spare for the supervisor: import torch and tenx now, read the command line later.

`python -m tenx.commands.worker` imports everything a training run needs, then blocks on one line of
stdin holding the JSON list of `tenx` arguments; it runs them and exits with their status. End of input
without a line exits 0 (the supervisor no longer needs the spare).
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    """Import, wait for arguments, run them."""
    import torch

    import tenx.cli
    import tenx.train.run  # noqa: F401  (the heavy imports are the point of a warm spare)

    # The first optimizer construction imports torch._dynamo lazily (~0.7 s on a small CPU): do it now.
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])

    line = sys.stdin.readline()
    if not line.strip():
        return 0
    argv = json.loads(line)
    sys.stdin.close()
    return tenx.cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
