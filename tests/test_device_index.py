"""GPU-only mistakes caught on a CPU: `torch.cuda.set_device` is stubbed with the real function's argument
contract (a device with an index, or an int), so a bare `cuda` device fails here as it does on a GPU."""

from __future__ import annotations

import pytest
import torch

from tenx.parallel.distributed import DistEnv, rank_device


@pytest.fixture
def strict_cuda(monkeypatch):
    chosen: list[int] = []

    def set_device(device):
        if isinstance(device, torch.device):
            if device.index is None:  # what torch raises on a GPU machine
                raise ValueError(
                    f"Expected a torch.device with a specified index or an integer, but got:{device}"
                )
            device = device.index
        if not isinstance(device, int):
            raise TypeError(f"set_device takes a device or an int, got {device!r}")
        chosen.append(device)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    return chosen


def test_one_process_on_cuda_names_the_current_gpu(strict_cuda):
    assert rank_device(torch.device("cuda"), DistEnv()) == torch.device("cuda", 0)
    assert strict_cuda == [0]


def test_each_local_rank_takes_its_own_gpu(strict_cuda):
    env = DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4)
    assert rank_device(torch.device("cuda"), env) == torch.device("cuda", 1)
    assert rank_device(torch.device("cuda", 3), env) == torch.device("cuda", 3)  # an explicit index stays
    assert strict_cuda == [1, 3]


def test_cpu_never_touches_cuda(strict_cuda):
    assert rank_device(torch.device("cpu"), DistEnv()) == torch.device("cpu")
    assert strict_cuda == []
