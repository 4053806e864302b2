"""``server.refusals``: a flood's refusals become one count per principal, bound and request."""

from __future__ import annotations

import threading

from kvcache.server.refusals import RefusalTally


def test_refusals_are_counted_per_key_and_taken_once() -> None:
    tally = RefusalTally()
    assert tally.take() == []

    def refuse() -> None:
        for _ in range(1000):
            tally.add("loopback", "--max-awaiting-retrieves", "retrieve")

    workers = [threading.Thread(target=refuse) for _ in range(4)]
    for w in workers:
        w.start()
    tally.add("uid:1", "--max-in-flight-mb", "store")
    for w in workers:
        w.join()
    assert sorted(tally.take()) == [
        (("loopback", "--max-awaiting-retrieves", "retrieve"), 4000),  # none lost between threads
        (("uid:1", "--max-in-flight-mb", "store"), 1),
    ]
    assert tally.take() == []  # taken: the next batch starts at zero
