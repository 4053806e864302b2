"""Who may talk to the daemon, and as whom: peer credentials, CURVE keys and tenants.

Separate from the I/O loop so the trust rules can be read (and tested) as plain functions.
ZMQ asks a ZAP handler about every new connection (RFC 27); this module answers:

* ``ipc://`` peers: ZMQ reports the peer's ``SO_PEERCRED`` uid in the ZAP address
  (``localhost:UID:GID:PID``); only the daemon's own uid gets in, on top of the socket living
  in a directory only the daemon's user can enter. That user is the operator;
* ``tcp://`` peers with CURVE: the client's long-term public key must be on the allow-list;
* ``tcp://`` peers without CURVE: loopback only (the daemon refuses to listen beyond
  loopback without CURVE), and all of them one shared principal that proves nothing: every
  request acting on an instance must carry that instance's registration token.

Each accepted connection gets a ZAP user id naming its ``Principal``; ZMQ stamps it on every
message (the ``User-Id`` frame property), so the daemon knows per request who sent it and
which tenant restrictions (model names, cache salts) apply.
"""

from __future__ import annotations

import logging
import os
import threading
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from kvcache.errors import AccessDeniedError
from kvcache.trusted_dir import ipc_peer_uid

log = logging.getLogger("kvcache.server")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"kvcache"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated peer: ``name`` is stable per peer kind (``uid:1000``, ``key:team-a``,
    ``loopback``); ``models`` / ``cache_salts`` restrict it when not None.

    ``shared``: every local process may be this principal (plain loopback TCP), so being it
    proves nothing; only a registration token speaks for an instance. ``operator``: the
    daemon's own user on its Unix socket, who may see the whole cache's usage in ``Status``.
    """

    name: str
    models: frozenset[str] | None = None
    cache_salts: frozenset[str] | None = None
    shared: bool = False
    operator: bool = False

    def check_model(self, model_name: str) -> None:
        if self.models is not None and model_name not in self.models:
            raise AccessDeniedError(
                f"client {self.name!r} may not register model {model_name!r} (allowed: {sorted(self.models)})"
            )

    def check_salt(self, cache_salt: str) -> None:
        if self.cache_salts is not None and cache_salt not in self.cache_salts:
            raise AccessDeniedError(
                f"client {self.name!r} may not use cache salt {cache_salt!r} "
                f"(allowed: {sorted(self.cache_salts)})"
            )


LOOPBACK = Principal("loopback", shared=True)
"""A plain-TCP peer on the loopback interface: any local process, of any user."""


@dataclass(frozen=True, slots=True)
class ClientEntry:
    """One ``[[client]]`` of the allow-list file: a CURVE public key, with its tenant
    restrictions; ``kv_events`` lets it read the KV-events stream (every tenant's events)."""

    name: str
    public_key: bytes
    models: frozenset[str] | None = None
    cache_salts: frozenset[str] | None = None
    kv_events: bool = False

    def principal(self) -> Principal:
        return Principal(f"key:{self.name}", self.models, self.cache_salts)


def load_clients(path: str) -> list[ClientEntry]:
    """Read an allow-list TOML file; raises ``ValueError`` naming the bad entry.

    Format (``kvcache keys NAME`` prints the entry for a new key pair)::

        [[client]]
        name = "team-a"
        public_key = "<40-character Z85 CURVE public key>"
        models = ["llama-8b"]        # optional: the model names it may register
        cache_salts = ["team-a"]     # optional: the cache salts it may use ("" = unsalted)
        kv_events = false            # optional: true for a router reading the KV events

    There are no ``uid`` entries: the Unix sockets live in a directory only the daemon's
    user can enter, so another local user connects over TCP with a key like a remote one.
    """
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read client allow-list {path}: {exc}") from None
    unknown = sorted(set(doc) - {"client"})
    if unknown:
        raise ValueError(f"{path}: unknown tables {unknown}; expected [[client]] entries")
    entries = [_entry(path, i, raw) for i, raw in enumerate(doc.get("client", []))]
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: client names must be unique, got {names}")
    return entries


def _entry(path: str, index: int, raw: Any) -> ClientEntry:
    where = f"{path}: [[client]] #{index + 1}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} is not a table")
    if "uid" in raw:
        raise ValueError(
            f"{where}: uid entries are not supported: the daemon's Unix sockets live in a "
            "directory only its own user can enter, so no other uid could ever connect. "
            "Give that user a CURVE key pair (`kvcache keys NAME`) and start the daemon with "
            "--tcp --curve-secret-key (docs/operator-guide.md, Security)"
        )
    unknown = sorted(set(raw) - {"name", "public_key", "models", "cache_salts", "kv_events"})
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: needs a non-empty name")
    key = raw.get("public_key")
    if not isinstance(key, str) or len(key) != 40:
        raise ValueError(f"{where} ({name}): public_key must be a 40-character Z85 string")
    kv_events = raw.get("kv_events", False)
    if not isinstance(kv_events, bool):
        raise ValueError(f"{where} ({name}): kv_events must be true or false")
    return ClientEntry(
        name=name,
        public_key=key.encode(),
        models=_names(where, raw, "models"),
        cache_salts=_names(where, raw, "cache_salts"),
        kv_events=kv_events,
    )


