"""GPU-only mistakes caught on a CPU: torch.cuda's functions stubbed with the argument contracts of the real
ones (torch/cuda/__init__.py, torch/cuda/memory.py, torch/cuda/_utils.py:_get_device_index), on a machine
of named GPUs. Each stub records its calls, so a test sees which GPU a question went to: a bare `cuda`
device is the current GPU, which is not the job's GPU on `cuda:1` unless something selected it."""

from __future__ import annotations

import pytest
import torch

from tenx.checkpoint.writer import snapshot_tensors
from tenx.errors import ConfigError
from tenx.hardware import (
    float64_device,
    gpu_peak,
    hardware_summary,
    peak_flops,
    pick_device,
    resolve_precision,
)
from tenx.monitor.internals import peak_memory_gib
from tenx.parallel.distributed import DistEnv, dist_env, rank_device

A100 = ("NVIDIA A100-SXM4-80GB", (8, 0))
V100 = ("Tesla V100-SXM2-16GB", (7, 0))
H100 = ("NVIDIA H100 80GB HBM3", (9, 0))
RTX_A1000 = ("NVIDIA RTX A1000 Laptop GPU", (8, 6))


class FakeGpus:
    """torch.cuda on a machine with `gpus` (name, compute capability), as strict as the real functions."""

    def __init__(self, gpus: list[tuple[str, tuple[int, int]]]) -> None:
        self.gpus = gpus
        self.current = 0
        self.calls: list[tuple[str, int]] = []
        """(function, device index it acted on), in call order."""
        self.peak_bytes = [(i + 1) * 2**30 for i in range(len(gpus))]
        """Per GPU: what max_memory_allocated reports (GPU i: i + 1 GiB)."""

    def index(self, device: object, optional: bool) -> int:
        """torch.cuda._utils._get_device_index: an int as is; a `cuda` device (or its name) by its index,
        the current GPU for none when `optional`; another device type, or no index when not optional,
        raises as torch does."""
        if isinstance(device, str):
            device = torch.device(device)
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            device = device.index
        if device is None:
            if not optional:
                raise ValueError(
                    f"Expected a torch.device with a specified index or an integer, but got:{device}"
                )
            return self.current
        if not isinstance(device, int):
            raise TypeError(f"a device index must be an int, a str or a torch.device, got {device!r}")
        return device

    def existing(self, name: str, device: object) -> int:
        """The index `device` names, checked against the GPUs there are (torch: 'Invalid device id')."""
        idx = self.index(device, optional=True)
        if not 0 <= idx < len(self.gpus):
            raise AssertionError("Invalid device id")
        self.calls.append((name, idx))
        return idx

    def set_device(self, device: object) -> None:
        idx = self.index(device, optional=False)
        if idx >= len(self.gpus):
            raise RuntimeError("CUDA error: invalid device ordinal")
        self.calls.append(("set_device", idx))
        if idx >= 0:
            self.current = idx

    def current_device(self) -> int:
        return self.current

    def get_device_name(self, device: object = None) -> str:
        return self.gpus[self.existing("get_device_name", device)][0]

    def get_device_capability(self, device: object = None) -> tuple[int, int]:
        return self.gpus[self.existing("get_device_capability", device)][1]

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        # the real one: True on ROCm, else it asks the current GPU only
        return bool(torch.version.hip) or self.gpus[self.existing("is_bf16_supported", None)][1] >= (8, 0)

    def synchronize(self, device: object = None) -> None:
        self.existing("synchronize", device)

    def max_memory_allocated(self, device: object = None) -> int:
        return self.peak_bytes[self.existing("max_memory_allocated", device)]

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.peak_bytes[self.existing("reset_peak_memory_stats", device)] = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeGpus:
        monkeypatch.setattr(torch.version, "hip", None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(self.gpus))
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.gpus))
        for name in (
            "set_device",
            "current_device",
            "get_device_name",
            "get_device_capability",
            "is_bf16_supported",
            "synchronize",
            "max_memory_allocated",
            "reset_peak_memory_stats",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        return self


@pytest.fixture
def gpus(monkeypatch):
    """A function: install a FakeGpus of the given (name, capability) GPUs and return it."""
    return lambda *found: FakeGpus(list(found)).install(monkeypatch)


def _torchrun(monkeypatch, rank: int, world: int, local_rank: int, local_world: int) -> DistEnv:
    for name, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local_rank)):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    return dist_env()


