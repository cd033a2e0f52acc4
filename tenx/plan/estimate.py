"""`tenx plan --config CFG --cluster CLUSTER`: what a run costs on a cluster before it starts.

Memory per rank (bytes; P parameters, W data-parallel ranks, S ranks per shard group under HSDP):

| part | DDP | FSDP2 (full shard) | HSDP |
|---|---|---|---|
| parameters (fp32 master) | 4P | 4P/W | 4P/S |
| gradients (fp32) | 4P | 4P/W | 4P/S |
| AdamW state (two fp32 moments) | 8P | 8P/W | 8P/S |
| gathered parameters in flight (FSDP) | 0 | 2 blocks' 4P_block | same |
| reducer buckets (DDP, W > 1) | 4P | 0 | 0 |

Activations per micro-batch of b sequences of s tokens, per layer: Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", Table 2) count s·b·h·(34 + 5·a·s/h) bytes with
16-bit activations and dropout. tenx's block has no dropout and a fused attention kernel that keeps no
s x s score matrix; counting the tensors autograd saves (PyTorch's saved-tensor hooks) on tenx's own block
gives 58 to 61 bytes per token per unit of width per layer in fp32 (tiny, quickstart, gpt2-d12): 15 values
of h per token, so `15·h·bytes(dtype)` per token and layer, times `activation_factor`. With activation
checkpointing each layer keeps only its input (bytes(dtype)·h per token) and one layer is recomputed at a
time. The output layer adds the fp32 logits and their log-softmax: 2·4·V per token; while the loss's
backward runs, the gradients of both are alive too (another 2·4·V per token; measured by tracking every
tensor's storage through a TorchDispatchMode: the step's peak on tiny and quickstart is there). Above
64M logits per micro-batch (gpt2-d12, llama-1b) the output layer and the loss run in chunks that never hold
them all (tenx.model.transformer.linear_cross_entropy): what stays is the fp32 gradients of the last
hidden state and of the output weight, 4·h·(tokens + V), and one chunk's logits in fp32 with their 16-bit
gradient copy, 6 bytes per logit.

The peak of a step is the states (parameters, optimizer moments, gathered FSDP blocks) plus the larger of
two transients: the loss's backward (every activation, the logits and their gradients; the gradients only
if earlier micro-batches accumulated them, since they are set to None after each step) and the update
(the gradients, AdamW's temporaries of one fp32 value per parameter, fused or not, and on a statistics
step, `monitor.stats_every`, the statistics' fp32 snapshot of the parameters; on gpt2-d12 the update is
where the peak is: 24 bytes per parameter).

Time per step: compute = FLOPs per token (tenx.model.flops, attention included, x3 for forward and
backward) x tokens per rank / (peak FLOP/s x `compute_efficiency`); communication (ring collectives, bytes
moved per rank = 2(W-1)/W x size for an all-reduce, (W-1)/W x size for an all-gather or a reduce-scatter):
DDP all-reduces the fp32 gradients; FSDP all-gathers the parameters twice (forward, backward) and
reduce-scatters the gradients; bandwidth is the intra-node link within a node and the inter-node link
beyond. Step time = compute + (1 - overlap) x communication + collectives x `collective_latency_s`. Cross-cluster traffic of replica groups: sync
mode all-reduces the gradients every step over the cross-cluster link; DiLoCo moves the pseudo-gradient
(fp32, or bf16) once every H steps.

The efficiency factors (`compute_efficiency`, `activation_factor`, `overlap`) default to the cluster file's
values; `tenx plan --measure` fits the first two on this machine from a few real steps
(tenx/plan/calibrate.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tenx import config as cfglib
from tenx.config import field
from tenx.errors import ConfigError
from tenx.model.config import ModelConfig
from tenx.model.flops import count_params, flops_per_token
from tenx.model.transformer import CHUNK_ELEMENTS
from tenx.plan.failure_rates import FailureRates
from tenx.train.config import RunConfig

GB = 1e9
DEFAULT_VOCAB = 50257
"""GPT-2's vocabulary: what a plan assumes, and says it assumes, when neither --vocab, model.vocab_size
nor prepared data names one."""
MAX_VOCAB = 2**24
"""The largest `--vocab` a plan takes (16,777,216): 64 times the largest vocabularies in use (256k)."""


@dataclass
class NodeSpec:
    """One machine of the cluster."""

    accelerators: int = field(8, ge=1, help="accelerators (GPUs, or 1 for a CPU) per node")
    memory_gb: float = field(80.0, gt=0, help="memory per accelerator, GB")
    peak_tflops_bf16: float = field(989.0, gt=0, help="dense bf16 peak per accelerator, TFLOP/s")
    peak_tflops_fp32: float = field(67.0, gt=0, help="dense fp32 peak per accelerator, TFLOP/s")
    memory_bandwidth_gbs: float = field(3350.0, gt=0, help="memory bandwidth per accelerator, GB/s")
    intra_bandwidth_gbs: float = field(
        450.0, gt=0, help="accelerator-to-accelerator bandwidth inside a node, GB/s"
    )


@dataclass
class ClusterSpec:
    """How the nodes are connected, and the factors that turn peaks into time."""

    nodes: int = field(1, ge=1, help="nodes in the cluster")
    inter_bandwidth_gbs: float = field(50.0, gt=0, help="network bandwidth per node, GB/s (400 Gb/s = 50)")
    cross_cluster_bandwidth_gbs: float = field(
        12.5, gt=0, help="bandwidth between clusters (replica groups), GB/s"
    )
    compute_efficiency: float = field(0.45, gt=0, le=1, help="fraction of peak FLOP/s a step's matmuls reach")
    overlap: float = field(0.8, ge=0, le=1, help="fraction of communication hidden behind compute")
    activation_factor: float = field(1.0, gt=0, help="measured activations / the formula's")
    memory_usable: float = field(0.9, gt=0, le=1, help="fraction of an accelerator's memory a run may fill")
    step_overhead_s: float = field(
        0.0, ge=0, help="seconds per step besides the matmuls (Python, kernel launches)"
    )
    collective_latency_s: float = field(
        0.0,
        ge=0,
        help="seconds each collective costs besides its bytes (launch, synchronisation), not hidden",
    )
    runtime_gb: float = field(
        0.0,
        ge=0,
        help="memory a training process holds besides the model's tensors (allocator, kernels, data), GB",
    )
    communicator_gb: float = field(
        0.0, ge=0, help="memory the process group's communicator adds per rank when ranks > 1 (buffers), GB"
    )


@dataclass
class Cluster:
    """A cluster description (configs/clusters/*.toml)."""

    name: str = field("cluster", help="a name for reports")
    node: NodeSpec = field(default_factory=NodeSpec, help="one machine")
    cluster: ClusterSpec = field(default_factory=ClusterSpec, help="the network and efficiency factors")
    failures: FailureRates = field(
        default_factory=FailureRates,
        help="unexpected interruptions by component (`tenx plan failures`; default: Llama 3's)",
    )

    @property
    def accelerators(self) -> int:
        return self.node.accelerators * self.cluster.nodes


CLUSTER_DIR = Path(__file__).resolve().parents[2] / "configs" / "clusters"


def cluster_file(name: str) -> Path:
    """The file `--cluster NAME` names: a path, or the name of a shipped one (configs/clusters/NAME.toml)."""
    path = Path(name)
    if not path.exists() and (CLUSTER_DIR / f"{name}.toml").exists():
        path = CLUSTER_DIR / f"{name}.toml"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in CLUSTER_DIR.glob("*.toml")))
        raise ConfigError(f"--cluster {name!r}: no such file or shipped cluster (shipped: {shipped})")
    return path


def load_cluster(name: str, overrides: list[str] | None = None) -> Cluster:
    """A cluster file, or the name of a shipped one (configs/clusters/NAME.toml)."""
    return cfglib.load(Cluster, cluster_file(name), overrides)


def _bytes_per_activation(dtype: str) -> int:
    return 2 if dtype in ("bf16", "bfloat16", "fp16") else 4


def memory_per_rank(
    model: ModelConfig,
    micro_batch: int,
    strategy: str,
    ranks: int,
    *,
    shard_group: int | None = None,
    dtype: str = "fp32",
    activation_checkpointing: bool = False,
    activation_factor: float = 1.0,
    grad_accum: int = 1,
    statistics: bool = False,
) -> dict[str, float]:
    """Bytes per rank by part (see the module doc) and the peak of a step (`total`, see `peak_of`)."""
    params = count_params(model).total
    assert model.d_model and model.depth and model.vocab_size
    if strategy == "ddp" or ranks == 1:
        shard = 1
    elif strategy == "fsdp":
        shard = ranks
    elif strategy == "hsdp":
        shard = shard_group or ranks
    else:
        raise ConfigError(f"strategy must be ddp, fsdp or hsdp, got {strategy!r}")
    tokens = micro_batch * model.seq_len
    h, layers = model.d_model, model.depth
    act = _bytes_per_activation(dtype)
    per_layer = 15 * h * act * activation_factor  # per token: measured on tenx's block (module doc)
    if activation_checkpointing:
        activations = tokens * (layers * h * act + per_layer)
    else:
        activations = tokens * layers * per_layer
    if tokens * model.vocab_size <= CHUNK_ELEMENTS:
        logits = tokens * model.vocab_size * 4 * 2 * activation_factor  # fp32 logits and their log-softmax
        # the log-softmax's backward holds the gradients of its output and of the logits (fp32) at once
        loss_backward = logits
    else:  # chunked (tenx.model.transformer.linear_cross_entropy): the gradients it keeps, one chunk's logits
        chunk = CHUNK_ELEMENTS // model.vocab_size * model.vocab_size
        logits = (4 * h * (tokens + model.vocab_size) + 6 * chunk) * activation_factor
        loss_backward = 0.0
    block_params = (params - count_params(model).embedding - count_params(model).lm_head) / layers
    parts = {
        "parameters": 4 * params / shard,
        "gradients": 4 * params / shard,
        "optimizer": 8 * params / shard,
        "gathered": 2 * 4 * block_params if shard > 1 else 0.0,
        # DDP's reducer all-reduces flat fp32 buckets beside the gradients (gradient_as_bucket_view off)
        "buckets": 4 * params if strategy == "ddp" and ranks > 1 else 0.0,
        "activations": activations,
        "logits": logits,
        "loss_backward": loss_backward,
        # at the update: AdamW's temporaries (fused and foreach alike, one fp32 value per local parameter) and,
        # on a statistics step (monitor.stats_every > 0), the statistics' snapshot of the parameters
        "update": 4 * params / shard * (2 if statistics else 1),
    }
    parts["total"] = peak_of(parts, grad_accum)
    return parts


def peak_of(parts: dict[str, float], grad_accum: int = 1) -> float:
    """Peak bytes of a step: the states plus the larger of the two transients (module doc). In the loss's
    backward every activation is alive and the gradients are not yet (set to None after each step) unless
    earlier micro-batches accumulated them; at the update the gradients and the update's copy are."""
    states = parts["parameters"] + parts["optimizer"] + parts["gathered"] + parts["buckets"]
    backward = parts["activations"] + parts["logits"] + parts["loss_backward"]
    backward += parts["gradients"] if grad_accum > 1 else 0.0
    return states + max(backward, parts["gradients"] + parts["update"])


def communication_per_step(
    params: int, strategy: str, ranks: int, bandwidth_gbs: float, *, grad_accum: int = 1
) -> dict[str, float]:
    """Bytes each rank sends per optimizer step and the seconds at `bandwidth_gbs` (ring collectives)."""
    if ranks <= 1:
        return {"bytes": 0.0, "seconds": 0.0}
    ring = (ranks - 1) / ranks
    if strategy == "ddp":
        moved = 2 * ring * 4 * params  # one all-reduce of fp32 gradients per step
    else:  # fsdp / hsdp: all-gather params in forward and backward of every micro-batch, reduce-scatter grads
        moved = grad_accum * 2 * ring * 4 * params + ring * 4 * params
    return {"bytes": moved, "seconds": moved / (bandwidth_gbs * GB)}


BUCKET_BYTES = 25 * 2**20
"""DDP's default gradient bucket."""


def collectives_per_step(model: ModelConfig, params: int, strategy: str, ranks: int, grad_accum: int) -> int:
    """Collectives a rank launches per optimizer step: DDP one all-reduce per 25 MiB gradient bucket; FSDP2
    an all-gather per block (and the root) in forward and backward of each micro-batch and a reduce-scatter
    per block; plus tenx's two per step (the loss average and the agreed stop signal)."""
    if ranks <= 1:
        return 0
    if strategy == "ddp":
        return math.ceil(4 * params / BUCKET_BYTES) + 2
    units = (model.depth or 0) + 1
    return grad_accum * 2 * units + units + 2


@dataclass
class Plan:
    """What `estimate` returns (also the JSON `tenx plan` writes)."""

    params: int
    flops_per_token: float
    ranks: int
    strategy: str
    tokens_per_step: int
    memory_per_rank: dict[str, float]
    memory_capacity: float
    fits: bool
    largest_micro_batch: int
    compute_s: float
    communication: dict[str, float]
    step_s: float
    mfu: float
    tokens_per_day: float
    cross_cluster: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def estimate(
    run: RunConfig,
    cluster: Cluster,
    *,
    vocab: int,
    strategy: str = "ddp",
    ranks: int | None = None,
    dtype: str | None = None,
    activation_checkpointing: bool = False,
    replica_groups: int = 1,
    diloco_every: int = 0,
) -> Plan:
    """Memory, communication, step time, MFU and throughput of `run` on `cluster` (see the module doc);
    `ranks` None: every accelerator of the cluster."""
    for name, value, low in (
        ("vocab", vocab, 1),
        ("ranks", ranks, 1),
        ("replica_groups", replica_groups, 1),
        ("diloco_every", diloco_every, 0),
    ):
        if value is not None and not value >= low:
            raise ConfigError(f"{name} must be >= {low}, got {value}")
    model = run.model.resolved(vocab)
    ranks = ranks if ranks is not None else cluster.accelerators
    dtype = dtype or ("bf16" if run.train.precision in ("bf16", "fp8", "auto") else "fp32")
    c, node = cluster.cluster, cluster.node
    params = count_params(model).total
    per_token = flops_per_token(model)
    tokens_per_step = run.train.micro_batch * model.seq_len * ranks * max(1, run.train.grad_accum)

    def memory_at(micro_batch: int) -> dict[str, float]:
        return memory_per_rank(
            model,
            micro_batch,
            strategy,
            ranks,
            shard_group=node.accelerators,
            dtype=dtype,
            activation_checkpointing=activation_checkpointing,
            activation_factor=c.activation_factor,
            grad_accum=max(1, run.train.grad_accum),
            statistics=run.monitor.stats_every > 0,
        )

    memory = memory_at(run.train.micro_batch)
    memory["runtime"] = (c.runtime_gb + (c.communicator_gb if ranks > 1 else 0.0)) * GB
    memory["total"] += memory["runtime"]
    capacity = node.memory_gb * GB * c.memory_usable
    largest = 0
    for mb in (2**k for k in range(0, 16)):
        if memory_at(mb)["total"] + memory["runtime"] > capacity:
            break
        largest = mb
    peak = (node.peak_tflops_bf16 if dtype == "bf16" else node.peak_tflops_fp32) * 1e12
    compute = per_token * tokens_per_step / ranks / (peak * c.compute_efficiency)
    bandwidth = (
        node.intra_bandwidth_gbs
        if ranks <= node.accelerators
        else min(node.intra_bandwidth_gbs, c.inter_bandwidth_gbs / node.accelerators)
    )
    comm = communication_per_step(params, strategy, ranks, bandwidth, grad_accum=max(1, run.train.grad_accum))
    comm["collectives"] = collectives_per_step(model, params, strategy, ranks, max(1, run.train.grad_accum))
    comm["latency_s"] = comm["collectives"] * c.collective_latency_s
    step = c.step_overhead_s + compute + (1 - c.overlap) * comm["seconds"] + comm["latency_s"]
    cross: dict[str, float] = {}
    if replica_groups > 1:
        ring = (replica_groups - 1) / replica_groups
        sync_bytes = 2 * ring * 4 * params
        every = max(1, diloco_every) if diloco_every else 1
        cross = {
            "sync_bytes_per_step": sync_bytes,
            "sync_seconds_per_step": sync_bytes / (c.cross_cluster_bandwidth_gbs * GB),
            "diloco_bytes_per_step": sync_bytes / every,
            "diloco_seconds_per_step": sync_bytes / every / (c.cross_cluster_bandwidth_gbs * GB),
        }
    mfu = per_token * tokens_per_step / step / (peak * ranks) if step > 0 else 0.0
    return Plan(
        params=params,
        flops_per_token=per_token,
        ranks=ranks,
        strategy=strategy,
        tokens_per_step=tokens_per_step,
        memory_per_rank=memory,
        memory_capacity=capacity,
        fits=memory["total"] <= capacity,
        largest_micro_batch=largest,
        compute_s=compute,
        communication=comm,
        step_s=step,
        mfu=mfu,
        tokens_per_day=tokens_per_step * 86400 / step if step > 0 else math.inf,
        cross_cluster=cross,
    )


def format_estimate(plan: Plan, cluster: Cluster) -> str:
    """The plan as a short report."""
    m = plan.memory_per_rank
    lines = [
        f"cluster {cluster.name}: {plan.ranks} ranks ({plan.strategy})",
        f"parameters {plan.params:,}; {plan.flops_per_token:.3g} FLOPs per token (forward + backward)",
        "memory per rank: " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in m.items() if k != "total"),
        f"  peak {m['total'] / GB:.2f} GB (states + the larger transient) of {plan.memory_capacity / GB:.1f} GB usable: "
        + ("fits" if plan.fits else "DOES NOT FIT")
        + f"; largest micro-batch that fits: {plan.largest_micro_batch}",
        f"step: compute {plan.compute_s:.3g} s, communication {plan.communication['seconds']:.3g} s "
        f"({plan.communication['bytes'] / GB:.2f} GB per rank), step {plan.step_s:.3g} s, MFU {100 * plan.mfu:.1f}%",
        f"tokens per day: {plan.tokens_per_day:.3g}",
    ]
    if plan.cross_cluster:
        x = plan.cross_cluster
        lines.append(
            f"across clusters: sync {x['sync_seconds_per_step']:.3f} s/step, DiLoCo {x['diloco_seconds_per_step']:.4f} s/step"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Vocab:
    """The vocabulary a plan sizes the model with, and where it came from."""

    size: int
    source: str
    """`--vocab`, `model.vocab_size`, the manifest it was read from, or why it is assumed."""
    assumed: bool = False
    """True when nothing names the vocabulary and GPT-2's is used: every figure of the plan depends on it."""

    def describe(self) -> str:
        """One line for a report; an assumed vocabulary says how to give the real one."""
        if self.assumed:
            return (
                f"vocabulary {self.size:,} ASSUMED (GPT-2's): {self.source}; every figure depends on it: "
                "give the real one with --vocab N"
            )
        return f"vocabulary {self.size:,} (from {self.source})"


def plan_vocab(run: Any, flag: int | None = None) -> Vocab:
    """The vocabulary to plan `run` with: `flag` (--vocab), else the config's model.vocab_size, else its
    prepared data's manifest (data.dir), else GPT-2's, marked as assumed (the caller says so)."""
    from tenx.errors import TenxError
    from tenx.scaling.ladder.rungs import vocab_size_of

    explicit = run.model.vocab_size
    if flag is not None:
        if flag < 1:
            raise ConfigError(f"--vocab must be >= 1, got {flag}")
        if explicit is not None and explicit != flag:  # the model would be built with model.vocab_size
            raise ConfigError(
                f"--vocab {flag} disagrees with the config's model.vocab_size={explicit}; drop --vocab or "
                f"--set model.vocab_size={flag}"
            )
        return Vocab(flag, "--vocab")
    if explicit is not None:
        return Vocab(explicit, "model.vocab_size")
    try:
        return Vocab(vocab_size_of(run), f"the manifest of {run.data.dir}")
    except (TenxError, OSError, KeyError, TypeError, ValueError) as e:
        unread = f"data.dir {run.data.dir} is not prepared" if not Path(run.data.dir).exists() else str(e)
        return Vocab(DEFAULT_VOCAB, f"no --vocab, no model.vocab_size, and {unread}", assumed=True)


def vocab_of(run: Any) -> int:
    """The vocabulary size `plan_vocab` gives `run` (GPT-2's when nothing names one)."""
    return plan_vocab(run).size
