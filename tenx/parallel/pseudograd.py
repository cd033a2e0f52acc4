"""DiLoCo's pseudo-gradients in low precision across replica groups, with error feedback.

`parallel.replicas.pseudo_grad_dtype` picks what the cross-group all-reduce of an outer step carries; the
outer step itself (and everything else sent across groups) stays fp32. The collective is a SUM, so the
values are chosen such that the sum of every participating group's wire values is exact in the wire type:

- `bf16`: each value rounded to bf16 (2 bytes); gloo and NCCL sum bf16 natively (gloo accumulates in
  bf16 along its ring, so the sum adds a rounding per hop).
- `int8`: values share one scale per block of `BLOCK` values: first the blocks' max-abs values are
  all-reduced with MAX (4 bytes a block), then every value is rounded to an integer in [-k, k] with
  k = 127 // P for P participating groups (63 for two groups), so that the SUM cannot leave int8.
- `int4`: the same with 4 bits a value, two values packed in a byte: a value is stored as q + k in a
  nibble, with k = 15 // (2 P) (3 for two groups, at most 7 groups), so that neither nibble's sum can
  carry into the next or overflow the byte. Few levels per group is the price of an exact in-wire sum.

Bytes handed to the collectives per outer step of n values: fp32 4n, bf16 2n, int8 n + 4 ceil(n/BLOCK),
int4 ceil(n/2) + 4 ceil(n/BLOCK) (`wire_bytes`); `replica_bytes_sent` counts exactly these.

Error feedback (`parallel.replicas.error_feedback`, the scheme of 1-bit Adam and of Streaming DiLoCo):
each group keeps what rounding took from its pseudo-gradient (the residual, fp32, one model's worth of
memory) and adds it to its next outer step's pseudo-gradient, so nothing is lost, only delayed: the sum
of what a group sent tracks the sum of its true pseudo-gradients to within one rounding. The residual is
kept only when the outer step commits (a failed step restores the parameters, so its pseudo-gradient is
dropped and the residual is as before it). It is local and approximate state: it is not saved in
checkpoints and is reset when the group heals from a peer (its own drift is replaced then); a restarted
group starts with none, which costs at most one rounding per value.

A non-finite pseudo-gradient block travels as an infinite scale, and every group then gets NaN for that
block, as the fp32 all-reduce would give.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F

from tenx.errors import ConfigError, TenxError

PseudoGradDtype = Literal["fp32", "bf16", "int8", "int4"]
BLOCK = 2048  # values that share one int8/int4 scale: the scales add 4/BLOCK bytes a value (0.2%)
SCALE_BYTES = 4
MAX_GROUPS = {"int8": 127, "int4": 7}  # the most participants whose sum still fits the wire type


def levels(dtype: str, participants: int) -> int:
    """k: an int8/int4 value is rounded to an integer in [-k, k] so that P groups' sum fits the wire."""
    k = 127 // participants if dtype == "int8" else 15 // (2 * participants)
    if k < 1:
        raise TenxError(
            f"parallel.replicas.pseudo_grad_dtype={dtype!r} sums at most {MAX_GROUPS[dtype]} groups on the "
            f"wire, and {participants} take part"
        )
    return k


