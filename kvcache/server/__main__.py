"""``python -m kvcache.server``: parse the settings, then build and run the daemon.

Separate from ``daemon`` so the loop can be embedded (tests, benchmarks) without argparse,
signals or logging setup, and from ``settings`` (flags and TOML) so that parsing starts
nothing. This module only wires the pieces together, in order, and stops them in reverse.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

from kvcache.config import EngineConfig, GiB
from kvcache.protocol.messages import PROTOCOL_VERSION
from kvcache.server.fd_budget import raise_descriptor_limit
from kvcache.server.settings import parse_settings
from kvcache.transport.endpoints import default_runtime_dir
from kvcache.trusted_dir import ensure_private_dir

if TYPE_CHECKING:
    from kvcache.observability import Observability

log = logging.getLogger("kvcache.server")


def main(argv: Sequence[str] | None = None, prog: str = "python -m kvcache.server") -> int:
    settings = parse_settings(argv, prog)
    logging.basicConfig(
        level=settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from kvcache.engine.engine import CacheEngine
    from kvcache.observability import init_observability
    from kvcache.server.daemon import Daemon
    from kvcache.server.handlers import Handlers
    from kvcache.server.registry import InstanceRegistry

    raise_descriptor_limit()  # before anything opens: connections are sized from it
    try:
        obs = init_observability(settings.observability)
    except (OSError, ValueError) as exc:
        log.error("cannot start observability: %s", exc)
        return 1
    try:
        if settings.args.kv_events:  # its sockets live in the runtime directory: make it first
            runtime_dir = settings.daemon.runtime_dir or default_runtime_dir()
            ensure_private_dir(runtime_dir, what="runtime directory (--runtime-dir)")
        _add_flag_subscribers(settings.args, obs)
        engine = CacheEngine(settings.engine, bus=obs.bus)
    except (OSError, ValueError, ImportError) as exc:
        log.error("cannot start: %s", exc)
        obs.shutdown()
        return 1
    try:
        handlers = Handlers(
            engine,
            InstanceRegistry(),
            settings.daemon.heartbeat_timeout_s,
            limits=settings.limits,
            bus=obs.bus,
        )
        daemon = Daemon(settings.daemon, handlers)
    except (OSError, ValueError) as exc:
        log.error("%s", exc)
        engine.close()
        obs.shutdown()
        return 1

    signals_seen: list[int] = []

    def stop(signum: int, frame: FrameType | None) -> None:
        signals_seen.append(signum)
        if len(signals_seen) > 1:  # a second Ctrl-C: the operator does not want to wait
            log.warning("received %s again: exiting without draining", signal.Signals(signum).name)
            os._exit(1)
        log.info("received %s: draining (send it again to exit at once)", signal.Signals(signum).name)
        daemon.request_stop()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    kv_events = settings.args.kv_events_endpoint
    log.info(
        "kvcache daemon ready: zmq %s, ipc %s, fds %s, metrics %s, kv events %s, protocol v%d, "
        "L1 %.3g GiB, L2 %s, pid %d",
        daemon.endpoint, daemon.ipc_endpoint or "off", daemon.fd_inbox.path, _metrics_url(obs),
        kv_events or "off", PROTOCOL_VERSION, settings.engine.l1_size_bytes / GiB,
        _l2_summary(settings.engine), os.getpid(),
    )  # fmt: skip
    # What start-up made (torch, the modules, the L1 tables) lives as long as the daemon:
    # out of the collector's sight, so a full collection walks what requests made, not
    # 250,000 objects under the GIL (127 ms measured, every tenant stalled meanwhile).
    gc.freeze()
    try:
        daemon.serve()
    finally:
        engine.close()  # flushes pending L2 writes
        obs.shutdown()  # drains the bus, stops exporters
    log.info("kvcache daemon stopped")
    return 0


def _add_flag_subscribers(ns: argparse.Namespace, obs: Observability) -> None:
    """Subscribers switched on by flags outside ``ObservabilityConfig``: KV events for routers,
    the per-request trace file and ``--subscriber`` plug-ins. ``obs.shutdown`` stops them."""
    from kvcache.kv_events.config import build_kv_events_subscriber
    from kvcache.observability.subscribers.logging.request_trace import (
        build_request_trace_subscriber,
    )
    from kvcache.plugins import subscribers_from_args

    subs: list[Any] = []
    kv_events = build_kv_events_subscriber(ns, obs.registry)
    if kv_events is not None:
        subs.append(kv_events)
        log.info("publishing KV events on %s", ns.kv_events_endpoint)
    trace = build_request_trace_subscriber(ns)
    if trace is not None:
        subs.append(trace)
    subs += subscribers_from_args(ns, obs.registry)
    for sub in subs:
        obs.bus.register_subscriber(sub)
        obs.subscribers.append(sub)


def _metrics_url(obs: Observability) -> str:
    return obs.endpoint.url if obs.endpoint is not None else "off"


def _l2_summary(cfg: EngineConfig) -> str:
    tiers = []
    if cfg.l2_disk_path:
        tiers.append(f"disk {cfg.l2_disk_path} ({cfg.l2_disk_size_bytes / GiB:.3g} GiB)")
    if cfg.l2_redis_url:
        trust = "records sealed" if cfg.l2_redis_auth_key_file else "trusting every writer"
        tiers.append(f"redis {redact_url(cfg.l2_redis_url)} ({trust})")
    return ", ".join(tiers) or "off"


def redact_url(url: str) -> str:
    """``url`` with any password replaced, fit for a log line (cluster URLs included)."""
    from kvcache.storage.l2.redis.url import redact

    return redact(url)


def exit_now(rc: int) -> None:
    """End the process with ``rc`` without the interpreter's teardown.

    Only after ``main`` returned: by then every thread is stopped, pending L2 writes are
    flushed and the bus is drained. What teardown would still do is free torch's and ZMQ's
    module state one object at a time, about 0.3 s per stop, paid by every restart an operator
    waits on (and by every test that starts a daemon). It would also wait on a worker thread
    that outlived the drain timeout, which ``serve`` has already given up on."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    exit_now(main())