# ----- device choice --------------------------------------------------------------------------------
def test_auto_is_the_current_gpu_by_its_index(gpus):
    fake = gpus(A100, A100)
    fake.current = 1  # e.g. a launcher selected it before tenx ran
    device = pick_device("auto", "train.device")
    assert device == torch.device("cuda")
    assert rank_device(device, DistEnv()) == torch.device("cuda", 1)
    assert fake.calls == [("set_device", 1)]


def test_auto_without_a_gpu_is_the_cpu_and_asks_no_gpu_anything(gpus):
    fake = gpus()
    assert rank_device(pick_device("auto", "train.device"), DistEnv()) == torch.device("cpu")
    assert fake.calls == []


def test_an_explicit_gpu_index_is_kept_and_selected(gpus):
    fake = gpus(A100, A100)
    device = rank_device(pick_device("cuda:1", "train.device"), DistEnv())
    assert device == torch.device("cuda", 1)
    assert fake.calls == [("set_device", 1)] and fake.current == 1


def test_a_gpu_index_past_the_last_names_the_field_and_the_count(gpus):
    gpus(A100, A100)
    with pytest.raises(ConfigError, match=r"train\.device 'cuda:2': this machine has 2 CUDA device\(s\)"):
        pick_device("cuda:2", "train.device")


def test_cuda_on_a_machine_without_one_names_the_field(gpus):
    gpus()
    with pytest.raises(ConfigError, match=r"--device 'cuda:0': no cuda device is available.*use auto or cpu"):
        pick_device("cuda:0", "--device")


def test_each_torchrun_rank_selects_its_local_gpu(gpus, monkeypatch):
    fake = gpus(A100, A100)
    env = _torchrun(monkeypatch, rank=3, world=4, local_rank=1, local_world=2)
    assert rank_device(pick_device("auto", "train.device"), env) == torch.device("cuda", 1)
    assert fake.calls == [("set_device", 1)]


def test_a_rank_that_sees_one_gpu_takes_index_0(gpus, monkeypatch):
    """CUDA_VISIBLE_DEVICES set per rank: each process sees one GPU, whatever its LOCAL_RANK."""
    fake = gpus(A100)
    env = _torchrun(monkeypatch, rank=1, world=2, local_rank=1, local_world=2)
    assert rank_device(torch.device("cuda"), env) == torch.device("cuda", 0)
    assert fake.calls == [("set_device", 0)]


