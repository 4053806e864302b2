"""Hostile neighbours (issue 20, findings 6-8): what another local user can reach.

Each test runs a real daemon process and, where the threat is another local user, a real
peer that drops to ``nobody`` in a forked child (``as_user``): it sees the same sockets,
files and loopback ports such a user would. The daemon's own user is root here, so the
runtime directory (0700) is what keeps ``nobody`` away from the Unix sockets.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import LimitExceededError
from kvcache.kv_events.messages import END_SEQ, seq_bytes
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.keygen import main as keygen
from kvcache.server.launch import DaemonProcess, DaemonStartError
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from kvcache.transport.fdpass import send_fds
from tests.server.helpers import free_port

from .conftest import as_user, raw_call

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a peer as nobody")

TOKENS, BLOCKS = list(range(64)), list(range(16))
NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]


def _cache(seed: int = 0) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


def _outcome(reply: m.ReplyBody) -> str:
    """A reply as a short string a forked child can hand back."""
    if isinstance(reply, m.Error):
        return f"error:{reply.code.value}"
    if isinstance(reply, m.LookupResult):
        return f"hit:{reply.hit_tokens}"
    if isinstance(reply, m.Pong):
        return f"registered:{reply.registered}"
    if isinstance(reply, m.StatusResult):
        return f"instances:{reply.instances}"
    return type(reply).__name__


def _served_correctly(owner: KVCacheClient, kv: list[torch.Tensor], salt: str = "") -> None:
    """The engine a stranger went after still gets its own bytes back."""
    want = clone_caches(kv)
    assert owner.lookup(TOKENS, cache_salt=salt) == 64
    for t in kv:
        t.zero_()
    assert owner.retrieve(TOKENS, BLOCKS, cache_salt=salt) == 64
    assert caches_equal(kv, want)


# -- finding 7: the TCP door -------------------------------------------------------------


def _can_connect(path: str) -> str:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError as exc:
            return type(exc).__name__
    return "connected"


def test_tcp_is_off_unless_asked_for(start_daemon: Callable[..., DaemonProcess]) -> None:
    """With no flags the daemon listens only on its Unix socket: another user finds no door."""
    d = start_daemon()
    assert d.endpoint == d.ipc_endpoint and d.endpoint.startswith("ipc://")
    assert "zmq tcp://" not in d.log
    path = d.ipc_endpoint.removeprefix("ipc://")
    assert as_user(NOBODY, lambda: _can_connect(path)) == "PermissionError"
    with KVCacheClient(timeout_s=5, endpoint=d.endpoint) as c:  # the daemon's own user is served
        kv = _cache()
        c.register_kv_caches(kv)
        c.store(TOKENS, BLOCKS)
        _served_correctly(c, kv)


def test_over_loopback_tcp_every_instance_request_needs_the_token(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """Another local user on the TCP port can no longer list the engine, probe its salts,
    end its requests or keep its registration alive."""
    d = start_daemon(tcp=True)
    assert d.endpoint.startswith("tcp://127.0.0.1:")
    kv = _cache(1)
    with KVCacheClient(d.endpoint, 41, "victim", timeout_s=5) as owner:
        owner.register_kv_caches(kv)
        owner.store(TOKENS, BLOCKS, cache_salt="secret")

        def stranger() -> list[str]:
            ids = pack_ids(TOKENS)
            return [
                _outcome(raw_call(d.endpoint, m.Status())),
                _outcome(raw_call(d.endpoint, m.Lookup(instance_id=41, token_ids=ids, cache_salt="secret"))),
                _outcome(raw_call(d.endpoint, m.Ping(instance_id=41))),
                _outcome(raw_call(d.endpoint, m.EndSession(instance_id=41, request_id="r1"))),
                _outcome(raw_call(d.endpoint, m.ReportBlockAllocations(instance_id=41, records=[]))),
            ]

        got = as_user(NOBODY, stranger)
        assert got == ["instances:[]", "error:access_denied", "registered:False",
                       "error:access_denied", "error:access_denied"]  # fmt: skip
        assert owner.ping() is True
        _served_correctly(owner, kv, "secret")


# -- finding 8: tokens, quotas, uid entries, status ---------------------------------------


def test_a_stolen_token_does_not_work_for_another_principal(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """The token an engine got over its Unix socket is refused on the TCP port."""
    d = start_daemon(tcp=True)
    kv = _cache(2)
    with KVCacheClient(d.ipc_endpoint, 42, "victim", timeout_s=5) as owner:
        owner.register_kv_caches(kv)
        owner.store(TOKENS, BLOCKS)
        stolen = owner.session.token  # what a leaked log line or core dump would give away
        assert stolen

        def thief() -> list[str]:
            ids = pack_ids(TOKENS)
            return [
                _outcome(raw_call(d.endpoint, m.Lookup(instance_id=42, token_ids=ids, token=stolen))),
                _outcome(raw_call(d.endpoint, m.Ping(instance_id=42, token=stolen))),
                _outcome(raw_call(d.endpoint, m.Unregister(instance_id=42, token=stolen))),
            ]

        assert as_user(NOBODY, thief) == ["error:access_denied", "registered:False", "error:access_denied"]
        _served_correctly(owner, kv)


def test_status_shows_a_tenant_only_its_own_usage(start_daemon: Callable[..., DaemonProcess]) -> None:
    d = start_daemon(tcp=True)
    kv = _cache(3)
    with KVCacheClient(d.ipc_endpoint, 43, "victim", timeout_s=5) as owner:
        owner.register_kv_caches(kv)
        owner.store(TOKENS, BLOCKS)

        def tenant() -> dict[str, Any]:
            reply = raw_call(d.endpoint, m.Status())
            assert isinstance(reply, m.StatusResult)
            return {"instances": reply.instances, "engine": reply.engine, "in_flight": reply.in_flight}

        seen = as_user(NOBODY, tenant)
        assert seen["instances"] == [] and seen["in_flight"] == 0
        assert seen["engine"] == {"chunk_size": 16, "instances": []}  # no L1/L2 usage of others
        full = owner.status()  # the operator (the daemon's own user) sees the whole cache
        assert full["engine"]["l1"]["num_chunks"] == 4 and 43 in full["instances"]
        _served_correctly(owner, kv)


def _hand_over_and_vanish(fd_socket: str, times: int) -> list[str]:
    """What a buggy engine does: hand memory over ``times`` times and never register."""
    outcomes = []
    for _ in range(times):
        fd = os.memfd_create("stray", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 4096)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            send_fds(fd_socket, os.urandom(16), [fd], timeout_s=5)
            outcomes.append("kept")
        except LimitExceededError:
            outcomes.append("limit")
        finally:
            os.close(fd)
    return outcomes


def test_one_engines_stray_hand_overs_do_not_block_its_users_other_engines(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    fd_socket = os.path.join(d.runtime_dir, "fds.sock")
    # Another process of the same user (its own pid), forked so the daemon sees its credentials.
    outcomes = as_user(os.getuid(), lambda: _hand_over_and_vanish(fd_socket, 8))
    assert outcomes.count("kept") < 8 and outcomes[-1] == "limit"  # its own quota ran out
    kv = _cache(4)
    with KVCacheClient(d.ipc_endpoint, 44, "sibling", timeout_s=5) as sibling:
        sibling.register_kv_caches(kv)  # refused for 60 s before: the uid's quota was full
        sibling.store(TOKENS, BLOCKS)
        _served_correctly(sibling, kv)


def test_uid_entries_in_clients_are_refused_at_start(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """A ``uid = N`` entry could never connect (the runtime directory is the daemon user's
    alone); an operator who lists one is told at start, not left guessing."""
    clients = tmp_path / "clients.toml"
    clients.write_text(f'[[client]]\nname = "batch-jobs"\nuid = {NOBODY}\n')
    with pytest.raises(DaemonStartError, match="uid entries"):
        start_daemon("--clients", str(clients))


def test_docs_install_from_the_repository_not_the_package_index() -> None:
    """``pip install kvcache`` would install whatever someone published under that name."""
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in doc.read_text().splitlines():
            assert "pip install kvcache" not in line.replace("`", ""), f"{doc.name}: {line}"


# -- finding 6: KV events ---------------------------------------------------------------


def _keys(tmp_path: Path) -> Path:
    """Key pairs for the daemon, a router (may read KV events) and a tenant (may not)."""
    for name in ("daemon", "router", "tenant"):
        assert keygen([name, "--dir", str(tmp_path)]) == 0

    def public(name: str) -> str:
        return (tmp_path / f"{name}.key").read_text().split('public-key = "')[1].split('"')[0]

    (tmp_path / "clients.toml").write_text(
        f'[[client]]\nname = "router"\npublic_key = "{public("router")}"\nkv_events = true\n\n'
        f'[[client]]\nname = "tenant"\npublic_key = "{public("tenant")}"\n'
    )
    return tmp_path


def _curve_opts(keys: Path, who: str) -> dict[int, bytes]:
    public, secret = zmq.auth.load_certificate(str(keys / f"{who}.key_secret"))
    server, _ = zmq.auth.load_certificate(str(keys / "daemon.key"))
    assert secret is not None
    return {zmq.CURVE_SERVERKEY: server, zmq.CURVE_PUBLICKEY: public, zmq.CURVE_SECRETKEY: secret}


def _replay_tokens(endpoint: str, opts: dict[int, bytes] | None = None) -> str | list[int]:
    """Connect to a replay socket and collect the token ids of every replayed BlockStored;
    the handshake's failure, if it fails. Asks again until a batch is there (bounded)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for opt, value in (opts or {}).items():
        sock.setsockopt(opt, value)
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    try:
        while True:
            assert monitor.poll(10_000), "no handshake outcome"
            event = recv_monitor_message(monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                break
            if event in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                         zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):  # fmt: skip
                return "refused"
        for _ in range(200):
            sock.send(seq_bytes(0))
            tokens: list[int] = []
            while True:
                assert sock.poll(10_000), "no replay answer"
                _topic, seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    break
                for ev in msgspec.msgpack.decode(payload)[1]:
                    if ev.get("type") == "BlockStored":
                        tokens += ev["token_ids"]
            if tokens:
                return tokens
            sock.poll(50)  # nothing published yet: ask again shortly
        return []
    finally:
        sock.disable_monitor()
        monitor.close()
        sock.close()
        ctx.term()


