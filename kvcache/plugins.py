"""Load third-party event subscribers into a kvcache process: ``--subscriber module:Class``.

Why it exists: a framework that wraps kvcache (a serving stack, a cluster scheduler) wants
its own statistics or block observer inside the daemon without forking it. This module is
the whole public interface for that; see docs/operator-guide.md and
docs/examples/my_subscriber.py.

The contract for a plug-in class:

* it subclasses ``kvcache.observability.EventSubscriber`` and implements
  ``subscriptions()`` (event type -> callback) and optionally ``shutdown()``;
* it is constructed as ``Class(**config)``, ``config`` being the JSON object given by the
  matching ``--subscriber-config`` (the n-th config goes with the n-th ``--subscriber``;
  missing ones mean ``{}``); if ``__init__`` has a ``registry`` parameter it also receives
  the process's Prometheus ``CollectorRegistry``, so its metrics appear on /metrics;
* callbacks run on the plug-in's **own** thread (``IsolatedSubscriber``), fed by a bounded
  queue: a slow plug-in loses events (counted), never delays the bus or other subscribers,
  and one that raises is counted and logged, never propagated.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import logging
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.registry import CollectorRegistry

from kvcache.errors import ConfigError
from kvcache.observability.bus import Callback, EventSubscriber
from kvcache.observability.event import Event, EventType
from kvcache.observability.instruments import MetricSet

logger = logging.getLogger(__name__)

DEFAULT_PLUGIN_QUEUE = 10_000


class IsolatedSubscriber(EventSubscriber):
    """Runs ``inner``'s callbacks on a thread of its own, behind a drop-on-full queue.

    The bus dispatcher only pays a ``put_nowait``; ``dropped`` and ``errors`` count what the
    plug-in lost or raised. ``shutdown`` lets the thread finish the queue (bounded wait),
    then calls ``inner.shutdown()``.
    """

    def __init__(self, inner: EventSubscriber, max_queue_size: int = DEFAULT_PLUGIN_QUEUE) -> None:
        self.inner = inner
        self._routes = dict(inner.subscriptions())
        # None stops the thread; a threading.Event is a join marker.
        self._queue: queue.Queue[Event | threading.Event | None] = queue.Queue(max_queue_size)
        self.dropped = 0
        self.errors = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvcache-plugin-{inner.name}", daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self.inner.name

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return dict.fromkeys(self._routes, self._enqueue)

    def _enqueue(self, event: Event) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            if isinstance(event, threading.Event):
                event.set()
                continue
            try:
                self._routes[event.event_type](event)
            except Exception:
                self.errors += 1
                if self.errors == 1 or self.errors % 1000 == 0:
                    logger.exception(
                        "plug-in subscriber %s raised (%d errors so far)", self.name, self.errors
                    )

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the plug-in has handled everything queued so far (tests use it)."""
        done = threading.Event()
        self._queue.put(done, timeout=timeout)
        return done.wait(timeout)

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            logger.warning("plug-in subscriber %s did not drain its queue", self.name)
        self._thread.join(timeout)
        self.inner.shutdown()


def load_subscriber(
    spec: str, config: Mapping[str, Any] | None = None, registry: CollectorRegistry | None = None
) -> EventSubscriber:
    """Import ``module:Class`` and construct it as described in the module docstring.

    Raises ``ConfigError`` (a ``ValueError``) naming ``spec`` when it cannot be loaded.
    """
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ConfigError(f"--subscriber {spec!r}: expected module:Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--subscriber {spec!r}: cannot import {module_name!r}: {exc}") from exc
    cls = module
    for part in class_name.split("."):
        cls = getattr(cls, part, None)  # type: ignore[assignment]
        if cls is None:
            raise ConfigError(f"--subscriber {spec!r}: {module_name!r} has no {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, EventSubscriber)):
        raise ConfigError(f"--subscriber {spec!r} is not a kvcache.observability.EventSubscriber")
    kwargs = dict(config or {})
    if "registry" in inspect.signature(cls).parameters and "registry" not in kwargs:
        kwargs["registry"] = registry
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"--subscriber {spec!r}: bad --subscriber-config: {exc}") from exc


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"every\": 10}'")
    return value


def add_plugin_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("plug-in subscribers")
    g.add_argument(
        "--subscriber",
        action="append",
        default=[],
        metavar="MODULE:CLASS",
        help="load an EventSubscriber class into the event bus (repeatable)",
    )
    g.add_argument(
        "--subscriber-config",
        action="append",
        default=[],
        type=_json_object,
        metavar="JSON",
        help="keyword arguments (a JSON object) for the --subscriber at the same position",
    )
    return parser


def load_plugin_subscribers(
    specs: Sequence[str],
    configs: Sequence[Mapping[str, Any]] = (),
    registry: CollectorRegistry | None = None,
    max_queue_size: int = DEFAULT_PLUGIN_QUEUE,
) -> list[IsolatedSubscriber]:
    """Load every plug-in, each wrapped in ``IsolatedSubscriber``; all or nothing."""
    if len(configs) > len(specs):
        raise ConfigError(f"{len(configs)} --subscriber-config given for {len(specs)} --subscriber")
    loaded: list[IsolatedSubscriber] = []
    try:
        for i, spec in enumerate(specs):
            inner = load_subscriber(spec, configs[i] if i < len(configs) else {}, registry)
            loaded.append(IsolatedSubscriber(inner, max_queue_size))
    except BaseException:
        for sub in loaded:
            sub.shutdown()
        raise
    if registry is not None and loaded:
        _plugin_metrics(loaded).register(registry)
    return loaded


def subscribers_from_args(
    ns: argparse.Namespace, registry: CollectorRegistry | None = None
) -> list[IsolatedSubscriber]:
    """``load_plugin_subscribers`` from the flags ``add_plugin_args`` added."""
    return load_plugin_subscribers(ns.subscriber, ns.subscriber_config, registry)


def _plugin_metrics(subs: list[IsolatedSubscriber]) -> MetricSet:
    m = MetricSet()
    dropped = m.add(
        "kvcache_plugin_dropped_events_total",
        "Events a plug-in subscriber lost because its queue was full.",
        "counter",
        ("subscriber",),
    )
    errors = m.add(
        "kvcache_plugin_errors_total", "Plug-in subscriber callbacks that raised.", "counter", ("subscriber",)
    )

    def refresh() -> None:
        for s in subs:
            dropped.counter(s.name).value = s.dropped
            errors.counter(s.name).value = s.errors

    refresh()
    m.on_collect(refresh)
    return m


__all__ = [
    "IsolatedSubscriber",
    "add_plugin_args",
    "load_plugin_subscribers",
    "load_subscriber",
    "subscribers_from_args",
]
