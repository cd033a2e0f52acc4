"""Replica groups across clusters with torchft: fault-tolerant data parallelism and DiLoCo.

Each cluster is a replica group (itself a torchrun job, or one process). Groups find each other through
torchft's lighthouse (`tenx lighthouse`), which forms a quorum of the live groups; every rank of a group
runs a torchft `Manager` that joins the quorum, reconfigures a cross-group process group (gloo on CPU,
NCCL on CUDA) and, when its group is behind, heals it with a live peer's state over torchft's HTTP
checkpoint transport.

- `sync`: every step begins with a quorum; gradients, already reduced within the group, are averaged across
  the groups in the quorum (flat buckets); the optimizer steps only if every group's all-reduce succeeded
  (`Manager.should_commit`), otherwise the trainer takes the step again with the groups still alive.
- `diloco` / `streaming-diloco`: torchft's `DiLoCo`. Each group takes `sync_every` inner steps alone; then
  the pseudo-gradients (weights at the last outer step minus the current ones) are averaged across groups
  and an outer SGD Nesterov step is applied; streaming splits the model into `fragments` synced at
  staggered steps. The outer step runs from `end_step`, i.e. after the trainer counted the inner step,
  so that every state a peer sends or receives is a state between two trainer steps.

Steps: the trainer's `step` counts inner optimizer steps in every mode. The torchft manager's step counts
commits: one per trainer step in `sync`, one per (fragment) outer sync in the DiLoCo modes, plus one when a
DiLoCo group joins. A group that starts (fresh or resumed from its own checkpoint) starts its manager at
step 0 on purpose: any live peer is ahead of it, so it always heals from that peer before training with
it. Bytes: `replica_bytes_sent` counts the payload this process hands to cross-group all-reduces while at
least one other group is in the quorum (see docs/multi-cluster.md for the wire factor); low-precision
pseudo-gradients: tenx/parallel/pseudograd.py; the 'auto' outer lr and momentum: tenx/parallel/outer.py.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from tenx.config import field
from tenx.errors import ConfigError, TenxError
from tenx.parallel.outer import resolve_outer
from tenx.parallel.peer_transport import TensorTransport, read_secret
from tenx.parallel.pseudograd import PseudoGradDtype, check_pseudo_grad, counting_manager, make_codec
from tenx.parallel.torchft_glue import (
    _fragments,
    _gloo_on_host,
    _manager_server_on,
    _quiet_refusals,
    quiet_torchft,
    store_on_host,
)
from tenx.utils.net import url_host
from tenx.utils.tensors import local_tensor

GROUP_ENV = "TENX_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"


@dataclass
class ReplicaConfig:
    """Fault-tolerant replica groups (one per cluster) coordinated by a torchft lighthouse."""

    mode: Literal["off", "sync", "diloco", "streaming-diloco"] = field(
        "off",
        help="'off': one group; 'sync': fault-tolerant data parallel across groups every step; 'diloco': "
        "inner AdamW steps, an outer Nesterov step on averaged pseudo-gradients every sync_every steps; "
        "'streaming-diloco': DiLoCo with the model in fragments synced at staggered steps",
    )
    groups: int = field(1, ge=1, help="replica groups the data is split across (each reads its own share)")
    group_id: int = field(0, help="this group's index in [0, groups); env TENX_REPLICA_GROUP overrides it")
    lighthouse: str = field(
        "", help="lighthouse address http://HOST:PORT (`tenx lighthouse`); env TORCHFT_LIGHTHOUSE if empty"
    )
    min_groups: int = field(1, help="fewest groups that may take a step (the others heal and rejoin)")
    sync_every: int = field(50, ge=1, help="diloco: inner steps between outer steps (H)")
    outer_lr: float | Literal["auto"] = field(
        "auto",
        help="diloco: outer SGD learning rate; 'auto': by the run's outer steps (tenx/parallel/outer.py)",
    )
    outer_momentum: float | Literal["auto"] = field(
        "auto", help="diloco: outer Nesterov momentum; 'auto': 0.9 for 100+ outer steps, less for fewer"
    )
    pseudo_grad_dtype: PseudoGradDtype = field(
        "fp32",
        help="diloco: what the pseudo-gradients travel as across groups: 'fp32', 'bf16', 'int8' (block-scaled, "
        "1 byte a value) or 'int4' (4 bits, at most 7 groups); the outer step stays fp32",
    )
    error_feedback: bool = field(
        True,
        help="diloco, pseudo_grad_dtype not fp32: each group keeps the rounding error of what it sent and adds "
        "it to its next pseudo-gradient (not checkpointed; reset when the group heals)",
    )
    fragments: int = field(2, help="streaming-diloco: model fragments synced at staggered steps")
    fragment_sync_delay: int = field(
        0, help="streaming-diloco: inner steps a fragment's all-reduce may overlap before it is applied"
    )
    timeout_s: float = field(
        60.0, gt=0, help="collectives and quorum timeout (a dead peer is dropped after it)"
    )
    quorum_timeout_s: float = field(
        1800.0,
        gt=0,
        help="longest wait for a quorum; a DiLoCo group that (re)joins waits for its peers' next outer "
        "step, so this must exceed sync_every inner steps",
    )
    bucket_mb: float = field(
        25.0, gt=0, help="sync: gradients are all-reduced across groups in flat buckets this big"
    )
    manager_port: int = field(
        0, ge=0, lt=65536, help="port of the torchft manager server of this group's rank 0 (0: any free port)"
    )
    host: str = field(
        "127.0.0.1",
        help="the address this group listens on and gives its peers (its store, torchft manager server, "
        "healing server and cross-group gloo): 127.0.0.1 when every group runs on this machine, this "
        "machine's address on the network the groups share otherwise (docs/security.md)",
    )
    auth_window_s: float = field(
        60.0, gt=0, help="with TENX_REPLICA_SECRET: refuse healing requests signed further than this from now"
    )

    def validate(self) -> None:
        """Check the group id and sizes against `groups`, fragments and the host; names the field."""
        check_pseudo_grad(self.pseudo_grad_dtype, self.mode, self.groups)
        if not 0 <= self.group_id < self.groups:
            raise ConfigError(
                f"parallel.replicas.group_id: must be in [0, {self.groups}), got {self.group_id}"
            )
        if not 1 <= self.min_groups <= self.groups:
            raise ConfigError(
                f"parallel.replicas.min_groups: must be in [1, groups={self.groups}], got {self.min_groups}"
            )
        if self.mode == "streaming-diloco":
            if self.fragments < 1 or self.sync_every % self.fragments:
                raise ConfigError(
                    f"parallel.replicas.fragments: must be >= 1 and divide sync_every={self.sync_every}, "
                    f"got {self.fragments}"
                )
            if self.fragment_sync_delay >= self.sync_every // self.fragments:
                raise ConfigError(
                    "parallel.replicas.fragment_sync_delay: must be < sync_every / fragments, got "
                    f"{self.fragment_sync_delay}"
                )
        if not self.host or self.host.strip("[]") in ("0.0.0.0", "::", "*"):
            raise ConfigError(
                f"parallel.replicas.host: {self.host!r} is not one address: name the interface the groups "
                "share (127.0.0.1 on one machine), so nothing listens on the others (docs/security.md)"
            )


def resolve_group_id(cfg: ReplicaConfig) -> int:
    """This group's id: env TENX_REPLICA_GROUP when set, else parallel.replicas.group_id."""
    raw = os.environ.get(GROUP_ENV, "")
    if not raw:
        return cfg.group_id
    try:
        group_id = int(raw)
    except ValueError:
        raise TenxError(f"{GROUP_ENV}={raw!r}: must be an integer group id") from None
    if not 0 <= group_id < cfg.groups:
        raise TenxError(f"{GROUP_ENV}={group_id}: must be in [0, parallel.replicas.groups={cfg.groups})")
    return group_id


