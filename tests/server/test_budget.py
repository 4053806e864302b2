"""``server.budget``: what one principal's requests hold, counted apart from every other's."""

from __future__ import annotations

import pytest

from kvcache.errors import LimitExceededError
from kvcache.server.budget import in_flight_bytes


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
