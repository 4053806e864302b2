"""The instance table: heartbeats, in-flight guards and expiry with explicit clocks."""

from __future__ import annotations

import pytest
import torch

from kvcache.errors import UnknownInstanceError
from kvcache.geometry import Geometry
from kvcache.server.auth import Principal
from kvcache.server.registry import InstanceRegistry, RegistrationRecord

OWNER, STRANGER = Principal("uid:1000"), Principal("loopback", shared=True)
CPU = Geometry(num_layers=1, num_blocks=4, block_size=4, num_heads=1, head_size=8, kv_count=2,
               dtype=torch.float16, device=torch.device("cpu"), chunk_size=4)  # fmt: skip


def _inst(i: int, t: float = 0.0) -> RegistrationRecord:
    return RegistrationRecord(instance_id=i, model_name="m", geometry=CPU, tensors=[], last_seen=t,
                    principal=OWNER)  # fmt: skip


def test_unknown_instance_is_a_typed_error_naming_it() -> None:
    reg = InstanceRegistry()
    with pytest.raises(UnknownInstanceError, match="instance 7"):
        reg.get(7)
    assert not reg.touch(7, OWNER)


def test_silent_instances_expire_but_busy_ones_do_not() -> None:
    reg = InstanceRegistry()
    reg.add(_inst(1))
    reg.add(_inst(2))
    generation = reg.begin(2, OWNER, now=0.0)  # e.g. the store of a client that then died
    assert generation
    assert reg.in_flight() == 1
    assert reg.pop_expired(5.0, now=4.0) == []
    assert [i.instance_id for i in reg.pop_expired(5.0, now=6.0)] == [1]
    assert reg.ids() == [2]
    reg.end(2, generation, now=6.0)  # the store finished: the clock restarts from its end
    assert reg.pop_expired(5.0, now=10.0) == []
    assert [i.instance_id for i in reg.pop_expired(5.0, now=11.5)] == [2]
    assert reg.ids() == []


def test_touch_keeps_an_instance_alive() -> None:
    reg = InstanceRegistry()
    reg.add(_inst(1))
    assert reg.touch(1, OWNER, now=4.0)
    assert reg.pop_expired(5.0, now=8.0) == []
    assert len(reg.pop_expired(5.0, now=9.5)) == 1


def test_registering_again_replaces_and_keeps_in_flight() -> None:
    reg = InstanceRegistry()
    reg.add(_inst(1))
    generation = reg.begin(1, OWNER, now=0.0)
    assert generation
    old = reg.add(RegistrationRecord(1, "other", CPU, []))
    assert old is not None and old.model_name == "m"
    assert reg.get(1).model_name == "other" and reg.get(1).in_flight == 1
    assert 1 in reg and 2 not in reg
    reg.end(1, generation)  # the request of the record replaced ends: counted off the new one
    assert reg.get(1).in_flight == 0


def test_a_request_of_a_removed_registration_never_uncounts_the_next_one() -> None:
    """Unregistered, then registered again under the same id: the old registration's
    requests ending must not take the new one's off its count (the reaper would drop it
    while they run)."""
    reg = InstanceRegistry()
    reg.add(_inst(1))
    old = reg.begin(1, OWNER, now=0.0)  # a request of the first registration, still running
    assert old and reg.remove(1) is not None
    reg.add(_inst(1, t=1.0))
    new = reg.begin(1, OWNER, now=1.0)  # the new registration's own request
    assert new and new != old
    reg.end(1, old, now=2.0)
    assert reg.in_flight() == 1 and reg.get(1).last_seen == 1.0
    assert reg.pop_expired(5.0, now=10.0) == []  # silent, but its request still runs
    reg.end(1, new, now=10.0)
    assert reg.in_flight() == 0
    assert [i.instance_id for i in reg.pop_expired(5.0, now=15.5)] == [1]


def test_a_stranger_neither_touches_nor_pins_an_instance() -> None:
    reg = InstanceRegistry()
    inst = _inst(1)
    reg.add(inst)
    assert not reg.touch(1, STRANGER, now=4.0)
    assert not reg.begin(1, STRANGER, now=4.0)
    assert not reg.touch(1, STRANGER, token=b"x" * 16, now=4.0)  # a guessed token
    assert reg.in_flight() == 0 and reg.ids(STRANGER) == [] and reg.ids(OWNER) == [1]
    assert not reg.touch(1, STRANGER, token=inst.token, now=4.0)  # a stolen token: useless
    assert reg.touch(1, OWNER, token=inst.token, now=4.0)
    assert reg.pop_expired(5.0, now=8.0) == []