def _names(where: str, raw: Mapping[str, Any], key: str) -> frozenset[str] | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {key} must be a list of strings")
    return frozenset(value)


class AccessPolicy:
    """The daemon's trust rules: ``authenticate`` is the ZAP decision for a new connection,
    ``principal`` maps the ``User-Id`` ZMQ stamps on each message back to its restrictions.

    The daemon's own uid is the only one allowed over ``ipc://``: the operator, unrestricted."""

    def __init__(self, clients: Iterable[ClientEntry] = (), daemon_uid: int | None = None) -> None:
        self.daemon_uid = os.getuid() if daemon_uid is None else daemon_uid
        self.clients = tuple(clients)
        self._by_user: dict[str, Principal] = {LOOPBACK.name: LOOPBACK}
        self._by_user[f"uid:{self.daemon_uid}"] = Principal(f"uid:{self.daemon_uid}", operator=True)
        for entry in self.clients:
            p = entry.principal()
            self._by_user[p.name] = p
        self._by_key = {e.public_key: e for e in self.clients}

    @property
    def allowed_uids(self) -> frozenset[int]:
        return frozenset(int(n.split(":", 1)[1]) for n in self._by_user if n.startswith("uid:"))

    @property
    def has_keys(self) -> bool:
        return bool(self._by_key)

    def authenticate(self, mechanism: bytes, address: str, credentials: list[bytes]) -> tuple[bool, str]:
        """(allowed, user id or refusal reason) for one new connection."""
        if mechanism == b"CURVE":
            raw = credentials[0] if credentials else b""
            entry = self._by_key.get(z85.encode(raw)) if len(raw) == 32 else None
            if entry is None:
                return False, "unknown CURVE public key"
            return True, entry.principal().name
        if mechanism != b"NULL":
            return False, f"mechanism {mechanism.decode(errors='replace')} not accepted"
        uid = ipc_peer_uid(address)
        if uid is not None:
            if f"uid:{uid}" in self._by_user:
                return True, f"uid:{uid}"
            return False, f"uid {uid} is not allowed (allowed: {sorted(self.allowed_uids)})"
        return True, LOOPBACK.name  # NULL over TCP: the daemon binds that only on loopback

    def principal(self, user_id: str | None) -> Principal:
        """The principal of a message's ``User-Id``; an unset one (inproc) counts as loopback."""
        if not user_id:
            return LOOPBACK
        try:
            return self._by_user[user_id]
        except KeyError:
            raise AccessDeniedError(f"unknown principal {user_id!r}") from None


def user_id(frame: Any) -> str | None:
    """The ``User-Id`` ZAP stamped on a received frame (the key's name), None where no ZAP ran
    for its connection (inproc)."""
    try:
        return str(frame.get("User-Id"))
    except zmq.ZMQError:
        return None


class ZapHandler:
    """Answers ZAP requests for ``context`` on a thread until ``close``."""

    def __init__(self, context: zmq.Context[Any], policy: AccessPolicy) -> None:
        self.policy = policy
        self.refused = 0
        self._sock = context.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(ZAP_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvcache-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            msg = self._sock.recv_multipart()
            self._sock.send_multipart(self._answer(msg))

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6:
            return [b"1.0", msg[1] if len(msg) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *credentials = msg
        ok, detail = self.policy.authenticate(mechanism, address.decode(errors="replace"), credentials)
        if not ok:
            self.refused += 1
            log.warning("refused a connection from %s: %s", address.decode(errors="replace"), detail)
            return [version, request_id, b"400", detail.encode(), b"", b""]
        return [version, request_id, b"200", b"OK", detail.encode(), b""]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(linger=0)


__all__ = [
    "LOOPBACK",
    "AccessPolicy",
    "ClientEntry",
    "Principal",
    "ZapHandler",
    "load_clients",
    "user_id",
]
