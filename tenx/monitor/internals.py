"""Statistics inside the model, as pure functions: per-layer norms, activation and output-logit figures,
the naming scheme of the metrics they become, and how per-rank figures combine.

Every statistic is logged under a key that starts with `stats/` (docs/monitoring.md):

| key | meaning |
|---|---|
| `stats/grad_norm/<layer>` | L2 norm of the layer's gradients after the cross-rank reduction, before clipping |
| `stats/param_norm/<layer>` | L2 norm of the layer's parameters before the optimizer step |
| `stats/update_ratio/<layer>` | norm of the optimizer step's change over the parameter norm, ||Δθ|| / ||θ|| |
| `stats/act_rms/<i>`, `stats/act_max/<i>` | root-mean-square and largest magnitude of block i's output |
| `stats/attn_logit_max/<i>` | largest pre-softmax logit q·k/sqrt(E) of block i's attention |
| `stats/logit_max` | largest output logit |
| `stats/logit_entropy` | mean entropy of the next-token distribution, nats |
| `stats/step_time_s/rank<r>` | rank r's own time in the step, before it waits for its peers |
| `stats/memory_gib/rank<r>` | rank r's peak memory (GPU: the step's forward and backward; CPU: the process) |
| `stats/loss_source/<source>` | loss of the probe's validation tokens from each data source (tenx.monitor.source_loss) |

`<layer>` is a block index (0, 1, ...) or `embed`, `head`, `norm` for the parts outside the blocks.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence

import torch

from tenx.hardware import host_to_device

PREFIX = "stats"

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")
_PARTS = {"tok_emb": "embed", "pos_emb": "embed", "lm_head": "head", "final_norm": "norm"}


def stat_key(name: str, layer: str | int | None = None) -> str:
    """The metric key of statistic `name`, per layer when `layer` is given: `stats/<name>[/<layer>]`."""
    return f"{PREFIX}/{name}" if layer is None else f"{PREFIX}/{name}/{layer}"


def rank_key(name: str, rank: int) -> str:
    """The metric key of a per-rank figure: `stats/<name>/rank<r>`."""
    return f"{PREFIX}/{name}/rank{rank}"


def layer_of(param_name: str) -> str:
    """The layer a parameter belongs to: its block index, or embed / head / norm (wrapper prefixes ignored)."""
    name = param_name
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    parts = name.split(".")
    if parts[0] == "blocks" and len(parts) > 1 and parts[1].isdigit():
        return parts[1]
    return _PARTS.get(parts[0], parts[0])


def layer_index(param_names: Sequence[str]) -> tuple[list[str], list[int]]:
    """The layers in model order (blocks by index, then the rest as first seen), and each name's position."""
    seen = list(dict.fromkeys(layer_of(n) for n in param_names))
    blocks = sorted((s for s in seen if s.isdigit()), key=int)
    layers = blocks + [s for s in seen if not s.isdigit()]
    position = {layer: i for i, layer in enumerate(layers)}
    return layers, [position[layer_of(n)] for n in param_names]


def squared_norms(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of each tensor, in fp32, as one vector (no host synchronisation)."""
    sums = [torch.linalg.vector_norm(t.detach(), dtype=torch.float32).square() for t in tensors]
    return torch.stack(sums) if sums else torch.zeros(0)


def group_sums(values: torch.Tensor, index: Sequence[int], groups: int) -> torch.Tensor:
    """Per-group sums of `values` (fp32, which every device has), element i going to group index[i]."""
    out = torch.zeros(groups, dtype=torch.float32, device=values.device)
    if len(index):
        idx = host_to_device(torch.as_tensor(list(index), dtype=torch.long), values.device)
        out.index_add_(0, idx, values.to(torch.float32))
    return out


def update_ratio(update_sq: float, param_sq: float) -> float:
    """||Δθ|| / ||θ|| from the squared norms; 0 for a layer whose parameters are all zero."""
    return math.sqrt(update_sq / param_sq) if param_sq > 0 else 0.0


def activation_moments(x: torch.Tensor) -> torch.Tensor:
    """(sum of squares, element count, largest magnitude) of `x`, fp32, as a 3-vector on x's device."""
    x = x.detach().float()
    count = torch.full((), float(x.numel()), device=x.device)  # filled there: no copy that waits for the GPU
    return torch.stack([x.square().sum(), count, x.abs().amax()])


def rms_and_max(moments: Sequence[float]) -> tuple[float, float]:
    """Root mean square and largest magnitude from the (sum of squares, count, largest magnitude) of
    activation_moments."""
    sq, count, peak = moments
    return math.sqrt(sq / count) if count else 0.0, peak


def logit_stats(logits: torch.Tensor) -> torch.Tensor:
    """(largest logit, mean entropy in nats of softmax over the last dimension) as a 2-vector, fp32."""
    logits = logits.detach().float()
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1).mean()
    return torch.stack([logits.amax(), entropy])


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory: on a GPU, bytes allocated since the last reset of its peak; else the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource
    except ImportError:  # Windows
        return math.nan
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
