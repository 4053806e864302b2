"""Command-line flags for KV events and the one call that turns them into a bus subscriber.

Kept out of the daemon's CLI so any entry point (the daemon, a benchmark, a framework
embedding ``CacheEngine``) gets the same flags and the same defaults: KV events are off
unless ``--kv-events`` or ``--kv-events-endpoint`` is given.

Who may read them: every bound socket asks ZAP (``kvcache.server.auth``) about each reader.
On ``ipc://`` only the daemon's own user gets in (``--kv-events`` puts both sockets in the
private runtime directory, so no other user even reaches them); on TCP only CURVE keys of the
allow-list marked ``kv_events = true`` (routers). Tenants are not readers: the stream carries
every tenant's prompts.
"""

from __future__ import annotations

import argparse
import logging
import os

from prometheus_client.registry import CollectorRegistry

from kvcache.kv_events.factory import default_factory
from kvcache.kv_events.messages import FORMATS
from kvcache.kv_events.replay import DEFAULT_REPLAY_RATE
from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.kv_events.zmq_publisher import DEFAULT_BATCH_WINDOW_S, DEFAULT_BUFFER_STEPS, should_bind
from kvcache.netaddr import ZMQ_TRANSPORTS, endpoint_host, endpoint_is_local
from kvcache.observability.config import positive_int
from kvcache.server.auth import AccessPolicy, load_clients
from kvcache.transport.curve import load_secret_key

log = logging.getLogger("kvcache.kv_events")

DEFAULT_TOPIC = "kv-events"
DEFAULT_CHUNK_SIZE = 256
ENDPOINT_SOCKET, REPLAY_SOCKET = "kv-events.sock", "kv-events-replay.sock"
"""The ``--kv-events`` sockets, inside the daemon's private runtime directory."""


