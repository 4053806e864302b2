"""An example kvcache plug-in subscriber: tokens stored and served per model, logged periodically.

Load it into the daemon (from a directory on PYTHONPATH)::

    PYTHONPATH=docs/examples python -m kvcache.server \\
        --subscriber my_subscriber:TokenTally --subscriber-config '{"log_every": 100}'

It runs on its own thread (kvcache isolates plug-ins), so it may do slow things such as
writing to a database; if it falls behind, events are dropped and counted in
``kvcache_plugin_dropped_events_total{subscriber="TokenTally"}``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import cast

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as PromCounter

from kvcache.observability import Event, EventSubscriber, EventType
from kvcache.observability.bus import Callback
from kvcache.observability.event import MpRetrieveEnd, MpStoreEnd

log = logging.getLogger("my_subscriber")


class TokenTally(EventSubscriber):
    """Counts stored and retrieved tokens per model; logs a summary every ``log_every`` retrieves."""

    def __init__(self, log_every: int = 1000, registry: CollectorRegistry | None = None) -> None:
        self.log_every = log_every
        self.stored: Counter[str] = Counter()
        self.retrieved: Counter[str] = Counter()
        self._retrieves = 0
        # Optional: a metric of our own on the daemon's /metrics endpoint.
        self._prom = (
            PromCounter("my_retrieved_tokens_total", "Tokens retrieved (example plug-in).",
                        ["model_name"], registry=registry)
            if registry is not None
            else None
        )

    def subscriptions(self) -> Mapping[EventType, Callback]:
        return {EventType.MP_STORE_END: self.on_store, EventType.MP_RETRIEVE_END: self.on_retrieve}

    def on_store(self, event: Event) -> None:
        md = cast(MpStoreEnd, event.metadata)  # the Struct EVENTS.md documents for this type
        self.stored[md.model_name] += md.stored_tokens

    def on_retrieve(self, event: Event) -> None:
        md = cast(MpRetrieveEnd, event.metadata)
        model, tokens = md.model_name, md.retrieved_tokens
        self.retrieved[model] += tokens
        if self._prom is not None:
            self._prom.labels(model).inc(tokens)
        self._retrieves += 1
        if self._retrieves % self.log_every == 0:
            log.info("stored %s, retrieved %s", dict(self.stored), dict(self.retrieved))

    def shutdown(self) -> None:
        log.info("final: stored %s, retrieved %s", dict(self.stored), dict(self.retrieved))
