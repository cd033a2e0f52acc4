"""Where tenx reaches into torchft 0.2 to choose what listens where, and to report refusals in one line.

torchft has no option for the address its manager server binds, and its reconfigurable gloo process group
listens on the interface of the machine's name; these helpers make both listen on
`parallel.replicas.host` (docs/security.md).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import socket
import threading
from typing import Any

import torch
from torch import nn

from tenx.errors import ConfigError, TenxError
from tenx.parallel.peer_transport import PeerStateError
from tenx.utils.net import url_host

_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _manager_server_on(host: str) -> Any:
    """While a torchft Manager is built: its server listens on `host`, not on every interface.

    torchft 0.2 hard-codes the bind address `[::]:PORT` inside `Manager.__init__`; the server class is
    looked up in `torchft.manager` at that moment, so it is swapped for one that rewrites the address.
    """
    import torchft.manager as tm

    original = tm.ManagerServer

    def on_host(*args: Any, bind: str, **kwargs: Any) -> Any:
        port = bind.rpartition(":")[2]
        return original(*args, bind=f"{url_host(host)}:{port}", **kwargs)

    with _PATCH_LOCK:
        tm.ManagerServer = on_host  # type: ignore[assignment,misc]
        try:
            yield
        finally:
            tm.ManagerServer = original  # type: ignore[misc]


def _gloo_on_host(pg: Any, store: Any, rank: int, world_size: int, host: str) -> Any:
    """torchft's ProcessGroupGloo._create_pg with one change: gloo's device listens on `host`."""
    from torch.distributed import ProcessGroup
    from torch.distributed import ProcessGroupGloo as BaseGloo

    opts = BaseGloo._Options()
    opts._timeout = pg._timeout
    opts._devices = [BaseGloo.create_device(hostname=host.strip("[]"))]
    base = ProcessGroup(store, rank, world_size)
    base._set_default_backend(ProcessGroup.BackendType.GLOO)
    backend = BaseGloo(store, rank, world_size, opts)
    backend._set_sequence_number_for_group()
    if pg._global_ranks:
        backend.options.global_ranks_in_group = pg._global_ranks
    if pg._group_rank and pg._group_world_size:
        backend.options.group_name = (
            f"torchft_quorum_{pg._quorum_id}_rank_{pg._group_rank % pg._group_world_size}"
        )
    base._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    return base


def quiet_torchft() -> None:
    """torchft's Rust manager and lighthouse log every quorum and commit at INFO (dozens of lines a
    second between the progress lines): default them to warnings unless the user set RUST_LOG. Called
    before torchft's first server starts, which is when its logger reads the variable."""
    os.environ.setdefault("RUST_LOG", "warn")


class _RefusalWithoutTraceback(logging.Filter):
    """torchft logs a refused peer state with a traceback; tenx reports it as one clear line instead.
    Without CUDA it also drops torchft's warning that NCCL's flight recorder cannot be reset (there is
    no NCCL to record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], PeerStateError):
            record.exc_info = None
            record.exc_text = None
        if "NCCL flight recorder" in record.getMessage() and not torch.cuda.is_available():
            return False
        return True


_REFUSAL_FILTER = _RefusalWithoutTraceback()


def _quiet_refusals() -> None:
    """Install the filter on torchft's manager logger once per process (each group object asks)."""
    logger = logging.getLogger("torchft.manager")
    if _REFUSAL_FILTER not in logger.filters:
        logger.addFilter(_REFUSAL_FILTER)


def store_on_host(host: str) -> tuple[Any, int]:
    """A TCPStore master listening on `host` only: (store, port).

    TCPStore binds every interface when it opens its own socket, so it is handed one already listening
    on `host` (`master_listen_fd`), which it owns from then on.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise TenxError(
            f"parallel.replicas.host={host!r}: cannot listen there ({e}); give an address of "
            "this machine (127.0.0.1 when every group runs here)"
        ) from None
    port = sock.getsockname()[1]
    fd = sock.detach()
    try:
        store = torch.distributed.TCPStore(
            host,
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=datetime.timedelta(seconds=60),
            master_listen_fd=fd,
        )
    except Exception:
        os.close(fd)
        raise
    return store, port


def _fragments(model: nn.Module, count: int) -> list[nn.Module]:
    """The model's parameters cut into `count` contiguous fragments of about equal size (shared objects)."""
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    pieces: list[list[nn.Parameter]] = [[] for _ in range(count)]
    seen = 0
    for p in params:
        pieces[min(count - 1, seen * count // max(total, 1))].append(p)
        seen += p.numel()
    if any(not piece for piece in pieces):
        raise ConfigError(
            f"parallel.replicas.fragments={count}: the model has too few parameter tensors ({len(params)})"
        )
    return [nn.ParameterList(piece) for piece in pieces]
