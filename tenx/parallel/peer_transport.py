"""Healing state sent between replica groups as tensors and JSON only, on the interface the user chose.

torchft heals a group that is behind with a live peer's state, fetched over HTTP. Its own transport
pickles that state and loads it with `weights_only=False`, listening on every interface: whoever the
lighthouse names as a peer could run code in every group, and anyone on the network could download the
weights. `TensorTransport` replaces it (`Manager(checkpoint_transport=...)`):

- **Format `tenx-peer/1`**: a JSON skeleton of the state (dicts, lists, numbers, strings, booleans, None)
  whose tensors are stored by name in one safetensors blob. Loading it runs no code: `json.loads` and
  `safetensors` only. Anything else in a state (an object, a function) is refused when it is *sent*.
- **Checked on receipt**: the peer's URL must be the one this format serves; the body is read up to a
  bound (a few times this process's own state); every received tensor at a path this process also holds
  must have the same shape and dtype. Anything else raises `PeerStateError`, which names the peer.
- **Listening**: the server binds `host` (parallel.replicas.host, loopback by default), never all
  interfaces unless asked.
- **Shared secret** (env `TENX_REPLICA_SECRET`, the same in every group): a request carries an HMAC of
  the URL it fetches, its time and a random nonce; the server refuses one whose time is more than
  `auth_window_s` (parallel.replicas.auth_window_s, 60 s) from its own clock, and one whose nonce it has
  already served within that window, so a captured request cannot be replayed. A response carries an HMAC
  of the request's nonce and its body, so a stranger can neither download the state nor feed a forged or
  an old one. Nothing is encrypted: on a network you do not trust, run the groups over a VPN or tunnel
  (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import math
import os
import re
import secrets
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from tenx.errors import TenxError
from tenx.utils.net import url_host
from tenx.utils.tensors import local_tensor

FORMAT = "tenx-peer/1"
MAGIC = b"TENXPEER1\n"
SECRET_ENV = "TENX_REPLICA_SECRET"
AUTH_HEADER = "X-Tenx-Auth"
TIME_HEADER = "X-Tenx-Time"
NONCE_HEADER = "X-Tenx-Nonce"
BODY_MAC_HEADER = "X-Tenx-Body-Mac"
AUTH_WINDOW_S = 60.0
"""Default of how far (either way) a request's time may be from the server's clock."""
MAX_NONCES = 4096
"""Nonces a server remembers within its window; past this it refuses requests (503) until some expire."""
_NONCE = re.compile(r"^[0-9a-f]{32}$")
_PATH = re.compile(r"^/tenx-peer/(\d{1,20})$")
_URL = re.compile(r"^http://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})/tenx-peer/$")
_MAX_HEADER = 64 * 2**20


class PeerStateError(TenxError):
    """A peer's healing state was refused (malformed, forged, too large, or not this model's)."""


# ----- the format -----------------------------------------------------------------------------------
def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _encode(node: Any, tensors: dict[str, torch.Tensor], seen: dict[int, str], path: str) -> Any:
    """The JSON skeleton of `node`; tensors are moved into `tensors` under generated names."""
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, torch.Tensor):
        kind = "dtensor" if hasattr(node, "to_local") else "tensor"
        local = local_tensor(node)
        name = seen.get(id(node))
        if name is None:
            name = seen[id(node)] = f"t{len(tensors)}"
            # A private contiguous CPU copy: safetensors refuses tensors that share memory.
            tensors[name] = local.detach().to("cpu", copy=True).contiguous()
        return {"__" + kind + "__": name}
    if isinstance(node, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in node):
            return {k: _encode(v, tensors, seen, _join(path, k)) for k, v in node.items()}
        return {
            "__items__": [
                [_encode(k, tensors, seen, path), _encode(v, tensors, seen, _join(path, k))]
                for k, v in node.items()
            ]
        }
    if isinstance(node, tuple):
        return {"__tuple__": [_encode(v, tensors, seen, f"{path}[{i}]") for i, v in enumerate(node)]}
    if isinstance(node, list):
        return [_encode(v, tensors, seen, f"{path}[{i}]") for i, v in enumerate(node)]
    raise TenxError(
        f"replica state at {path or 'the root'} is a {type(node).__name__}; tenx sends only tensors, "
        "numbers, strings, lists and dicts to a healing peer"
    )


def encode_state(state: Any) -> bytes:
    """`state` as tenx-peer/1 bytes: magic, header length, JSON skeleton, safetensors blob."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(state, tensors, {}, "")
    header = json.dumps({"format": FORMAT, "tree": skeleton}, separators=(",", ":")).encode()
    blob = save(tensors) if tensors else b""
    return MAGIC + struct.pack("<Q", len(header)) + header + blob


