"""Untrusted peers and networks: healing state is tensors and JSON only, and nothing listens where not asked.

- The tenx-peer/1 format round-trips a real training state and refuses every malformed or hostile payload
  (a pickle that would run a command, forged MACs, wrong shapes, oversized bodies, foreign URLs).
- A fake replica group (torchft Manager, ahead of the real group, so the real one heals from it) serves a
  hostile payload: the real `tenx train` group exits with one `tenx: error:` line and runs nothing.
- A lighthouse and two real groups: every listening socket of every process is listed from /proc and must
  be one of the documented ones, on loopback (docs/security.md).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RUST_LOG", "warn")

from tenx.errors import ConfigError, TenxError
from tenx.parallel.peer_transport import (
    AUTH_HEADER,
    MAGIC,
    PeerStateError,
    TensorTransport,
    decode_state,
    encode_state,
    read_secret,
)
from tenx.parallel.replicas import ReplicaConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="torchft and /proc are Linux")

SECRET = "s3cret-shared-by-every-group-0123456789"
TIMEOUT = timedelta(seconds=10)


class _Evil:
    """Unpickling this runs `touch MARKER` (what torchft's own transport would do with weights_only=False)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _training_state() -> dict:
    """A realistic manager state: model and AdamW state (int keys, tuples, None), bf16, shared tensors."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    shared = torch.arange(6.0)
    return {
        "user": {
            "tenx": {
                "trainer": {
                    "model": model.state_dict(),
                    "optim": opt.state_dict(),
                    "trainer": {"step": 7, "tokens": 1234, "loader": {"epoch": 0, "cursor": 99}, "guard": {}},
                },
                "replicas": {"group": 0, "phase": "step", "local_step": 0},
            },
            "extra": {"bf16": torch.ones(3, dtype=torch.bfloat16), "a": shared, "b": shared, "none": None},
        },
        "torchft": {"step": 7, "batches_committed": 14},
    }


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


@contextmanager
def _pair(
    template=None, secret=None, peer_secret=b"same"
) -> Iterator[tuple[TensorTransport, TensorTransport]]:
    """A sending and a receiving transport, both shut down on leaving."""
    sender = TensorTransport("127.0.0.1", TIMEOUT, secret=secret if peer_secret == b"same" else peer_secret)
    receiver = TensorTransport("127.0.0.1", TIMEOUT, secret=secret, template=template)
    try:
        yield sender, receiver
    finally:
        sender.shutdown()
        receiver.shutdown()


# ----- the format -----------------------------------------------------------------------------------
def test_round_trip_of_a_training_state_is_exact_over_http():
    state = _training_state()
    with _pair(template=lambda: _training_state()) as (sender, receiver):
        sender.send_checkpoint([1], 7, state, TIMEOUT)
        got = receiver.recv_checkpoint(0, sender.metadata(), 7, TIMEOUT)
        assert _equal(state, got)
        assert isinstance(got["user"]["tenx"]["trainer"]["optim"]["param_groups"][0]["betas"], tuple)
        assert 0 in got["user"]["tenx"]["trainer"]["optim"]["state"]  # int keys survive
        # the server counts a payload after writing its last byte, which the client may read first
        deadline = time.monotonic() + 5
        while sender.sent < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sender.sent == 1 and receiver.received == 1 and receiver.refused is None


def test_objects_are_refused_when_sent_not_pickled():
    with pytest.raises(TenxError, match=r"state at user\.fn is a builtin_function_or_method"):
        encode_state({"user": {"fn": len}})


def _payload(header: dict | bytes, blob: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(raw)) + raw + blob


HOSTILE = {
    "pickle with __reduce__ to os.system": None,  # filled in the test (needs the marker path)
    "torch.save of a dict (torchft's own format)": None,
    "empty body": b"",
    "magic only": MAGIC,
    "header length past the end": MAGIC + struct.pack("<Q", 1 << 40) + b"{}",
    "header not JSON": _payload(b"\x80\x04cos\nsystem\n"),
    "header of another format": _payload({"format": "pickle", "tree": {}}),
    "reference to a missing tensor": _payload(
        {"format": "tenx-peer/1", "tree": {"user": {"__tensor__": "t9"}}}
    ),
    "unknown marker": _payload(
        {"format": "tenx-peer/1", "tree": {"user": {"__reduce__": ["os.system", "id"]}}}
    ),
    "items that are not pairs": _payload({"format": "tenx-peer/1", "tree": {"__items__": [[1, 2, 3]]}}),
    "blob that is not safetensors": _payload({"format": "tenx-peer/1", "tree": {"user": {}}}, b"\x00" * 64),
    "deep nesting": _payload(b'{"format":"tenx-peer/1","tree":' + b"[" * 5000 + b"]" * 5000 + b"}"),
    "no user section": _payload({"format": "tenx-peer/1", "tree": {"torchft": {"step": 1}}}),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_payloads_are_refused_and_run_nothing(name, tmp_path):
    marker = tmp_path / "MARKER"
    body = HOSTILE[name]
    if name.startswith("pickle"):
        body = pickle.dumps({"user": _Evil(marker)})
    elif name.startswith("torch.save"):
        buf = io.BytesIO()
        torch.save({"user": {"x": _Evil(marker)}, "torchft": {"step": 1}}, buf)
        body = buf.getvalue()
    if name != "no user section":  # well-formed, refused by the transport's check of the layout
        with pytest.raises(ValueError):
            decode_state(body)
    # and over the wire, served by a peer: refused with the peer's address, nothing run
    with _pair() as (sender, receiver):
        sender._step, sender._payload = 3, body
        with pytest.raises(PeerStateError, match=r"healing peer http://127\.0\.0\.1:\d+/tenx-peer/3"):
            receiver.recv_checkpoint(0, sender.metadata(), 3, TIMEOUT)
        assert receiver.refused is not None
    assert not marker.exists()


def test_state_of_another_model_is_refused():
    other = _training_state()
    other["user"]["tenx"]["trainer"]["model"]["0.weight"] = torch.zeros(5, 5)
    with _pair(template=_training_state) as (sender, receiver):
        sender.send_checkpoint([1], 1, other, TIMEOUT)
        with pytest.raises(PeerStateError, match=r"another model .*0\.weight: \(5, 5\)"):
            receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)


def test_oversized_state_is_refused_before_it_is_parsed():
    big = {"user": {"x": torch.zeros(20 * 2**20)}}  # 80 MB against a template of a few hundred bytes
    with _pair(template=lambda: {"user": {"x": torch.zeros(4)}}) as (sender, receiver):
        sender.send_checkpoint([1], 1, big, TIMEOUT)
        with pytest.raises(PeerStateError, match="sent more than"):
            receiver.recv_checkpoint(0, sender.metadata(), 1, TIMEOUT)


@pytest.mark.parametrize(
    "url",
    ["http://127.0.0.1:1/checkpoint/", "file:///etc/passwd#/tenx-peer/", "http://evil/x/../tenx-peer/", 5],
)
def test_foreign_peer_addresses_are_not_fetched(url):
    receiver = TensorTransport("127.0.0.1", TIMEOUT)
    try:
        with pytest.raises(PeerStateError, match="not a tenx peer address"):
            receiver.recv_checkpoint(0, url, 1, TIMEOUT)
    finally:
        receiver.shutdown()


def test_shared_secret_authenticates_both_directions():
    import urllib.error
    import urllib.request

    state = _training_state()
    secret = SECRET.encode()
    # the same secret: accepted
    with _pair(secret=secret) as (sender, receiver):
        sender.send_checkpoint([1], 2, state, TIMEOUT)
        assert _equal(receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT), state)
        # a stranger without the secret cannot download the weights
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(sender.metadata() + "2", timeout=5)
        assert e.value.code == 403
        forged = urllib.request.Request(sender.metadata() + "2", headers={AUTH_HEADER: "0" * 64})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(forged, timeout=5)
    # a peer with another secret (or none) is refused: its request is rejected or its body's MAC is wrong
    for peer_secret in (b"another-secret-of-16-chars", None):
        with _pair(secret=secret, peer_secret=peer_secret) as (sender, receiver):
            sender.send_checkpoint([1], 2, state, TIMEOUT)
            with pytest.raises(PeerStateError, match=r"403|X-Tenx-Body-Mac"):
                receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT)


class _Clock:
    """An injected wall clock (seconds since the epoch) that moves only when told."""

    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _send(url: str, headers: dict[str, str]) -> tuple[int, str]:
    """GET `url` with `headers`: (HTTP status, reason)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            r.read()
            return r.status, ""
    except urllib.error.HTTPError as e:
        return e.code, str(e.reason)


def _headers(request) -> dict[str, str]:
    return dict(request.header_items())


def test_a_captured_request_is_refused_when_replayed_stale_or_altered(monkeypatch):
    """Requests sign the URL, a time and a nonce: a replay, a stale or a tampered request is refused (403)."""
    import urllib.request

    clock, secret, state = _Clock(), SECRET.encode(), _training_state()
    sender = TensorTransport("127.0.0.1", TIMEOUT, secret=secret, clock=clock, auth_window_s=60.0)
    receiver = TensorTransport("127.0.0.1", TIMEOUT, secret=secret, clock=clock, template=_training_state)
    real_urlopen, captured = urllib.request.urlopen, []

    def capture(request, timeout):
        captured.append(request)
        return real_urlopen(request, timeout=timeout)

    try:
        sender.send_checkpoint([1], 2, state, TIMEOUT)
        url = sender.metadata() + "2"
        # a fresh request, sent by the receiver as in healing: accepted
        monkeypatch.setattr(urllib.request, "urlopen", capture)
        assert _equal(receiver.recv_checkpoint(0, sender.metadata(), 2, TIMEOUT), state)
        monkeypatch.undo()
        (request,) = captured
        assert request.full_url == url and {"X-tenx-time", "X-tenx-nonce", "X-tenx-auth"} <= set(
            _headers(request)
        )
        # the captured request replayed at once (inside the window): its nonce was served
        code, reason = _send(url, _headers(request))
        assert (code, reason) == (
            403,
            f"replayed request: nonce {request.get_header('X-tenx-nonce')} was already served; refused",
        )
        # tampered: another step, time, nonce or signature than the one signed
        fresh, _ = receiver.signed_request(url)
        for name, value in (
            ("X-tenx-time", str(clock.t + 1)),
            ("X-tenx-nonce", "f" * 32),
            ("X-tenx-auth", "0" * 64),
        ):
            code, reason = _send(url, {**_headers(fresh), name: value})
            assert code == 403 and reason.startswith("wrong X-Tenx-Auth"), (name, reason)
        code, reason = _send(sender.metadata() + "3", _headers(fresh))  # signed for step 2
        assert code == 403 and reason.startswith("wrong X-Tenx-Auth")
        # stale: signed now, arriving 61 s later; and the captured one after the window
        late, _ = receiver.signed_request(url)
        clock.t += 61
        code, reason = _send(url, _headers(late))
        assert code == 403 and reason.startswith("stale request: signed 61 s before this server's clock")
        code, reason = _send(url, _headers(request))
        assert code == 403 and reason.startswith("stale request: signed 61 s before")
        # a signer whose clock runs 61 s ahead is refused alike
        ahead = TensorTransport("127.0.0.1", TIMEOUT, secret=secret, clock=lambda: clock.t + 61)
        try:
            code, reason = _send(url, _headers(ahead.signed_request(url)[0]))
            assert code == 403 and reason.startswith("stale request: signed 61 s after")
        finally:
            ahead.shutdown()
        # the fresh (untampered) request still passes; only nonces inside the window are kept
        code, _ = _send(url, _headers(fresh))
        assert code == 403  # its time is now 61 s old too
        fresh, nonce = receiver.signed_request(url)
        assert _send(url, _headers(fresh)) == (200, "")
        assert list(sender._nonces) == [nonce]  # the first request's nonce expired with its window
        assert sender.refused_requests == 9
    finally:
        sender.shutdown()
        receiver.shutdown()


def test_a_recorded_response_is_refused_and_the_nonce_memory_is_bounded(monkeypatch):
    """A response is signed with the request's nonce: an old genuine body and MAC replayed to a new
    request are refused; past MAX_NONCES requests in a window the server answers 503 until they expire."""
    import http.server
    import threading
    import urllib.request

    from tenx.parallel import peer_transport

    clock, secret, state = _Clock(), SECRET.encode(), _training_state()
    sender = TensorTransport("127.0.0.1", TIMEOUT, secret=secret, clock=clock)
    receiver = TensorTransport("127.0.0.1", TIMEOUT, secret=secret, clock=clock, template=_training_state)
    sender.send_checkpoint([1], 2, state, TIMEOUT)
    request, nonce = receiver.signed_request(sender.metadata() + "2")
    with urllib.request.urlopen(request, timeout=10) as r:
        body, mac = r.read(), r.headers[peer_transport.BODY_MAC_HEADER]
    assert mac == peer_transport.response_mac(secret, nonce, body)

    class Replayer(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header(peer_transport.BODY_MAC_HEADER, mac)
            self.end_headers()
            self.wfile.write(body)

    replayer = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Replayer)
    threading.Thread(target=replayer.serve_forever, daemon=True).start()
    try:
        with pytest.raises(PeerStateError, match="without a valid X-Tenx-Body-Mac .*replayed"):
            receiver.recv_checkpoint(
                0, f"http://127.0.0.1:{replayer.server_address[1]}/tenx-peer/", 2, TIMEOUT
            )
        monkeypatch.setattr(peer_transport, "MAX_NONCES", 3)
        url = sender.metadata() + "2"
        codes = [_send(url, _headers(receiver.signed_request(url)[0]))[0] for _ in range(3)]
        assert codes == [200, 200, 503]  # one nonce from above, two now: the window is full
        clock.t += 61
        assert _send(url, _headers(receiver.signed_request(url)[0]))[0] == 200
        assert len(sender._nonces) == 1
    finally:
        replayer.shutdown()
        sender.shutdown()
        receiver.shutdown()


def test_secret_and_host_are_checked(monkeypatch):
    monkeypatch.setenv("TENX_REPLICA_SECRET", "short")
    with pytest.raises(TenxError, match="TENX_REPLICA_SECRET: use at least 16"):
        read_secret()
    monkeypatch.delenv("TENX_REPLICA_SECRET")
    assert read_secret() is None
    for wildcard in ("0.0.0.0", "::", "[::]", ""):
        with pytest.raises(ConfigError, match="parallel.replicas.host"):
            ReplicaConfig(mode="sync", groups=2, host=wildcard).validate()
    with pytest.raises(TenxError, match="cannot listen there"):
        TensorTransport("192.0.2.254", TIMEOUT)  # TEST-NET: an address this machine does not have


# ----- a hostile peer group during healing ----------------------------------------------------------
FAKE_PEER = textwrap.dedent(
    """
    import datetime, http.server, os, sys, threading, time
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
    import torch

    lighthouse, body_path, secret_mac = sys.argv[1], sys.argv[2], sys.argv[3]
    body = open(body_path, "rb").read()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            if secret_mac:
                self.send_header("X-Tenx-Body-Mac", secret_mac)
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/tenx-peer/"

    class Evil:
        def metadata(self): return url
        def send_checkpoint(self, *a, **k): pass
        def disallow_checkpoint(self): pass
        def recv_checkpoint(self, *a, **k): raise RuntimeError("the fake peer never heals")
        def shutdown(self, wait=True): server.shutdown()

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    t = datetime.timedelta(seconds=10)
    m = Manager(pg=ProcessGroupGloo(timeout=t), load_state_dict=lambda s: None, state_dict=lambda: {},
                min_replica_size=2, use_async_quorum=False, timeout=t, rank=0, world_size=1,
                store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=lighthouse,
                replica_id="tenx_group_0", hostname="127.0.0.1", checkpoint_transport=Evil())
    m.load_state_dict({"step": 1000, "batches_committed": 1000})  # far ahead: the real group heals from us
    print("fake peer ready", flush=True)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            m.start_quorum()
            m.should_commit()
        except Exception:
            time.sleep(0.1)
    """
)


def _sync_group(run_dir: Path, data_dir: Path, lighthouse: str, *overrides: str) -> list[str]:
    """The command of one group of a synchronous two-group job: the tiny config, one thread, quiet."""
    cmd = [sys.executable, "-m", "tenx", "train", "--config", "tiny", "--run-dir", str(run_dir)]
    for item in (
        f'data.dir="{data_dir}"',
        "train.threads=1",
        "log.progress=false",
        "log.tensorboard=false",
        "parallel.replicas.mode=sync",
        "parallel.replicas.groups=2",
        f"parallel.replicas.lighthouse={lighthouse}",
        *overrides,
    ):
        cmd += ["--set", item]
    return cmd


def _hostile_heal(tmp_path: Path, data_dir: Path, body: bytes, *, secret: str | None, mac: str = "") -> tuple:
    """A lighthouse, a fake group 0 serving `body`, and a real group 1 that must heal from it."""
    from tenx.parallel.lighthouse import start_lighthouse

    server, address = start_lighthouse(
        f"127.0.0.1:{_free_port()}", min_groups=2, join_timeout_ms=5000, quorum_tick_ms=10
    )
    (tmp_path / "body").write_bytes(body)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TENX_REPLICA_SECRET", None)
    fake = subprocess.Popen(
        [sys.executable, "-c", FAKE_PEER, address, str(tmp_path / "body"), mac],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
    )
    cmd = _sync_group(
        tmp_path / "g1",
        data_dir,
        address,
        "train.steps=50",
        "parallel.replicas.min_groups=2",
        "parallel.replicas.timeout_s=10",
    )
    genv = {**env, "TENX_REPLICA_GROUP": "1", **({"TENX_REPLICA_SECRET": secret} if secret else {})}
    try:
        real = subprocess.run(cmd, capture_output=True, text=True, env=genv, cwd=tmp_path, timeout=120)
    finally:
        fake.kill()
        fake.wait(timeout=10)
        server.shutdown()
    return real.returncode, real.stdout, real.stderr


def _assert_refused(rc: int, out: str, err: str, reason: str, marker: Path) -> None:
    assert rc == 2, f"exit {rc}\n{out}\n{err}"
    last = err.strip().splitlines()[-1]
    assert last.startswith("tenx: error: replica group 1: healing peer http://127.0.0.1:"), err
    assert reason in last, last
    assert "Traceback" not in err, err
    assert not marker.exists(), "the peer's payload ran a command"


@pytest.mark.timeout(150)
def test_group_refuses_a_pickle_from_a_peer_and_exits_clearly(tiny_data, tmp_path):
    marker = tmp_path / "MARKER"
    buf = io.BytesIO()
    torch.save({"user": {"tenx": _Evil(marker)}, "torchft": {"step": 1000, "batches_committed": 1000}}, buf)
    rc, out, err = _hostile_heal(tmp_path, tiny_data, buf.getvalue(), secret=None)
    _assert_refused(rc, out, err, "bad magic", marker)


@pytest.mark.timeout(150)
def test_group_refuses_a_forged_state_when_a_secret_is_shared(tiny_data, tmp_path):
    # well-formed tenx-peer/1 state with the real model's shapes, but made without the groups' secret
    state = {
        "user": {"tenx": {"trainer": {}, "replicas": {}}},
        "torchft": {"step": 1000, "batches_committed": 0},
    }
    rc, out, err = _hostile_heal(tmp_path, tiny_data, encode_state(state), secret=SECRET, mac="0" * 64)
    _assert_refused(rc, out, err, "X-Tenx-Body-Mac", tmp_path / "MARKER")


# ----- what listens where ---------------------------------------------------------------------------
def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (from /proc)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.append((socket.inet_ntop(family, raw), int(hex_port, 16)))
    return sorted(found)


@pytest.mark.timeout(150)
def test_lighthouse_and_two_groups_listen_only_on_loopback(tiny_data, tmp_path):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RUST_LOG": "warn"}
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "tenx", "lighthouse", "--bind", f"127.0.0.1:{port}", "--min-groups", "2"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    groups = []
    try:
        assert "serving on" in lighthouse.stdout.readline()
        for g in (0, 1):
            cmd = _sync_group(
                tmp_path / f"g{g}",
                tiny_data,
                f"http://127.0.0.1:{port}",
                "train.steps=100000",
                "checkpoint.every=100000",
            )
            log = open(tmp_path / f"g{g}.log", "w")
            groups.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, "TENX_REPLICA_GROUP": str(g)}
                )
            )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if all((tmp_path / f"g{g}" / "metrics.jsonl").exists() for g in (0, 1)):
                break
            assert all(p.poll() is None for p in groups), (tmp_path / "g0.log").read_text()
            time.sleep(0.2)
        else:
            raise AssertionError("the groups never took a step together")
        time.sleep(1.0)  # a few steps, quorums and all-reduces in
        assert _listening(lighthouse.pid) == [("127.0.0.1", port)]
        report = []
        for g, proc in enumerate(groups):
            sockets = _listening(proc.pid)
            events = [json.loads(x) for x in (tmp_path / f"g{g}" / "events.jsonl").read_text().splitlines()]
            named = next(e for e in events if e["kind"] == "replica-listen")
            documented = {int(named[k].rpartition(":")[2]) for k in ("store", "manager", "healing")}
            assert {h for h, _ in sockets} == {"127.0.0.1"}, sockets
            ports = {p for _, p in sockets}
            assert documented <= ports, (named, sockets)
            # the rest is the cross-group gloo device (one per quorum's process group)
            assert 1 <= len(ports - documented) <= 2, (named, sockets)
            report.append(f"group {g}: {sockets} (named: {named})")
        print("\n" + "\n".join(report))
    finally:
        for p in [*groups, lighthouse]:
            p.kill()
            p.wait(timeout=10)
