"""LoggingSubscriber: one INFO line per finished operation, WARNING on failure, DEBUG detail."""

from __future__ import annotations

import logging

import pytest

from kvcache.observability.bus import EventBus
from kvcache.observability.event import EventType
from kvcache.observability.subscribers.logging import LoggingSubscriber
from tests.helpers import event

LOGGER = "kvcache.events"


def test_info_line_per_operation(bus: EventBus, caplog: pytest.LogCaptureFixture) -> None:
    bus.register_subscriber(LoggingSubscriber())
    caplog.set_level(logging.INFO, logger=LOGGER)
    md = {"instance_id": 1, "model_name": "m", "device": "cpu"}
    bus.publish(event(EventType.MP_STORE_START, {**md, "num_tokens": 512}, "op1"))
    bus.publish(
        event(
            EventType.MP_STORE_END,
            {
                **md,
                "num_tokens": 512,
                "stored_chunks": 2,
                "skipped_chunks": 0,
                "failed_chunks": 0,
                "num_bytes": 2_000_000,
                "transfer_seconds": 0.001,
                "success": True,
            },
            "op1",
        )
    )
    bus.publish(
        event(
            EventType.MP_LOOKUP_END,
            {**md, "num_tokens": 10, "hit_tokens": 5, "l1_hit_tokens": 5, "l2_hit_tokens": 0},
            "op2",
        )
    )
    bus.publish(event(EventType.MP_RETRIEVE_END, {**md, "num_tokens": 8, "success": False}, "op3"))
    bus.publish(event(EventType.L2_LOAD_FAILED, {"backend": "disk", "keys": [1, 2], "reason": "corrupt"}))
    assert bus.flush(5)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in records] == [
        logging.INFO,
        logging.INFO,
        logging.WARNING,
        logging.WARNING,
    ]
    store, lookup, retrieve, l2 = (r.getMessage() for r in records)
    assert store.startswith("store session=op1 instance=1 model=m device=cpu tokens=512")
    assert "2.00 GB/s" in store
    assert "hit=5" in lookup
    assert retrieve.endswith("FAILED")
    assert "corrupt" in l2 and "keys=2" in l2


def test_details_only_at_debug(bus: EventBus, caplog: pytest.LogCaptureFixture) -> None:
    bus.register_subscriber(LoggingSubscriber())
    caplog.set_level(logging.INFO, logger=LOGGER)
    bus.publish(event(EventType.L1_WRITE_FINISHED, {"keys": [1], "num_bytes": 1}))
    assert bus.flush(5)
    assert not [r for r in caplog.records if r.name == LOGGER]
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    bus.publish(event(EventType.L1_WRITE_FINISHED, {"keys": [1], "num_bytes": 1}))
    assert bus.flush(5)
    (rec,) = [r for r in caplog.records if r.name == LOGGER]
    assert rec.levelno == logging.DEBUG and "l1.write.finished" in rec.getMessage()
