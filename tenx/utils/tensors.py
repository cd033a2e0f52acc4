"""Small tensor helpers shared by the parallel code, the checks and the fault injector."""

from __future__ import annotations

from typing import Any


def local_tensor(t: Any) -> Any:
    """This rank's part of `t`: a DTensor's local shard (FSDP2), else `t` itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t
