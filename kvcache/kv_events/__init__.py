"""KV events for cluster routers in vLLM's wire format (see ``messages`` for the format).

``build_kv_events_subscriber`` is what an entry point calls; routers need only ``messages``.
"""

from kvcache.kv_events.config import add_kv_events_args, build_kv_events_subscriber
from kvcache.kv_events.factory import EventPublisherFactory
from kvcache.kv_events.messages import (
    END_SEQ,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
)
from kvcache.kv_events.publisher import EventPublisher, NullEventPublisher
from kvcache.kv_events.subscriber import KVEventsSubscriber
from kvcache.kv_events.zmq_publisher import ZmqEventPublisher

__all__ = [
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventPublisher",
    "EventPublisherFactory",
    "KVEventBatch",
    "KVEventsSubscriber",
    "NullEventPublisher",
    "ZmqEventPublisher",
    "add_kv_events_args",
    "build_kv_events_subscriber",
]