def _decode(node: Any, tensors: dict[str, torch.Tensor], depth: int) -> Any:
    if depth > 200:
        raise ValueError("nesting deeper than 200 levels")
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, list):
        return [_decode(v, tensors, depth + 1) for v in node]
    if not isinstance(node, dict):
        raise ValueError(f"unexpected JSON value {type(node).__name__}")
    if len(node) == 1:
        ((key, value),) = node.items()
        if key in ("__tensor__", "__dtensor__"):
            if not isinstance(value, str) or value not in tensors:
                raise ValueError(f"tensor reference {value!r} is not in the payload")
            return tensors[value]  # a DTensor's local shard; rewrapped by the receiver (see _match)
        if key == "__tuple__":
            if not isinstance(value, list):
                raise ValueError("__tuple__ must hold a list")
            return tuple(_decode(v, tensors, depth + 1) for v in value)
        if key == "__items__":
            if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
                raise ValueError("__items__ must hold [key, value] pairs")
            out = {}
            for k, v in value:
                k = _decode(k, tensors, depth + 1)
                if not isinstance(k, (str, int, float, bool, tuple)) and k is not None:
                    raise ValueError(f"dict key of type {type(k).__name__}")
                out[k] = _decode(v, tensors, depth + 1)
            return out
    if any(k.startswith("__") for k in node):
        raise ValueError(f"unknown marker among keys {sorted(node)[:3]}")
    return {k: _decode(v, tensors, depth + 1) for k, v in node.items()}


def decode_state(body: bytes) -> Any:
    """Parse tenx-peer/1 bytes (runs no code); ValueError says what is wrong."""
    from safetensors.torch import load

    if not body.startswith(MAGIC) or len(body) < len(MAGIC) + 8:
        raise ValueError("not a tenx-peer/1 payload (bad magic)")
    (n,) = struct.unpack_from("<Q", body, len(MAGIC))
    start = len(MAGIC) + 8
    if n > min(_MAX_HEADER, len(body) - start):
        raise ValueError(f"header length {n} exceeds the payload")
    try:
        header = json.loads(body[start : start + n])
    except (ValueError, RecursionError) as e:
        raise ValueError(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT or "tree" not in header:
        raise ValueError(f"header is not a {FORMAT} header")
    blob = body[start + n :]
    try:
        tensors = load(blob) if blob else {}
    except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError for any bad blob
        raise ValueError(f"tensor blob is not valid safetensors ({e})") from None
    try:
        return _decode(header["tree"], tensors, 0)
    except RecursionError:
        raise ValueError("nesting too deep") from None


def _match(received: Any, template: Any, path: str, problems: list[str]) -> Any:
    """Check received tensors against this process's own state at the same paths; rewrap DTensor shards."""
    if isinstance(received, torch.Tensor) and isinstance(template, torch.Tensor):
        if hasattr(template, "to_local"):  # FSDP2: the peer's rank sent its local shard
            local = template.to_local()
            if received.shape != local.shape or received.dtype != local.dtype:
                problems.append(
                    f"{path}: {tuple(received.shape)} {received.dtype}, here {tuple(local.shape)}"
                )
                return received
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                received.to(local.device),
                device_mesh=template.device_mesh,
                placements=template.placements,
                run_check=False,
                shape=template.shape,
                stride=template.stride(),
            )
        if received.shape != template.shape or received.dtype != template.dtype:
            problems.append(
                f"{path}: {tuple(received.shape)} {received.dtype}, here {tuple(template.shape)} {template.dtype}"
            )
        return received
    if isinstance(received, dict) and isinstance(template, dict):
        return {
            k: _match(v, template[k], f"{path}.{k}", problems) if k in template else v
            for k, v in received.items()
        }
    if isinstance(received, (list, tuple)) and isinstance(template, (list, tuple)):
        if len(received) == len(template):
            items = [
                _match(v, t, f"{path}[{i}]", problems) for i, (v, t) in enumerate(zip(received, template))
            ]
            return type(received)(items)
    elif isinstance(template, torch.Tensor):
        problems.append(f"{path}: a {type(received).__name__} where this process holds a tensor")
    return received


