"""float8 training (`train.precision = "fp8"`): which linears compute in fp8, the conversion, and the check
that the device can do it.

As torchtitan does it, torchao's float8 training (`torchao.float8.convert_to_float8_training`) replaces
chosen `nn.Linear`s by `Float8Linear`s, whose three matmuls (forward, gradient of the input, gradient of the
weight) cast their operands to float8 with one dynamic scale per tensor ("tensorwise") and run on the fp8
tensor cores; weights, gradients and optimizer state stay float32, and everything else (attention, norms,
the output layer and the loss) runs under bf16 autocast as with `bf16`. The conversion happens right after
the model is built on its device, before the DDP/FSDP2 wrapper and before torch.compile (which fuses the
casts into the neighbouring kernels; torchtitan calls compile required for competitive fp8 speed). Nothing
here was timed on a GPU yet: tests emulate fp8 on the CPU.

A `Float8Linear` is an `nn.Linear` with the same `weight` and `bias` parameters, so a checkpoint of an fp8
run loads into a plain `Transformer`: eval, export and sample use the plain model.

Not done: FSDP2's float8 all-gather (torchao's `enable_fsdp_float8_all_gather`, with
`precompute_float8_dynamic_scale_for_fsdp` after each optimizer step). Under FSDP2 the converted linears
all-gather their weights in the parameters' own dtype and cast them to fp8 after the gather: correct, with
twice (bf16 parameters) or four times (fp32) the all-gather bytes of an fp8 gather.
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

from tenx.errors import ConfigError

FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with fp8 tensor cores (Ada: 8.9, Hopper: 9.0)."""

FP8_DIM_MULTIPLE = 16
"""fp8 matmuls (torch._scaled_mm) need both dimensions of the weight divisible by 16."""

SKIPPED_LINEARS = ("lm_head",)
"""Linears kept in bf16 by name: the output projection, whose logits are the most precision-sensitive
activations (torchtitan's default filter keeps its `output` layer too)."""

SMALL_IN_FEATURES, SMALL_OUT_FEATURES = 4096, 1024
"""The size rule (`skip_small`): a linear with in_features <= 4096 and out_features <= 1024 is slower in
fp8 than in bf16, the cast of its operands costing more than the faster matmul saves. These are torchao's
thresholds for tensorwise scaling (`_auto_filter_for_tensorwise`, from its H100 benchmarks), which
torchtitan applies with `auto_filter_small_kn`; other GPUs may differ."""


def is_float8_candidate(module: nn.Module, fqn: str, *, skip_small: bool = False) -> bool:
    """Whether the module at `fqn` computes in fp8: an `nn.Linear`, not the output projection, both
    dimensions divisible by 16 and, with `skip_small`, not under the size rule (SMALL_IN_FEATURES)."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in SKIPPED_LINEARS:
        return False
    if module.in_features % FP8_DIM_MULTIPLE or module.out_features % FP8_DIM_MULTIPLE:
        return False
    small = module.in_features <= SMALL_IN_FEATURES and module.out_features <= SMALL_OUT_FEATURES
    return not (skip_small and small)


def check_float8_support(device: torch.device) -> None:
    """Raise ConfigError, naming train.precision and what to do, unless `device` can train in fp8: a CUDA
    GPU of compute capability 8.9 or newer (asked of `device`'s own GPU), with torchao installed."""
    hint = "use train.precision='bf16'"
    if device.type != "cuda":
        raise ConfigError(
            f"train.precision='fp8' needs an NVIDIA GPU with fp8 tensor cores (compute capability "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer: H100, H200, L40S, RTX 4090); this run's "
            f"device is {device}: {hint}"
        )
    if torch.version.hip:
        raise ConfigError(f"train.precision='fp8' is supported on NVIDIA GPUs only, not ROCm: {hint}")
    capability = torch.cuda.get_device_capability(device)
    if tuple(capability) < FP8_MIN_CAPABILITY:
        raise ConfigError(
            f"train.precision='fp8': {torch.cuda.get_device_name(device)} ({device}) has compute capability "
            f"{capability[0]}.{capability[1]}, and fp8 matmuls need "
            f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer (H100, H200, L40S, RTX 4090): {hint}"
        )
    _torchao_float8()


def _torchao_float8() -> ModuleType:
    """torchao.float8 (imported only when fp8 is asked for), or ConfigError saying how to install it."""
    try:
        import torchao.float8
    except ImportError:
        raise ConfigError("train.precision='fp8' needs torchao: pip install torchao") from None
    return torchao.float8


def convert_linears_to_float8(
    model: nn.Module, device: torch.device, *, emulate: bool = False, skip_small: bool = False
) -> list[str]:
    """Replace `model`'s fp8 candidates (is_float8_candidate) in place by torchao's Float8Linear, after
    checking `device` (check_float8_support); returns the names of the converted linears.

    `emulate` runs the fp8 casts and matmuls in software, on any device (tests on a CPU): the numbers are
    fp8's, the speed is not."""
    if not emulate:
        check_float8_support(device)
    float8 = _torchao_float8()
    choose = functools.partial(is_float8_candidate, skip_small=skip_small)
    converted = [name for name, m in model.named_modules() if name and choose(m, name)]
    float8.convert_to_float8_training(
        model, module_filter_fn=choose, config=float8.Float8LinearConfig(emulate=emulate)
    )
    return converted


def restore_plain_linears(model: nn.Module) -> list[str]:
    """Put plain `nn.Linear`s back where `convert_linears_to_float8` put `Float8Linear`s, keeping the very
    same weight and bias parameters (an optimizer over them stays valid); returns the names restored.

    Triage's float64 reference path needs it: an fp8 matmul rounds its operands to fp8 whatever the
    parameters' dtype, and torchao's casts take no float64."""
    restored = []
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear:
            plain = nn.Linear(1, 1, bias=False, device="meta")
            plain.in_features, plain.out_features = module.in_features, module.out_features
            plain.weight = module.weight
            plain.register_parameter("bias", module.bias)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, plain)
            restored.append(name)
    return restored