def _store_something(d: DaemonProcess) -> tuple[KVCacheClient, list[torch.Tensor]]:
    owner = KVCacheClient(d.ipc_endpoint, 45, "victim", timeout_s=5)
    kv = _cache(5)
    owner.register_kv_caches(kv)
    owner.store(TOKENS, BLOCKS)
    return owner, kv


def test_kv_events_default_to_the_private_runtime_directory(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--kv-events")
    replay = os.path.join(d.runtime_dir, "kv-events-replay.sock")
    owner, kv = _store_something(d)
    with owner:
        assert _replay_tokens(f"ipc://{replay}") == TOKENS  # the operator reads them
        for name in ("kv-events.sock", "kv-events-replay.sock"):
            path = os.path.join(d.runtime_dir, name)
            assert as_user(NOBODY, lambda p=path: _can_connect(p)) == "PermissionError"
        _served_correctly(owner, kv)


def test_kv_events_on_tcp_need_curve(start_daemon: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    """A loopback replay socket used to hand every tenant's token ids to any local user."""
    port = free_port()
    with pytest.raises(DaemonStartError, match="CURVE"):
        start_daemon("--kv-events", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{port}")
    keys = _keys(tmp_path)
    d = start_daemon("--kv-events", "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{port}",
                     "--curve-secret-key", str(keys / "daemon.key_secret"),
                     "--clients", str(keys / "clients.toml"))  # fmt: skip
    endpoint = f"tcp://127.0.0.1:{port}"
    owner, kv = _store_something(d)
    with owner:
        assert _replay_tokens(endpoint, _curve_opts(keys, "router")) == TOKENS
        assert _replay_tokens(endpoint, _curve_opts(keys, "tenant")) == "refused"  # a tenant: not its events
        assert as_user(NOBODY, lambda: _replay_tokens(endpoint)) == "refused"  # no key at all
        _served_correctly(owner, kv)


def test_kv_events_on_another_ipc_path_admit_only_the_daemons_user(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """An operator's own ipc:// path, in an open directory, with the socket opened up by
    mistake: ZAP still turns away another user."""
    home = tempfile.mkdtemp(prefix="kvcache-events-", dir="/tmp")
    try:
        os.chmod(home, 0o755)
        live, replay = os.path.join(home, "ev.sock"), os.path.join(home, "replay.sock")
        d = start_daemon(
            "--kv-events-endpoint", f"ipc://{live}", "--kv-events-replay-endpoint", f"ipc://{replay}"
        )
        for path in (live, replay):
            os.chmod(path, 0o777)
        owner, kv = _store_something(d)
        with owner:
            assert _replay_tokens(f"ipc://{replay}") == TOKENS
            assert as_user(NOBODY, lambda: _replay_tokens(f"ipc://{replay}")) == "refused"
            _served_correctly(owner, kv)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_second_daemon_cannot_take_the_first_ones_kv_events_socket(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """ZMQ's ipc bind unlinks whatever is at the path: a second daemon started on the same
    runtime directory used to steal the first one's KV-events socket before noticing it."""
    runtime_dir = str(tmp_path / "run")
    first = start_daemon("--kv-events", runtime_dir=runtime_dir)
    with pytest.raises(DaemonStartError, match="another process listens"):
        start_daemon("--kv-events", runtime_dir=runtime_dir)
    owner, kv = _store_something(first)
    with owner:
        assert _replay_tokens(f"ipc://{os.path.join(runtime_dir, 'kv-events-replay.sock')}") == TOKENS
        _served_correctly(owner, kv)
