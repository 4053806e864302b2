"""``server.budget``: what one principal's requests hold, counted apart from every other's."""

from __future__ import annotations

import pytest

from kvcache.errors import LimitExceededError, PrincipalLimitError
from kvcache.server.budget import awaiting_retrieves, in_flight_bytes


def test_a_principal_is_held_to_its_own_share_and_gets_it_back() -> None:
    budget = in_flight_bytes(10)
    budget.take("uid:1", 6)
    refusal = r"would hold 11 bytes .* limit is 10 \(--max-in-flight-mb\)"
    with pytest.raises(LimitExceededError, match=refusal):
        budget.take("uid:1", 5)
    assert budget.held("uid:1") == 6  # the refused request counted nothing
    budget.take("loopback", 10)  # another principal's share is whole
    budget.give("uid:1", 6)
    budget.take("uid:1", 10)
    assert (budget.held("uid:1"), budget.held("loopback")) == (10, 10)


def test_the_early_refusal_names_the_bound_and_counts_nothing() -> None:
    """The I/O thread's refusal (``AwaitBounds.hold``) is built once from ``refusal``."""
    budget = awaiting_retrieves(2)
    budget.take("loopback", 2)
    with pytest.raises(PrincipalLimitError, match=r"more than 2 retrieves .*--max-awaiting-retrieves"):
        raise budget.refusal()
    assert budget.refusal().flag == "--max-awaiting-retrieves"
    assert budget.held("loopback") == 2
    budget.take("uid:1", 2)  # another principal's share is whole