# ----- precision ------------------------------------------------------------------------------------
def test_auto_precision_asks_the_jobs_own_gpu(gpus):
    """A V100 (no bf16 tensor cores) beside an A100 that is the current GPU: `cuda:1` is the V100."""
    fake = gpus(A100, V100)
    assert resolve_precision("auto", torch.device("cuda", 1)) == torch.float32
    assert resolve_precision("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert fake.calls == [("get_device_capability", 1), ("get_device_capability", 0)]
    fake.current = 1
    assert resolve_precision("auto", torch.device("cuda")) == torch.float32  # no index: the current GPU
    assert fake.calls[-1] == ("get_device_capability", 1)


def test_explicit_precision_and_rocm_need_no_question(gpus, monkeypatch):
    fake = gpus(V100)
    assert resolve_precision("bf16", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_precision("fp32", torch.device("cuda", 0)) == torch.float32
    assert fake.calls == []
    monkeypatch.setattr(torch.version, "hip", "6.2")  # every ROCm GPU runs bf16
    assert resolve_precision("auto", torch.device("cuda", 0)) == torch.bfloat16


# ----- peak FLOP/s and the provenance record --------------------------------------------------------
def test_peak_flops_of_a_named_gpu_is_looked_up_on_the_jobs_gpu(gpus, monkeypatch):
    fake = gpus(A100, H100)
    monkeypatch.setattr("tenx.hardware.measure_matmul_flops", lambda *a, **k: pytest.fail("measured"))
    assert peak_flops(torch.device("cuda", 1), torch.bfloat16) == 989e12
    assert peak_flops(torch.device("cuda", 1), torch.float32) == 67e12
    assert peak_flops(torch.device("cuda", 0), torch.float16) == 312e12
    assert fake.calls == [("get_device_name", 1), ("get_device_name", 1), ("get_device_name", 0)]


def test_an_unlisted_gpu_is_measured_on_the_jobs_gpu(gpus, monkeypatch):
    gpus(H100, RTX_A1000)  # an RTX A1000 is not an A100
    measured = []
    monkeypatch.setattr(
        "tenx.hardware.measure_matmul_flops",
        lambda dtype, device, n: measured.append((dtype, device, n)) or 7e12,
    )
    assert peak_flops(torch.device("cuda", 1), torch.bfloat16) == 7e12
    assert measured == [(torch.bfloat16, torch.device("cuda", 1), 4096)]


@pytest.mark.parametrize(
    "name, bf16",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10G", 125e12),
        ("NVIDIA GeForce RTX 4090", 165e12),
        ("Tesla T4", 65e12),
        ("NVIDIA RTX A1000", None),
        ("NVIDIA T400 4GB", None),
    ],
)
def test_gpu_names_match_whole_model_numbers(name, bf16):
    peaks = gpu_peak(name)
    assert (peaks["bf16"] if peaks else None) == bf16


def test_hardware_summary_names_the_jobs_gpu(gpus):
    gpus(A100, H100)
    summary = hardware_summary(torch.device("cuda", 1))
    assert (summary["device"], summary["gpu"], summary["gpu_count"]) == ("cuda:1", H100[0], 2)


# ----- memory and waiting ---------------------------------------------------------------------------
def test_peak_memory_is_read_from_the_jobs_gpu(gpus):
    fake = gpus(A100, A100)
    assert peak_memory_gib(torch.device("cuda", 1)) == 2.0
    assert peak_memory_gib(torch.device("cuda")) == 1.0  # the current GPU, 0
    assert fake.calls == [("max_memory_allocated", 1), ("max_memory_allocated", 0)]


class _OnGpu1(torch.Tensor):
    """A CPU tensor that says it lives on `cuda:1` (what snapshot_tensors looks at)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 1)


def test_a_checkpoint_snapshot_waits_for_the_gpu_its_tensors_are_on(gpus, monkeypatch):
    fake = gpus(A100, A100)  # the current GPU is 0; the state is on 1
    allocated = []
    empty_like = torch.empty_like

    def host_buffer(source, *, device=None, pin_memory=False):
        if pin_memory and torch.device(device).type != "cpu":
            raise RuntimeError("only host memory can be pinned")
        allocated.append((torch.device(device), pin_memory))
        return empty_like(source.as_subclass(torch.Tensor), device=device)

    monkeypatch.setattr(torch, "empty_like", host_buffer)
    weights = torch.arange(6.0).as_subclass(_OnGpu1)
    snapshot = snapshot_tensors({"w": weights, "step": torch.ones(2)})
    assert torch.equal(snapshot["w"].as_subclass(torch.Tensor), torch.arange(6.0))
    assert allocated == [(torch.device("cpu"), True), (torch.device("cpu"), False)]
    assert fake.calls == [("synchronize", 1)]
    fake.calls.clear()
    snapshot_tensors({"step": torch.ones(2)})
    assert fake.calls == []  # nothing on a GPU: nothing to wait for


def test_float64_runs_where_the_device_has_it():
    assert float64_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert float64_device(torch.device("cpu")) == torch.device("cpu")
    assert float64_device(torch.device("mps")) == torch.device("cpu")


def test_the_planted_op_bug_builds_its_tensors_on_the_targets_device(monkeypatch):
    """On CUDA the op-bug fault crashed in its own torch.cat (a CPU tensor beside the CUDA targets: seen on an
    H100), so triage found a crash no repro could show. Every tensor it makes must be on the targets' device."""
    from tenx.train.callbacks import opbug

    targets = torch.tensor([1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 4])
    made: list[object] = []
    for name in ("zeros", "tensor"):
        real = getattr(torch, name)

        def factory(*args, _real=real, **kwargs):
            made.append(kwargs.get("device", "none given"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, factory)
    runs = opbug.longest_runs(targets, 4)
    monkeypatch.undo()
    assert runs == [(1, 4, 2), (5, 5, 3)]
    assert made and all(device == targets.device for device in made), made