def non_negative_ms(text: str) -> float:
    """argparse type for a delay in milliseconds (0 allowed)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_rate(text: str) -> float:
    """argparse type for a rate a second (> 0, finite)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):  # also refuses NaN
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def add_kv_events_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``kv events`` flag group to ``parser``; returns it."""
    g = parser.add_argument_group("kv events (vLLM-compatible, for cluster routers)")
    g.add_argument(
        "--kv-events",
        action="store_true",
        help="publish KV events on the private runtime directory's Unix sockets "
        f"({ENDPOINT_SOCKET}, replay {REPLAY_SOCKET}): only the daemon's own "
        "user can read them. --kv-events-endpoint / "
        "--kv-events-replay-endpoint override either address",
    )
    g.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ADDR",
        help="ZMQ PUB address (vLLM's convention): ipc://, tcp://[::1]:5557 and "
        "wildcards (tcp://*:5557) bind, a plain host (tcp://router:5557, "
        "tcp://127.0.0.1:5557) connects to a router that binds; a bind beyond "
        "loopback needs --kv-events-allow-remote; any TCP bind needs "
        "--curve-secret-key and --clients (readers: kv_events = true). "
        "Default: KV events off",
    )
    g.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="ADDR",
        help="ZMQ ROUTER address (always bound) where routers ask for missed "
        "batches, e.g. ipc:///run/kvcache/replay.sock; TCP needs CURVE as "
        "above, beyond loopback also --kv-events-allow-remote (default: no "
        "replay, or the runtime directory's with --kv-events)",
    )
    g.add_argument(
        "--kv-events-allow-remote",
        action="store_true",
        help="allow binding the KV-events sockets beyond loopback (tcp://*:N, "
        "0.0.0.0, [::], a network address); logged as a warning: anyone who "
        "connects learns which prompts are cached (default: refused)",
    )
    g.add_argument(
        "--kv-events-topic", default=DEFAULT_TOPIC, help="topic frame of every message (default %(default)s)"
    )
    g.add_argument(
        "--kv-events-format",
        choices=FORMATS,
        default="map",
        help="event encoding: map (vLLM >= 0.24) or array (vLLM <= 0.23); default %(default)s",
    )
    g.add_argument(
        "--kv-events-token-ids",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send each stored block's token ids in BlockStored.token_ids, as vLLM "
        "does (routers that hash tokens themselves need them); about 3-5 bytes "
        "a token on the wire, 8 bytes a held token in the daemon "
        "(default: on; --no-kv-events-token-ids sends [])",
    )
    g.add_argument(
        "--kv-events-buffer-steps",
        type=positive_int,
        default=DEFAULT_BUFFER_STEPS,
        help="batches kept for replay (default %(default)s)",
    )
    g.add_argument(
        "--kv-events-replay-rate",
        type=positive_rate,
        default=DEFAULT_REPLAY_RATE,
        metavar="BATCHES",
        help="replayed batches a second, all readers together; a flood of replay requests "
        "costs the daemon no more (one whole buffer may go at once; default %(default)g)",
    )
    g.add_argument(
        "--kv-events-batch-window-ms",
        type=non_negative_ms,
        default=DEFAULT_BATCH_WINDOW_S * 1000,
        metavar="MS",
        help="least time between two messages; the engine operations of a window "
        "travel merged, in order, in one batch (0: send at once; default "
        "%(default)s)",
    )
    return parser


def build_kv_events_subscriber(
    ns: argparse.Namespace, registry: CollectorRegistry | None = None
) -> KVEventsSubscriber | None:
    """The subscriber the flags ask for, with its ZMQ publisher open; None when off.

    ``ns.chunk_size`` (the daemon's ``--chunk-size``) sets ``block_size`` of chunk-keyed
    events. Raises ``ValueError`` for inconsistent flags or an endpoint that cannot be opened.
    """
    validate_kv_events_args(ns)
    endpoint = getattr(ns, "kv_events_endpoint", None)
    replay = getattr(ns, "kv_events_replay_endpoint", None)
    if endpoint is None:
        return None
    check_exposure(endpoint, replay, getattr(ns, "kv_events_allow_remote", False))
    clients_file = getattr(ns, "clients", None)
    readers = [c for c in load_clients(clients_file) if c.kv_events] if clients_file else []
    key_file = getattr(ns, "curve_secret_key", None)
    tcp = unauthenticated_binds(endpoint, replay)
    if tcp and not readers:
        log.warning(
            "KV events on %s: no [[client]] of %s has kv_events = true, so no router can read "
            "them", ", ".join(tcp), clients_file,
        )  # fmt: skip
    publisher = default_factory().create(
        "zmq",
        endpoint=endpoint,
        replay_endpoint=replay,
        readers=AccessPolicy(readers),
        curve_keys=load_secret_key(key_file) if key_file else None,
        topic=getattr(ns, "kv_events_topic", DEFAULT_TOPIC),
        buffer_steps=getattr(ns, "kv_events_buffer_steps", DEFAULT_BUFFER_STEPS),
        replay_rate=getattr(ns, "kv_events_replay_rate", DEFAULT_REPLAY_RATE),
        batch_window_s=getattr(ns, "kv_events_batch_window_ms", DEFAULT_BATCH_WINDOW_S * 1000) / 1000,
    )
    try:
        return KVEventsSubscriber(
            publisher,
            chunk_size=getattr(ns, "chunk_size", DEFAULT_CHUNK_SIZE),
            fmt=getattr(ns, "kv_events_format", "map"),
            registry=registry,
            token_ids=getattr(ns, "kv_events_token_ids", True),
        )
    except BaseException:
        publisher.shutdown()
        raise


def exposed_binds(endpoint: str | None, replay: str | None) -> list[str]:
    """The KV-events addresses the daemon would bind beyond this host.

    The PUB ``endpoint`` binds only by vLLM's convention (wildcard, ``ipc://``, ``inproc://``;
    a plain host connects to a router that binds, which exposes nothing here); the replay
    ``ROUTER`` always binds. Local means ``netaddr.endpoint_is_local``: ipc/inproc or a
    loopback host; every other address or ZMQ transport counts as exposed. A scheme that is
    no ZMQ transport binds nothing (ZMQ refuses to open it), so it is not listed.
    """
    bound = [e for e in (endpoint if endpoint and should_bind(endpoint) else None, replay) if e]
    return [
        e for e in bound
        if endpoint_host(e)[0] in ZMQ_TRANSPORTS and not endpoint_is_local(e)
    ]  # fmt: skip


def check_exposure(endpoint: str | None, replay: str | None, allow_remote: bool) -> None:
    """Refuse to bind a KV-events socket beyond loopback unless asked; warn when asked.

    Raises ``ValueError`` naming ``--kv-events-allow-remote``. Binding ``tcp://*`` tells
    anyone who reaches the port which prompts are cached.
    """
    exposed = exposed_binds(endpoint, replay)
    if not exposed:
        return
    if not allow_remote:
        raise ValueError(
            f"refusing to bind KV events on {', '.join(exposed)}: that is reachable from the "
            "network and reveals which prompts are cached; bind ipc:// or loopback, let the "
            "router bind (a plain host connects to it), or pass --kv-events-allow-remote"
        )
    log.warning(
        "KV events bound on %s: reachable from the network; anyone who connects learns which "
        "prompts are cached (block hashes and, unless --no-kv-events-token-ids, their token "
        "ids). Firewall it to the routers", ", ".join(exposed),
    )  # fmt: skip


def use_runtime_dir(ns: argparse.Namespace, runtime_dir: str) -> None:
    """With ``--kv-events``, fill in the endpoints not given: the runtime directory's sockets."""
    if not getattr(ns, "kv_events", False):
        return
    if getattr(ns, "kv_events_endpoint", None) is None:
        ns.kv_events_endpoint = f"ipc://{os.path.join(runtime_dir, ENDPOINT_SOCKET)}"
    if getattr(ns, "kv_events_replay_endpoint", None) is None:
        ns.kv_events_replay_endpoint = f"ipc://{os.path.join(runtime_dir, REPLAY_SOCKET)}"