def wire_bytes(numel: int, dtype: str) -> int:
    """Bytes one group hands to the collectives for `numel` pseudo-gradient values (scales included)."""
    scales = SCALE_BYTES * -(-numel // BLOCK)
    return {"fp32": 4 * numel, "bf16": 2 * numel, "int8": numel + scales, "int4": -(-numel // 2) + scales}[
        dtype
    ]


def check_pseudo_grad(dtype: str, mode: str, groups: int) -> None:
    """validate(): no low precision in sync mode (fp32 gradients), and no more groups than the wire sums."""
    if dtype == "fp32":
        return
    if mode == "sync":
        raise ConfigError(
            f"parallel.replicas.pseudo_grad_dtype: {dtype!r} applies to DiLoCo's pseudo-gradients "
            "(mode 'diloco' or 'streaming-diloco'); mode 'sync' all-reduces fp32 gradients, so use 'fp32'"
        )
    if dtype in MAX_GROUPS and groups > MAX_GROUPS[dtype]:
        raise ConfigError(
            f"parallel.replicas.pseudo_grad_dtype: {dtype!r} sums at most {MAX_GROUPS[dtype]} groups exactly "
            f"on the wire, got groups={groups}; use 'int8' or 'bf16'"
        )


def _blocks(values: torch.Tensor) -> torch.Tensor:
    """The flat values zero-padded to whole blocks, one block a row."""
    return F.pad(values.reshape(-1), (0, -values.numel() % BLOCK)).view(-1, BLOCK)


def block_scales(values: torch.Tensor) -> torch.Tensor:
    """Each block's max |value| (fp32), +inf for a block holding a non-finite value (MAX spreads it)."""
    rows = _blocks(values.float())
    return torch.where(rows.isfinite().all(1), rows.abs().amax(1), torch.inf)


def encode(values: torch.Tensor, scales: torch.Tensor | None, dtype: str, k: int) -> torch.Tensor:
    """The wire tensor of `values` (flat): bf16; int8 in [-k, k]; int4 nibbles q + k, two a byte."""
    if dtype == "bf16":
        return values.reshape(-1).to(torch.bfloat16)
    assert scales is not None
    finite = scales.isfinite() & (scales > 0)
    inv = torch.where(finite, k / torch.where(finite, scales, 1.0), 0.0)
    q = torch.nan_to_num(_blocks(values.float()) * inv[:, None], nan=0.0).clamp(-k, k).round()
    q = q.reshape(-1)[: values.numel()]
    if dtype == "int8":
        return q.to(torch.int8)
    u = F.pad((q + k).to(torch.uint8), (0, values.numel() % 2))
    return u[0::2] | (u[1::2] << 4)


def decode(
    wire: torch.Tensor, scales: torch.Tensor | None, dtype: str, k: int, contributors: int, numel: int
) -> torch.Tensor:
    """The fp32 sum of `contributors` groups' values from their summed wire tensor (offsets removed)."""
    if dtype == "bf16":
        return wire.float()
    assert scales is not None
    if dtype == "int8":
        q = wire.float()
    else:
        q = torch.stack([wire & 15, wire >> 4], 1).reshape(-1)[:numel].float() - k * contributors
    return (_blocks(q) * (scales / k)[:, None]).reshape(-1)[:numel]


class PseudoGradCodec:
    """One group's side of low-precision pseudo-gradient all-reduces, with its error-feedback residuals."""

    def __init__(self, dtype: str, error_feedback: bool) -> None:
        self.dtype, self.error_feedback = dtype, error_feedback
        self._residual: dict[tuple[int, int], torch.Tensor] = {}  # (fragment, bucket) -> fp32 residual
        self._pending: dict[tuple[int, int], torch.Tensor] = {}  # the residuals of the sync under way
        self._bucket = 0  # buckets of the sync under way so far

    def allreduce(
        self, manager: Any, tensor: torch.Tensor, fragment: int, allreduce: Callable[..., Any]
    ) -> Any:
        """Average `tensor` (a flat fp32 bucket of `fragment`'s pseudo-gradients) across the groups the way
        torchft's Manager.allreduce does, sending it as `dtype`; returns the collective's work, whose
        future completes once `tensor` holds the average.

        `allreduce(t, reduce_op=...)` is the manager's own (it zeroes a non-participant's tensor, turns a
        failure into an errored manager and a step that does not commit, and counts the bytes)."""
        from torch.distributed import ReduceOp

        key, self._bucket = (fragment, self._bucket), self._bucket + 1
        participants = max(1, manager.num_participants())
        values = tensor.reshape(-1).float()
        residual = self._residual.get(key)
        if self.error_feedback and residual is not None and residual.numel() == values.numel():
            values = values + residual
        scales, k = None, 0
        if self.dtype != "bf16":
            k = levels(self.dtype, participants)
            scales = block_scales(values)
            work = allreduce(scales, reduce_op=ReduceOp.MAX)
            if not work.wait() or manager.errored():
                return allreduce(tensor)  # the manager is errored: a no-op, the step will not commit
        wire = encode(values, scales, self.dtype, k)
        if self.error_feedback and manager.is_participating():
            sent = decode(wire, scales, self.dtype, k, 1, values.numel())
            self._pending[key] = torch.nan_to_num(values - sent, nan=0.0, posinf=0.0, neginf=0.0)
        work = allreduce(wire, reduce_op=ReduceOp.SUM)

        def average(_: Any) -> torch.Tensor:
            total = decode(wire, scales, self.dtype, k, participants, values.numel())
            tensor.copy_((total / participants).view_as(tensor))
            return tensor

        work.get_future().then(average)
        return work

    def settle(self, committed: bool) -> None:
        """After the outer step's commit vote: keep the new residuals if it committed, else the old ones."""
        if committed:
            self._residual.update(self._pending)
        self._pending.clear()
        self._bucket = 0

    def reset(self) -> None:
        """Forget every residual (the group took a peer's state)."""
        self._residual.clear()
        self.settle(False)


def make_codec(dtype: str, error_feedback: bool) -> PseudoGradCodec | None:
    """The codec of `parallel.replicas.pseudo_grad_dtype`; None for fp32 (torchft's own all-reduce)."""
    return None if dtype == "fp32" else PseudoGradCodec(dtype, error_feedback)


def counting_manager(base: type, replicas: Any) -> type:
    """torchft's Manager, counting the payload of every cross-group all-reduce that has another group to
    talk to in `replicas.bytes_sent`, and sending DiLoCo's pseudo-gradients through `replicas._codec`
    (its all-reduces are the ones made while `replicas._phase` is 'sync')."""

    class CountingManager(base):  # type: ignore[valid-type,misc]
        """torchft's Manager with tenx's byte count and pseudo-gradient codec."""

        def allreduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if replicas._codec is not None and replicas._phase == "sync":
                fragment = replicas._diloco._current_fragment()
                return replicas._codec.allreduce(self, tensor, fragment, self._counted_allreduce)
            return self._counted_allreduce(tensor, *args, **kwargs)

        def _counted_allreduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = super().allreduce(tensor, *args, **kwargs)
            if self.num_participants() > 1 and not self.errored():
                replicas.bytes_sent += tensor.numel() * tensor.element_size()
            return work

        def should_commit(self, *args: Any, **kwargs: Any) -> bool:
            commit = bool(super().should_commit(*args, **kwargs))
            if replicas._codec is not None and replicas._phase == "sync":
                replicas._codec.settle(commit)
            return commit

    return CountingManager
