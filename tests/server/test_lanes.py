"""Each principal gets a slice of the I/O thread per read; past it, its inline requests go to
the fast lane, whose workers serve principals in turn."""

from __future__ import annotations

import time

from kvcache.server.lanes import INLINE_SLICE_S, InlineShare


def _spend(share: InlineShare, principal: str, seconds: float) -> None:
    with share.timed(principal):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass


def test_a_principal_past_its_slice_goes_to_the_fast_lane_and_others_stay_inline() -> None:
    share = InlineShare()
    assert share.lane("flood", "inline") == "inline"
    _spend(share, "flood", INLINE_SLICE_S)
    assert share.lane("flood", "inline") == "fast"
    assert share.lane("victim", "inline") == "inline"  # its own slice is untouched
    assert share.lane("flood", "bulk") == "bulk"  # only inline requests move


def test_each_read_starts_with_a_fresh_slice() -> None:
    share = InlineShare()
    _spend(share, "flood", INLINE_SLICE_S)
    assert InlineShare().lane("flood", "inline") == "inline"
