"""What the hardware can do: device choice, bf16 and float64 support, copies to a GPU that do not block, and
peak matmul FLOP/s for MFU (torch's CPU thread count is chosen in tenx/utils/cpus.py).

On a GPU the peak is the vendor's dense figure for the dtype; on a CPU there is no such figure, so each run
measures a square matmul briefly on the threads torch uses, and a cache per (CPU, threads, dtype, torch)
keeps the best figure ever seen: a measurement taken while other work shared the cores is too low, and
would make MFU exceed 100% (a run that starts on a busy machine measures again, and takes no less than
what its steps achieve: tenx.train.trainer `_raise_peak`).
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from pathlib import Path

import torch

from tenx.errors import ConfigError
from tenx.utils.cpus import torch_default_threads, usable_cpu_count
from tenx.utils.io import atomic_write_json

torch_default_threads()  # read torch's own thread count now, before tenx sets any (utils/cpus.py)

# Dense (non-sparse) peak FLOP/s by GPU model, as torch.cuda.get_device_name spells it; bf16 and fp32.
# The first model named in the device name wins (gpu_peak), so a variant precedes its family.
GPU_PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H200", {"bf16": 989e12, "fp32": 67e12, "fp8": 1979e12}),
    ("H100 PCIe", {"bf16": 756e12, "fp32": 51e12, "fp8": 1513e12}),
    ("H100 NVL", {"bf16": 835e12, "fp32": 60e12, "fp8": 1671e12}),
    ("H100", {"bf16": 989e12, "fp32": 67e12, "fp8": 1979e12}),
    ("A100", {"bf16": 312e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362e12, "fp32": 91.6e12, "fp8": 733e12}),
    ("A10", {"bf16": 125e12, "fp32": 31.2e12}),
    ("4090", {"bf16": 165e12, "fp32": 82.6e12}),
    ("3090", {"bf16": 71e12, "fp32": 35.6e12}),
    ("V100", {"bf16": 125e12, "fp32": 15.7e12}),
    ("T4", {"bf16": 65e12, "fp32": 8.1e12}),
]


def pick_device(name: str = "auto", what: str = "device") -> torch.device:
    """`auto` picks CUDA when available, else CPU; an explicit name must be a device this machine has
    (ConfigError naming `what`, the field or flag it came from, otherwise)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(
            f"{what} {name!r} is not a device name: use auto, cpu, cuda, cuda:N, mps or xpu"
        ) from None
    available = {
        "cpu": lambda: True,
        "cuda": torch.cuda.is_available,
        "mps": lambda: hasattr(torch.backends, "mps") and torch.backends.mps.is_available(),
        "xpu": lambda: hasattr(torch, "xpu") and torch.xpu.is_available(),
    }
    if device.type not in available:
        raise ConfigError(f"{what} {name!r}: tenx runs on cpu, cuda, mps or xpu")
    if not available[device.type]():
        raise ConfigError(
            f"{what} {name!r}: no {device.type} device is available on this machine (use auto or cpu)"
        )
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{what} {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


# oneDNN instruction-set caps (ONEDNN_MAX_CPU_ISA) below the first with bf16 dot products
_ONEDNN_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX512_CORE", "AVX512_CORE_VNNI"}


def cpu_has_fast_bf16() -> bool:
    """True when the CPU has native bf16 dot products (AVX512-BF16 or AMX), so bf16 matmuls pay off.

    Without them (most laptops: AVX2 only) a bf16 matmul is emulated, about 100x slower than fp32. A cap
    on the instruction sets PyTorch may use (ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY=avx2 or lower) is
    honoured: it makes an AVX-512 machine behave, and time, like an AVX2 one.
    """
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if isa in _ONEDNN_WITHOUT_BF16 or aten in ("default", "avx2"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() == "arm64"  # Apple silicon has bf16 matmul support
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for 'auto' | 'fp32' | 'bf16' | 'fp8' on `device`. 'fp8' autocasts to bf16: its fp8
    matmuls are those of the linears tenx.train.float8 converts, everything else runs in bf16 (and MFU is
    taken against the bf16 peak)."""
    if precision == "fp32":
        return torch.float32
    if precision in ("bf16", "fp8"):
        return torch.bfloat16
    if device.type == "cuda":
        return torch.bfloat16 if gpu_has_bf16(device) else torch.float32
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def check_compile_backend(device: torch.device) -> None:
    """ConfigError naming train.compile when torch.compile cannot build kernels for `device`: inductor
    writes C++ for a CPU, which needs a compiler (g++ or clang++, or $CXX), and Triton kernels for a GPU.
    Checked before training starts, where the first compiled step would otherwise fail minutes in."""
    if device.type == "cpu":
        from torch._inductor import cpp_builder, exc

        try:
            cpp_builder.get_cpp_compiler()
        except (exc.InvalidCxxCompiler, RuntimeError, OSError) as e:
            raise ConfigError(
                f"train.compile: torch.compile on a CPU builds C++ kernels and finds no C++ compiler ({e}); "
                "install one (Debian/Ubuntu: apt install g++), or set train.compile=false"
            ) from None
    elif device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise ConfigError(
                "train.compile: torch.compile on a GPU needs Triton, which does not import here; install "
                "the triton that matches this torch, or set train.compile=false"
            )


def gpu_has_bf16(device: torch.device) -> bool:
    """True when CUDA device `device` (its index; the current GPU without one) has bf16 tensor cores:
    compute capability 8.0 (Ampere) or later, or any ROCm GPU. `torch.cuda.is_bf16_supported` is not
    used: it asks the current GPU, which is not `device` for a job on `cuda:1` that never selected it."""
    return bool(torch.version.hip) or torch.cuda.get_device_capability(device) >= (8, 0)


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor `t` on `device`. To a GPU in one copy from pinned memory that does not block the host (a
    blocking copy waits for all the GPU's queued work first); torch's pinned-memory cache keeps the pinned
    buffer until the copy has run. On the CPU, `t` itself."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def float64_device(device: torch.device) -> torch.device:
    """Where float64 math on `device`'s tensors can run: `device`, or the CPU for MPS (no float64 there)."""
    return torch.device("cpu") if device.type == "mps" else device


def cpu_name() -> str:
    """The CPU's model name, as the OS reports it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tenx" / "peak_flops.json"


def measure_matmul_flops(
    dtype: torch.dtype, device: torch.device, n: int = 1024, seconds: float = 0.5
) -> float:
    """Best achieved FLOP/s of an n x n x n matmul in `dtype` on `device` over about `seconds`."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        a @ b
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # `device`'s queue, not the current GPU's
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = max(best, 4 * 2 * n**3 / (time.perf_counter() - t0))
    return best


def peak_flops(device: torch.device, dtype: torch.dtype, float8: bool = False) -> float:
    """Peak matmul FLOP/s for MFU: the vendor figure on a known GPU, else the best measurement seen.

    `float8`: the run's linears multiply in float8 (train.precision = "fp8"), so MFU is against the float8
    peak (dense, the vendor's figure; a GPU without one listed is measured in `dtype`, which makes a float8
    step look faster than the peak: the trainer then reports MFU as unknown, never above 100%)."""
    key_dtype = "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    if device.type == "cuda":
        peaks = gpu_peak(torch.cuda.get_device_name(device))
        if peaks is not None and float8 and "fp8" in peaks:
            return peaks["fp8"]
        return peaks[key_dtype] if peaks is not None else measure_matmul_flops(dtype, device, n=4096)
    key = f"{cpu_name()}|threads={torch.get_num_threads()}|{key_dtype}|torch={torch.__version__}"
    path = _cache_path()
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    measured = measure_matmul_flops(dtype, device, seconds=0.3)
    if measured > cache.get(key, 0.0):
        cache[key] = measured
        try:
            atomic_write_json(path, cache)
        except OSError:
            pass  # the cache is an optimisation only
    return float(cache[key])


def gpu_peak(name: str) -> dict[str, float] | None:
    """The GPU_PEAKS entry of the GPU called `name` (torch.cuda.get_device_name), or None for a GPU not
    listed. A model number must not run on into more digits: an RTX A1000 is not an A100, a T400 not a T4."""
    for model, peaks in GPU_PEAKS:
        if re.search(re.escape(model) + r"(?![0-9])", name):
            return peaks
    return None


def device_name(device: torch.device) -> str:
    """What `device` is, by name: the GPU's model (torch.cuda.get_device_name) or `cpu: ` and the CPU's."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}: {cpu_name()}" if device.type == "cpu" else device.type


def hardware_summary(device: torch.device) -> dict[str, object]:
    """A description of the machine for the run's provenance record."""
    info: dict[str, object] = {
        "device": str(device),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
    return info


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_allocator_tuned = False


def tune_cpu_allocator() -> bool:
    """Keep freed memory in glibc's heap instead of unmapping it after every step.

    A CPU training step allocates and frees the same large activation and gradient buffers each time. With
    glibc's defaults, blocks above the mmap threshold are mmapped and unmapped every step, and each fresh
    page costs a page fault: on 2 cores that was half the wall time of the quickstart model (measured:
    9,200 -> 17,500 tokens/s). Raising the mmap and trim thresholds makes the buffers reused. The price is
    that the process keeps its peak memory. Returns True when applied (Linux with glibc), else False.
    """
    global _allocator_tuned
    if _allocator_tuned:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, 1 << 30) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1) == 1
        )
    except (OSError, AttributeError):
        return False
    _allocator_tuned = ok
    return ok
