"""Random-number state: seeding, and the Python and NumPy generators' state as plain JSON (for checkpoints)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch RNGs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def python_rng_state() -> list[Any]:
    """Python's `random` state as JSON-able data."""
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def set_python_rng_state(state: list[Any]) -> None:
    """Restore what python_rng_state returned."""
    random.setstate((state[0], tuple(state[1]), state[2]))


def numpy_rng_state() -> dict[str, Any]:
    """NumPy's global generator state as JSON-able data."""
    name, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return {
        "name": name,
        "keys": np.asarray(keys).tolist(),
        "pos": pos,
        "has_gauss": has_gauss,
        "cached": cached,
    }


def set_numpy_rng_state(s: dict[str, Any]) -> None:
    """Restore what numpy_rng_state returned."""
    np.random.set_state(
        (s["name"], np.array(s["keys"], dtype=np.uint32), s["pos"], s["has_gauss"], s["cached"])
    )
