"""``transport.cuda_events``: an exported CUDA event lives as long as the peer may use it."""

from __future__ import annotations

import gc

from kvcache.transport import cuda_events


class _Event:
    """Stands in for a ``torch.cuda.Event``: what matters here is only when it is destroyed."""


def test_an_exported_event_outlives_its_request_and_lingers_after() -> None:
    """CUDA IPC: the daemon may use an event handle until it answered (or, for a call the
    client gave up on, a little later); the exporting side must not destroy the event first."""
    import weakref

    keeper = cuda_events.EventKeeper(linger=2)
    events = [_Event() for _ in range(4)]
    alive = [weakref.ref(e) for e in events]
    exported = [cuda_events.ExportedEvent(e, b"h%d" % i) for i, e in enumerate(events)]
    for x in exported:
        keeper.hold(x)
    del events, x
    exported_first, rest = exported[0], exported[1:]
    del exported
    gc.collect()
    assert all(ref() is not None for ref in alive)  # in flight: held
    keeper.release(exported_first)
    del exported_first
    gc.collect()
    assert alive[0]() is not None  # answered: lingers
    for x in rest:
        keeper.release(x)
    del rest, x
    gc.collect()
    assert [ref() is None for ref in alive] == [True, True, False, False]  # only the last two linger
    assert len(keeper) == 2