def _tensor_bytes(tree: Any) -> int:
    if isinstance(tree, torch.Tensor):
        local = local_tensor(tree)
        return local.numel() * local.element_size()
    if isinstance(tree, dict):
        return sum(_tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_tensor_bytes(v) for v in tree)
    return 0


def _mac(secret: bytes, *parts: bytes) -> str:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        h.update(part)
    return h.hexdigest()


def request_mac(secret: bytes, url: str, timestamp: str, nonce: str) -> str:
    """The HMAC a healing request carries: of the URL it fetches, its time and its nonce."""
    return _mac(secret, f"tenx-peer/1 request\n{url}\n{timestamp}\n{nonce}".encode())


def response_mac(secret: bytes, nonce: str, body: bytes) -> str:
    """The HMAC a healing response carries: of the request's nonce and the body (so no old body passes)."""
    return _mac(secret, f"tenx-peer/1 response\n{nonce}\n".encode(), body)


def read_secret() -> bytes | None:
    """The shared secret from env TENX_REPLICA_SECRET (None when unset); refuses one too short to matter."""
    raw = os.environ.get(SECRET_ENV, "")
    if not raw:
        return None
    if len(raw) < 16:
        raise TenxError(
            f"{SECRET_ENV}: use at least 16 characters (e.g. `python -c 'import secrets; "
            "print(secrets.token_hex(32))'`), the same in every replica group"
        )
    return raw.encode()