def unauthenticated_binds(endpoint: str | None, replay: str | None) -> list[str]:
    """The KV-events addresses that would bind on a network transport (TCP, loopback
    included): every local user reaches those, so only CURVE can tell a router from them."""
    bound = [e for e in (endpoint if endpoint and should_bind(endpoint) else None, replay) if e]
    return [e for e in bound if endpoint_host(e)[0] in ZMQ_TRANSPORTS - {"ipc", "inproc"}]


def check_readers(ns: argparse.Namespace) -> None:
    """Refuse a TCP bind of the KV events without CURVE (``--curve-secret-key``, and
    ``--clients`` naming the readers): the stream carries every tenant's token ids."""
    exposed = unauthenticated_binds(
        getattr(ns, "kv_events_endpoint", None), getattr(ns, "kv_events_replay_endpoint", None)
    )
    if exposed and not (getattr(ns, "curve_secret_key", None) and getattr(ns, "clients", None)):
        raise ValueError(
            f"refusing to bind KV events on {', '.join(exposed)} without CURVE: every local "
            "user could connect and read every tenant's cached prompts (hashes and token ids); "
            "use --kv-events (Unix sockets in the private runtime directory), or pass "
            "--curve-secret-key and --clients with the routers' keys marked kv_events = true"
        )


def validate_kv_events_args(ns: argparse.Namespace) -> None:
    """Check the KV-events flags without opening anything (for the daemon's flag parsing).

    Raises ``ValueError`` for a replay endpoint without an endpoint, a bind beyond loopback
    without ``--kv-events-allow-remote``, or a TCP bind without CURVE (``check_readers``);
    logs nothing.
    """
    endpoint = getattr(ns, "kv_events_endpoint", None)
    replay = getattr(ns, "kv_events_replay_endpoint", None)
    if endpoint is None and replay is not None:
        raise ValueError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    if not getattr(ns, "kv_events_allow_remote", False):
        check_exposure(endpoint, replay, allow_remote=False)  # raises if exposed, never logs
    check_readers(ns)


__all__ = [
    "DEFAULT_TOPIC",
    "ENDPOINT_SOCKET",
    "REPLAY_SOCKET",
    "add_kv_events_args",
    "build_kv_events_subscriber",
    "check_exposure",
    "check_readers",
    "exposed_binds",
    "unauthenticated_binds",
    "use_runtime_dir",
    "validate_kv_events_args",
]
