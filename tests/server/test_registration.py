"""``registration.check_registration_size``: what one registration may make the daemon hold."""

from __future__ import annotations

import pytest

from kvcache.errors import LimitExceededError
from kvcache.protocol import messages as m
from kvcache.server import registration
from kvcache.server.registration import MAP_HEADROOM, Limits, check_registration_size, free_memory_maps


def _register(count: int) -> m.Register:
    view = m.FdTensor(fd_index=0, offset=0, shape=[2, 4], stride=[4, 1], dtype="float16")
    return m.Register(instance_id=1, model_name="m", tensors=[view] * count)


def test_the_process_knows_its_free_memory_maps() -> None:
    free = free_memory_maps()
    assert free is not None and 0 < free < 1 << 31


def test_a_registration_that_would_use_up_the_memory_maps_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each mapped CPU tensor is one memory map; past ``vm.max_map_count`` every ``mmap`` of
    the daemon fails, its own allocations included. (The system-wide count cannot be lowered
    for one test, so the free count is given.)"""
    monkeypatch.setattr(registration, "free_memory_maps", lambda: MAP_HEADROOM + 100)
    check_registration_size(_register(100), Limits())  # leaves the headroom: fine
    with pytest.raises(LimitExceededError, match="short of memory maps"):
        check_registration_size(_register(101), Limits())