# ----- the transport --------------------------------------------------------------------------------
class TensorTransport:
    """torchft CheckpointTransport serving and fetching tenx-peer/1 state on `host` (see module doc).

    `template` returns this process's own state in the same layout (torchft's manager state); it bounds
    the size of what is accepted and gives the shapes a peer's tensors must have. With a `secret`, requests
    are signed and checked as the module doc says: `auth_window_s` is the allowed distance between a
    request's time and the server's `clock` (seconds since the epoch; tests inject one).
    """

    def __init__(
        self,
        host: str,
        timeout: timedelta,
        *,
        secret: bytes | None = None,
        template: Callable[[], Any] | None = None,
        auth_window_s: float = AUTH_WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (math.isfinite(auth_window_s) and auth_window_s > 0):
            raise TenxError(f"parallel.replicas.auth_window_s: must be > 0 seconds, got {auth_window_s}")
        self.host = host.strip("[]")
        self.timeout = timeout
        self.secret = secret
        self.template = template
        self.auth_window_s = auth_window_s
        self.clock = clock
        self.refused_requests = 0
        """Requests this server refused (unsigned, forged, stale or replayed)."""
        self._nonces: dict[str, float] = {}
        """Nonce -> request time of every authenticated request served within the window (replays)."""
        self._nonce_lock = threading.Lock()
        self.refused: PeerStateError | None = None
        """The last peer state refused (the trainer turns it into a clear error on its own thread)."""
        self.sent = 0
        self.received = 0
        self._cond = threading.Condition()
        self._step = -1
        self._payload: bytes | None = None
        transport = self
        request_timeout = max(1.0, timeout.total_seconds())

        class Handler(BaseHTTPRequestHandler):
            timeout = request_timeout

            def log_message(self, *args: Any) -> None:  # no per-request lines on stderr
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                transport._serve(self)

        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

        try:
            self._server = Server((self.host, 0), Handler)
        except OSError as e:
            raise TenxError(
                f"parallel.replicas.host={host!r}: cannot listen there for healing peers ({e}); give an "
                "address of this machine (127.0.0.1 when every group runs here)"
            ) from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="tenx-peer", daemon=True)
        self._thread.start()

    # torchft's CheckpointTransport interface
    def metadata(self) -> str:
        """The URL a peer fetches our state from (the step is appended)."""
        return f"http://{url_host(self.host)}:{self.port}/tenx-peer/"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        """Serialize the state now (later updates cannot reach it) and serve it for `step`."""
        payload = encode_state(state_dict)
        with self._cond:
            self._step, self._payload = step, payload
            self._cond.notify_all()

    def disallow_checkpoint(self) -> None:
        """Stop serving (the state is about to change)."""
        with self._cond:
            self._payload = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        """Fetch, authenticate, parse and check a peer's state; PeerStateError when refused."""
        try:
            state = self._recv(metadata, step, timeout)
        except PeerStateError as e:
            self.refused = e
            raise
        self.received += 1
        return state

    def shutdown(self, wait: bool = True) -> None:
        """Stop the server."""
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join(timeout=5)

    # internals
    def _recv(self, metadata: str, step: int, timeout: timedelta) -> Any:
        if not isinstance(metadata, str) or not _URL.match(metadata):
            raise PeerStateError(
                f"healing peer advertised {str(metadata)[:200]!r}, not a tenx peer address "
                "(http://HOST:PORT/tenx-peer/); is every group running tenx with the same version?"
            )
        url = f"{metadata}{int(step)}"
        request, nonce = self.signed_request(url)
        template = self.template() if self.template is not None else None
        limit = 4 * _tensor_bytes(template) + 64 * 2**20 if template is not None else None
        try:
            with urllib.request.urlopen(request, timeout=timeout.total_seconds()) as response:
                mac = response.headers.get(BODY_MAC_HEADER, "")
                body = response.read(limit + 1) if limit is not None else response.read()
        except urllib.error.HTTPError as e:
            raise PeerStateError(f"healing peer {url} answered {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError) as e:
            raise PeerStateError(f"healing peer {url} could not be read: {e}") from None
        if limit is not None and len(body) > limit:
            raise PeerStateError(
                f"healing peer {url} sent more than {limit} bytes, several times this model's state; refused"
            )
        if self.secret is not None and not hmac.compare_digest(mac, response_mac(self.secret, nonce, body)):
            raise PeerStateError(
                f"healing peer {url} sent state without a valid {BODY_MAC_HEADER} for our "
                f"{SECRET_ENV} and request: forged, replayed, or the groups use different secrets; refused"
            )
        try:
            state = decode_state(body)
        except ValueError as e:
            raise PeerStateError(f"healing peer {url} sent state tenx does not load: {e}") from None
        if not isinstance(state, dict) or not isinstance(state.get("user"), dict):
            raise PeerStateError(f"healing peer {url} sent state without the expected 'user' section")
        if template is not None:
            problems: list[str] = []
            state = _match(state, template, "", problems)
            if problems:
                raise PeerStateError(
                    f"healing peer {url} sent state for another model ({len(problems)} tensors differ, "
                    f"first: {problems[0]}); refused"
                )
        return state

    def signed_request(self, url: str) -> tuple[urllib.request.Request, str]:
        """A GET of `url`, signed with the secret, its time and a fresh nonce (unsigned without a secret)."""
        request = urllib.request.Request(url)
        nonce = secrets.token_hex(16)
        if self.secret is not None:
            timestamp = f"{self.clock():.3f}"
            request.add_header(TIME_HEADER, timestamp)
            request.add_header(NONCE_HEADER, nonce)
            request.add_header(AUTH_HEADER, request_mac(self.secret, url, timestamp, nonce))
        return request, nonce

    def check_request(self, path: str, headers: Any) -> tuple[int, str] | None:
        """Why the server refuses a request for `path` with `headers` ((HTTP status, reason)), or None.

        Checks, in order: the signature (of this server's own URL for `path`, the request's time and
        nonce; compared in constant time), the time (within `auth_window_s` of the clock either way), the
        nonce (not already served within the window). The nonce is remembered only once all pass.
        """
        if self.secret is None:
            return None
        given = headers.get(AUTH_HEADER) or ""
        timestamp = headers.get(TIME_HEADER) or ""
        nonce = headers.get(NONCE_HEADER) or ""
        if not (given and timestamp and nonce):
            return (
                403,
                f"missing {AUTH_HEADER}, {TIME_HEADER} or {NONCE_HEADER} ({SECRET_ENV} not set there?)",
            )
        url = self.metadata() + path.rpartition("/")[2]
        expected = request_mac(self.secret, url, timestamp, nonce)
        if not hmac.compare_digest(given.encode(), expected.encode()) or not _NONCE.match(nonce):
            return 403, f"wrong {AUTH_HEADER}: another {SECRET_ENV}, or the request was altered"
        try:
            sent = float(timestamp)
        except ValueError:
            sent = math.nan
        if not math.isfinite(sent):
            return 403, f"{TIME_HEADER} {timestamp[:40]!r} is not a time in seconds"
        now = self.clock()
        if abs(now - sent) > self.auth_window_s:
            side = "before" if sent < now else "after"
            return 403, (
                f"stale request: signed {abs(now - sent):.0f} s {side} this server's clock, outside "
                f"+-{self.auth_window_s:g} s (parallel.replicas.auth_window_s); a replayed request, or the "
                "machines' clocks differ (synchronise them with NTP)"
            )
        with self._nonce_lock:
            self._nonces = {n: t for n, t in self._nonces.items() if t >= now - self.auth_window_s}
            if nonce in self._nonces:
                return 403, f"replayed request: nonce {nonce} was already served; refused"
            if len(self._nonces) >= MAX_NONCES:
                return (
                    503,
                    f"more than {MAX_NONCES} requests within {self.auth_window_s:g} s; try again later",
                )
            self._nonces[nonce] = sent
        return None

    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        match = _PATH.match(handler.path)
        if match is None:
            handler.send_error(404, "expected /tenx-peer/STEP")
            return
        refusal = self.check_request(handler.path, handler.headers)
        if refusal is not None:
            self.refused_requests += 1
            handler.send_error(*refusal)
            return
        nonce = handler.headers.get(NONCE_HEADER) or ""
        step = int(match.group(1))
        with self._cond:
            self._cond.wait_for(
                lambda: self._payload is not None and self._step == step, timeout=self.timeout.total_seconds()
            )
            payload = self._payload if self._step == step else None
        if payload is None:
            handler.send_error(409, f"not serving step {step} (serving {self._step})")
            return
        handler.send_response(200)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(len(payload)))
        if self.secret is not None:
            handler.send_header(BODY_MAC_HEADER, response_mac(self.secret, nonce, payload))
        handler.end_headers()
        try:
            with io.BytesIO(payload) as f:
                while chunk := f.read(1 << 20):
                    handler.wfile.write(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return  # the peer hung up (it refused an oversized body, or died): nothing was sent
        self.sent += 1