def resolve_lighthouse(cfg: ReplicaConfig) -> str:
    """The lighthouse address: parallel.replicas.lighthouse, else env TORCHFT_LIGHTHOUSE."""
    address = cfg.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise TenxError(
            f"parallel.replicas.mode={cfg.mode!r} needs a lighthouse: set parallel.replicas.lighthouse="
            f"http://HOST:PORT (started with `tenx lighthouse --bind HOST:PORT`) or env {LIGHTHOUSE_ENV}"
        )
    if "://" not in address:
        address = f"http://{address}"
    return address


class LocalStep:
    """The cross-group part of a step without replica groups: nothing to agree on (see Replicas)."""

    def begin_step(self) -> None:
        """Nothing to wait for."""

    def reduce(self, model: nn.Module, loss_sum: torch.Tensor) -> None:
        """Nothing to average."""

    def commit(self) -> bool:
        """Always: no peer can fail the step."""
        return True

    def end_step(self) -> dict[str, float]:
        """No metrics."""
        return {}


class Replicas:
    """This process's side of the replica groups: torchft manager, cross-group reductions, DiLoCo, healing."""

    def __init__(
        self, cfg: ReplicaConfig, *, rank: int, world_size: int, device: torch.device, events: Any
    ) -> None:
        if cfg.mode == "off":
            raise TenxError("parallel.replicas.mode='off': no replica groups to join")
        self.cfg = cfg
        self.rank, self.world_size, self.device, self.events = rank, world_size, device, events
        self.group_id = resolve_group_id(cfg)
        self.num_groups, self.mode = cfg.groups, cfg.mode
        self.sync_every = cfg.sync_every if cfg.mode != "sync" else 1
        self.lighthouse = resolve_lighthouse(cfg)
        self.bytes_sent = self.heals = self.outer_steps = self.participants = 0
        self._groups_seen: tuple[int, ...] = ()
        self._manager: Any = None
        self._pg: Any = None
        self._store: Any = None
        self._diloco: Any = None
        self._codec = make_codec(cfg.pseudo_grad_dtype, cfg.error_feedback)  # None: fp32
        self._phase = "attach"
        self._pending_join: dict[str, Any] | None = None
        self._quorum_started = 0.0
        self._wait_s = 0.0
        self._state_dict_fn: Callable[[], dict] | None = None
        self._transport: TensorTransport | None = None
        self.host = cfg.host
        _quiet_refusals()

    # ----- setup ----------------------------------------------------------------------------------
    def attach(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state_dict: Callable[[], dict],
        load_state_dict: Callable[[dict], None],
        total_steps: int | None = None,
    ) -> None:
        """Start the manager (and DiLoCo, whose 'auto' outer lr/momentum follow `total_steps` if given); a
        DiLoCo group joins its peers here, healing from one if behind."""
        quiet_torchft()
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        replicas, host = self, self.host
        timeout = datetime.timedelta(seconds=self.cfg.timeout_s)

        CountingManager = counting_manager(Manager, self)
        pg_class = ProcessGroupNCCL if self.device.type == "cuda" else ProcessGroupGloo

        class TrackedPG(pg_class):  # type: ignore[valid-type,misc]
            """Remembers which groups the manager configured it with (for the replica-quorum event);
            gloo listens on `parallel.replicas.host` rather than on the interface of the machine's name."""

            def configure(self, *args: Any, **kwargs: Any) -> None:
                ranks = kwargs.get("global_ranks", args[7] if len(args) > 7 else None)
                if ranks:
                    replicas._groups_seen = tuple(sorted({r // replicas.world_size for r in ranks}))
                super().configure(*args, **kwargs)

            def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
                if pg_class is not ProcessGroupGloo:
                    return super()._create_pg(store, rank, world_size)
                return _gloo_on_host(self, store, rank, world_size, host)

        store_addr, store_port = self._group_store()
        self._pg = TrackedPG(timeout=timeout)
        self._state_dict_fn = state_dict

        def save() -> dict[str, Any]:
            replica_state = {"group": self.group_id, "phase": self._phase, "local_step": self._local_step()}
            return {"trainer": state_dict(), "replicas": replica_state}

        def load(state: dict[str, Any]) -> None:
            self._heal(state, load_state_dict)

        secret, window = read_secret(), self.cfg.auth_window_s  # window: against replayed requests
        self._transport = TensorTransport(
            host, timeout, secret=secret, template=self._own_state, auth_window_s=window
        )
        with _manager_server_on(host):
            self._manager = CountingManager(
                pg=self._pg,
                load_state_dict=None,
                state_dict=None,
                min_replica_size=self.cfg.min_groups,
                use_async_quorum=False,  # heal before the forward pass; DiLoCo requires it
                timeout=timeout,
                quorum_timeout=datetime.timedelta(seconds=self.cfg.quorum_timeout_s),
                connect_timeout=timeout,
                rank=self.rank,
                world_size=self.world_size,
                store_addr=store_addr,
                store_port=store_port,
                lighthouse_addr=self.lighthouse,
                replica_id=f"tenx_group_{self.group_id}",  # torchft reads the group id from trailing digits
                port=self.cfg.manager_port or None,
                hostname=host,  # the address the lighthouse gives the other groups
                checkpoint_transport=self._transport,  # tensors and JSON only, never a pickle
            )
        self._manager.register_state_dict_fn("tenx", load, save)
        self._announce_listening(store_addr, store_port)
        if self.mode in ("diloco", "streaming-diloco"):
            from torchft.local_sgd import DiLoCo

            fragments = _fragments(model, self.cfg.fragments if self.mode == "streaming-diloco" else 1)
            lr, momentum = resolve_outer(
                self.cfg.outer_lr, self.cfg.outer_momentum, total_steps, self.sync_every
            )
            if self.rank == 0:
                print(f"tenx: diloco outer SGD lr {lr:g}, Nesterov momentum {momentum:g}", flush=True)
            outer = [
                torch.optim.SGD(frag.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
                for frag in fragments
            ]
            self._optimizer = optimizer
            self._diloco = DiLoCo(
                self._manager,
                fragments,
                optimizer,
                outer,
                sync_every=self.cfg.sync_every,
                pin_memory=False,
                use_bucketization=True,
                fragment_sync_delay=self.cfg.fragment_sync_delay if self.mode == "streaming-diloco" else 0,
            )
            self._join()
        self._phase = "step"

    def _group_store(self) -> tuple[str, int]:
        """The TCPStore of this group (peers rendezvous through it too): torchrun's, or one on `host`."""
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ and "RANK" in os.environ:
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if self.world_size > 1:
            raise TenxError("replica groups of several processes must be started with torchrun")
        host = self.host.strip("[]")
        self._store, port = store_on_host(host)
        return host, port

    def _announce_listening(self, store_addr: str, store_port: int) -> None:
        """Say what this process listens on (docs/security.md lists the same): print and event."""
        server = self._manager._manager
        listening = {
            "healing": f"{url_host(self._transport.host)}:{self._transport.port}",
            **({"manager": server.address().split("://")[-1]} if server is not None else {}),
            **({"store": f"{url_host(store_addr)}:{store_port}"} if self._store is not None else {}),
        }
        print(
            f"tenx: replica group {self.group_id} rank {self.rank} listens on "
            + ", ".join(f"{k} {v}" for k, v in listening.items())
            + f", and gloo on {self.host} (authenticated: {'yes' if self._transport.secret else 'no'})",
            flush=True,
        )
        self.events.emit("replica-listen", None, group=self.group_id, rank=self.rank, **listening)

    def _own_state(self) -> dict[str, Any]:
        """This process's state as torchft sends it: the template a peer's state is checked against."""
        return self._manager._manager_state_dict()  # type: ignore[no-any-return]

    def _join(self) -> None:
        """DiLoCo start: one quorum. Peers already training are at an outer step: heal and take it with them."""
        self._start_quorum()
        join = self._pending_join
        self._pending_join = None
        diloco = self._diloco
        if join is not None and join["phase"] == "sync":
            # Our peers are in the middle of an outer sync (their quorum is ours): contribute the same
            # pseudo-gradient as the peer we healed from, so that the outer step is taken together.
            diloco._local_step = join["local_step"]
            self._phase = "sync"
            before = self._manager.current_step()
            diloco._fragments[diloco._current_fragment()].prepare_sync()
            if diloco._local_step >= diloco._sync_every:
                diloco._fragments[diloco._current_fragment()].perform_sync()
                diloco._local_step = 0
            self.outer_steps += self._manager.current_step() - before
        else:
            # Everybody starts here together (or alone): one commit, so that a group that starts later is
            # behind and heals from us instead of being taken as an equal at step 0.
            self._manager.should_commit()

    def _local_step(self) -> int:
        return int(self._diloco._local_step) if self._diloco is not None else 0

    # ----- healing and quorums --------------------------------------------------------------------
    def _trainer_step(self, state: dict[str, Any] | None = None) -> int | None:
        """The trainer's step in its state dict (ours when `state` is None), for events; None if absent."""
        if state is None:
            if self._state_dict_fn is None:
                return None
            state = self._state_dict_fn()
        inner = state.get("trainer") if isinstance(state, dict) else None
        step = inner.get("step") if isinstance(inner, dict) else None
        return int(step) if step is not None else None

    def _heal(self, state: dict[str, Any], load_state_dict: Callable[[dict], None]) -> None:
        """Take a live peer's state (called by torchft inside start_quorum, on the training thread)."""
        before = self._trainer_step()
        load_state_dict(state["trainer"])
        if self._codec is not None:
            self._codec.reset()  # its residuals were our own drift's, which the peer's state replaces
        peer = state["replicas"]
        if self._diloco is not None:
            self._diloco._local_step = int(peer["local_step"])
            if self._phase == "attach":
                self._pending_join = peer
        self.heals += 1
        seconds = time.perf_counter() - self._quorum_started
        after = self._trainer_step(state["trainer"])
        print(
            f"tenx: replica group {self.group_id} healed from group {peer['group']}: step {before} -> "
            f"{after} in {seconds:.2f}s",
            flush=True,
        )
        self.events.emit(
            "replica-heal",
            after,
            from_group=peer["group"],
            group=self.group_id,
            step_before=before,
            step_after=after,
            seconds=seconds,
            rank=self.rank,
        )

    def _start_quorum(self) -> None:
        """Join the next quorum (healing from a peer if behind); note a change of participants.

        A peer state the transport refused stops this group with that reason (TenxError), whatever
        torchft made of the failed heal."""
        self._quorum_started = time.perf_counter()
        try:
            self._manager.start_quorum()
        except Exception:
            self._raise_refusal()
            raise
        self._raise_refusal()
        self._note_quorum()

    def _raise_refusal(self) -> None:
        refused = self._transport.refused if self._transport is not None else None
        if refused is not None:
            self.events.emit(
                "replica-refused",
                self._trainer_step(),
                group=self.group_id,
                rank=self.rank,
                reason=str(refused),
            )
            raise TenxError(f"replica group {self.group_id}: {refused}") from None

    def _note_quorum(self) -> None:
        participants = self._manager.num_participants()
        groups = self._groups_seen
        if participants != self.participants:
            self.participants = participants
            if self.rank == 0:
                print(
                    f"tenx: replica quorum: {participants} of {self.num_groups} groups {list(groups)}",
                    flush=True,
                )
            self.events.emit(
                "replica-quorum",
                self._trainer_step(),
                participants=participants,
                groups=list(groups),
                group=self.group_id,
                rank=self.rank,
            )

    # ----- the step -------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Before the forward pass. sync: the quorum (a group behind its peers heals here)."""
        if self.mode == "sync":
            t0 = time.perf_counter()
            self._start_quorum()
            self._wait_s += time.perf_counter() - t0

    @torch.no_grad()
    def reduce_gradients(self, model: nn.Module) -> None:
        """sync: average every gradient across the groups in the quorum, in flat buckets; diloco: nothing."""
        if self.mode != "sync":
            return
        t0 = time.perf_counter()
        grads: list[torch.Tensor] = []
        for p in model.parameters():
            if p.grad is None:  # every group must reduce the same buckets: a missing gradient is zero
                p.grad = torch.zeros_like(p)
            grads.append(local_tensor(p.grad))
        cap = int(self.cfg.bucket_mb * 2**20)
        buckets: list[list[torch.Tensor]] = []
        size = 0
        for g in grads:
            nbytes = g.numel() * g.element_size()
            if not buckets or size + nbytes > cap or buckets[-1][0].dtype != g.dtype:
                buckets.append([])
                size = 0
            buckets[-1].append(g)
            size += nbytes
        flats = [torch.cat([g.reshape(-1) for g in bucket]) for bucket in buckets]
        # A peer dying mid-all-reduce makes the work fail; torchft records the error, should_commit() then
        # returns False and the trainer takes the step again, so a failed bucket is simply left as it is.
        works = [self._manager.allreduce(flat) for flat in flats]
        for work in works:
            work.wait()
        for bucket, flat in zip(buckets, flats):
            offset = 0
            for g in bucket:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self._wait_s += time.perf_counter() - t0

    def reduce(self, model: nn.Module, loss_sum: torch.Tensor) -> None:
        """After the group's own reduction. sync: average gradients and the step's loss across the groups
        (one loss for every group, so every guard decides alike); diloco: nothing."""
        if self.mode == "sync":
            self.reduce_gradients(model)
            self.allreduce_mean_(loss_sum)

    def commit(self) -> bool:
        """Whether the optimizer may step (see should_commit)."""
        return self.should_commit()

    def should_commit(self) -> bool:
        """Just before optimizer.step(): sync: did every group's reduction succeed; diloco: always."""
        if self.mode == "sync":
            t0 = time.perf_counter()
            commit = bool(self._manager.should_commit())
            self._wait_s += time.perf_counter() - t0
            return commit
        return True

    def end_step(self) -> dict[str, float]:
        """After the optimizer step: DiLoCo's inner-step count and, every sync_every steps, the outer step.

        Returns the step's metrics; `replica_wait_s` is the time this step spent in quorums, cross-group
        all-reduces, commits and outer steps (not in the trainer's `step_time_s` for the outer step).
        """
        t0 = time.perf_counter()
        if self._diloco is not None:
            before = self._manager.current_step()
            self._phase = "sync"
            try:
                # DiLoCo's optimizer post-hook, called once per trainer step (also a step the guard skipped),
                # so that every group counts the same steps and a sent state is one between trainer steps.
                self._diloco._step_post_hook(self._optimizer, (), {})
            finally:
                self._phase = "step"
            if self._diloco._local_step == 0 or self._manager.current_step() != before:
                self._note_quorum()
            self.outer_steps += self._manager.current_step() - before
        wait_s, self._wait_s = self._wait_s + time.perf_counter() - t0, 0.0
        return {
            "replica_participants": float(self.participants),
            "replica_bytes_sent": float(self.bytes_sent),
            "replica_outer_steps": float(self.outer_steps),
            "replica_heals": float(self.heals),
            "replica_wait_s": wait_s,
        }

    def allreduce_sum_(self, t: torch.Tensor) -> None:
        """Sum an integer tensor in place across the groups in the current quorum (ours alone if one failed)."""
        from torch.distributed import ReduceOp

        mine = t.clone()
        work = self._manager.allreduce(t, reduce_op=ReduceOp.SUM)
        if not work.wait() or self._manager.errored():
            t.copy_(mine)  # a peer failed: only our own contribution is known (the step will not commit)

    def allreduce_mean_(self, t: torch.Tensor) -> None:
        """Average a float tensor in place across the groups in the current quorum (ours alone if one failed)."""
        mine = t.clone()
        work = self._manager.allreduce(t)  # torchft's default reduction: the mean over participants
        if not work.wait() or self._manager.errored():
            t.copy_(mine)

    # ----- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters for the trainer's checkpoints (JSON). The manager step is informational: see module doc."""
        return {
            "manager_step": int(self._manager.current_step()) if self._manager is not None else 0,
            "bytes_sent": self.bytes_sent,
            "heals": self.heals,
            "outer_steps": self.outer_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters; the manager starts at step 0 so that the group heals from a live peer."""
        self.bytes_sent = int(state.get("bytes_sent", 0))
        self.heals = int(state.get("heals", 0))
        self.outer_steps = int(state.get("outer_steps", 0))

    def close(self) -> None:
        """Shut the manager (its server and checkpoint transport) down."""
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None
        if self._pg is not None:
            try:
                self._pg.abort(errored=False)
            except Exception:  # noqa: BLE001 - a process group that never configured has nothing to abort
                pass
            self._pg = None
        self._store = None
