"""``SidePool``: a hybrid model's side host pool (Mamba state, ...) on a real daemon, no SGLang.

The pool here is a stand-in with SGLang's flat-page interface (``get_data_page`` /
``set_from_flat_data_page`` / ``get_dummy_flat_data_page``); ``sgl_unit.py`` runs the same
paths on SGLang's own ``MambaPoolHost``. What is checked: byte-exact round trips, which
prefixes a trailing-page policy finds restorable (every one reported is, and one beyond the
probe budget is left out, never guessed), bad host indices answer False and copy nothing,
and two pools' pages never meet.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import pytest
import torch

from kvcache.client import KVCacheClient
from kvcache.errors import LayoutError
from kvcache.integrations.sglang import sidecars
from kvcache.integrations.sglang.sidecars import SidePool
from kvcache.server.launch import DaemonProcess, Spawn
from tests.helpers import daemon_starter

PAGE = 600


class FlatPool:
    """SGLang's flat-page host pool interface over ``slots`` random pages of ``PAGE`` bytes."""

    page_size = 1

    def __init__(self, slots: int = 16) -> None:
        self.data = torch.randint(0, 256, (slots, PAGE), dtype=torch.uint8)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(PAGE, dtype=torch.uint8)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.data[index].clone()

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.data[index] = data_page.view(torch.uint8)


@pytest.fixture
def start_daemon(daemon_spawn: Spawn) -> Iterator[Callable[..., DaemonProcess]]:
    yield from daemon_starter(["--l1-size-gb", "0.05", "--disable-metrics"], daemon_spawn)


@pytest.fixture
def side(start_daemon: Callable[..., DaemonProcess]) -> Iterator[Callable[..., SidePool]]:
    daemon = start_daemon()
    pools: list[SidePool] = []

    def make(name: str = "mamba", pool: FlatPool | None = None) -> SidePool:
        client = KVCacheClient(daemon.endpoint, model_name=f"m|tp0of1|pool={name}", timeout_s=10)
        p = SidePool(name, pool or FlatPool(), client, 10.0, "")
        pools.append(p)
        return p

    yield make
    for p in pools:
        p.close()


def keys(n: int, salt: int = 0) -> list[str]:
    return [hashlib.sha256(f"{salt}:{i}".encode()).hexdigest() for i in range(n)]


def at(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def test_round_trip_byte_exact(side: Callable[..., SidePool]) -> None:
    p = side()
    pool = p.host_pool
    k = keys(3)
    assert p.set(k, at(1, 2, 3)) == [True] * 3
    assert p.get([k[0], keys(1, 9)[0], k[2]], at(10, 11, 12)) == [True, False, False]
    assert torch.equal(pool.data[10], pool.data[1])
    assert p.get(k, at(10, 11, 12)) == [True] * 3
    assert torch.equal(pool.data[10:13], pool.data[1:4])


def test_trailing_restorable_is_exact_within_the_probe_budget(side: Callable[..., SidePool]) -> None:
    p = side()
    k = keys(12, 1)
    held = [2, 3, 7, 11]  # indices whose state is stored (a state per node end)
    assert p.set([k[i] for i in held], at(*range(len(held)))) == [True] * len(held)
    assert p.restorable(k, 1) == {i + 1 for i in held}
    assert p.restorable(k, 2) == {4}  # only pages 2 and 3 are adjacent
    assert p.leading(k) == 0 and p.leading(k[2:]) == 2


def test_restorable_stops_at_the_probe_budget(
    side: Callable[..., SidePool], monkeypatch: pytest.MonkeyPatch
) -> None:
    p = side()
    k = keys(10, 2)
    assert p.set([k[0]], at(0)) == [True]
    monkeypatch.setattr(sidecars, "MAX_PROBES", 3)  # probes reach keys 9, 8, 7: not key 0
    assert p.restorable(k, 1) == set()
    monkeypatch.setattr(sidecars, "MAX_PROBES", 10)
    assert p.restorable(k, 1) == {1}


def test_bad_indices_copy_nothing(side: Callable[..., SidePool]) -> None:
    p = side()
    before = p.host_pool.data.clone()
    assert p.set(keys(2, 3), at(1)) == [False, False]
    assert p.get(keys(2, 3), at(1, 2, 3)) == [False, False]
    assert torch.equal(p.host_pool.data, before)
    assert p.leading(keys(2, 3)) == 0


def test_a_page_of_the_wrong_size_is_refused(side: Callable[..., SidePool]) -> None:
    pool = FlatPool()
    p = side(pool=pool)
    pool.data = torch.zeros(16, PAGE + 1, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="bytes"):
        p.set(keys(1, 4), at(0))


def test_pools_never_meet(side: Callable[..., SidePool]) -> None:
    a, b = side("mamba"), side("swa")
    k = keys(2, 5)
    assert a.set(k, at(0, 1)) == [True, True]
    assert b.leading(k) == 0
    assert b.get(k, at(5, 6)) == [False, False]
