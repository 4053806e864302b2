"""SGLang page requests (``PageExists`` / ``PageSet`` / ``PageGet``) against a real daemon.

Hostile first: every byte a page client sends is untrusted. A client naming pages under
another salt or model, or another instance's id without its token, oversized key counts,
malformed keys and block ids outside its cache each get a typed error (or nothing), nothing
changes, and the honest client is still served.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvcache.client import KVCacheClient
from kvcache.integrations.sglang.host import HostPages
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.launch import DaemonProcess, Spawn
from tests.helpers import daemon_starter
from tests.security.conftest import raw_call

PS, NL, NH, HS, PAGES = 4, 2, 2, 8, 32


@pytest.fixture
def start_daemon(daemon_spawn: Spawn | None) -> Iterator[Callable[..., DaemonProcess]]:
    args = ["--chunk-size", "16", "--l1-size-gb", "0.05", "--max-ids", "4096"]
    yield from daemon_starter(args, daemon_spawn)


@pytest.fixture
def new_page() -> Iterator[Callable[..., Page]]:
    """``Page(...)``, closed when the test ends (its client's thread would outlive the daemon)."""
    made: list[Page] = []

    def make(*args: Any, **kwargs: Any) -> Page:
        made.append(Page(*args, **kwargs))
        return made[-1]

    yield make
    for page in made:
        page.client.close()


def keys_of(*names: str) -> bytes:
    return b"".join(hashlib.sha256(n.encode()).digest() for n in names)


class Page:
    """A page client as the SGLang backend is one: a layer_first pool in shared memory."""

    def __init__(
        self, endpoint: str, model: str = "m", salt: str = "", pages: int = PAGES, **client: Any
    ) -> None:
        self.client = KVCacheClient(endpoint, model_name=model, timeout_s=5, **client)
        try:
            self.register(pages)
        except BaseException:
            self.client.close()
            raise
        self.salt = salt

    def register(self, pages: int) -> None:
        """(Re-)register a ``pages``-page pool in fresh shared memory."""
        from kvcache.transport.memfd import empty_shared

        self.buf = empty_shared((2, NL, pages * PS, NH, HS), torch.bfloat16)
        self.pages = HostPages(self.buf, "layer_first", mla=False, page_size=PS, staging_pages=8)
        assert self.pages.zero_copy
        self.client.register_kv_caches(self.pages.kv_caches, engine="sglang", block_size=PS,
                                       fmt=self.pages.fmt, chunk_size=PS)  # fmt: skip

    def call(self, body: m.RequestBody, expected: type) -> m.ReplyBody:
        return self.client.session.call(body, expected)

    def exists(self, keys: bytes) -> int:
        msg = m.PageExists(instance_id=self.client.instance_id, keys=keys, cache_salt=self.salt)
        return int(self.call(msg, m.PageExistsResult).hit_pages)

    def set(self, keys: bytes, ids: list[int]) -> m.StoreResult:
        msg = m.PageSet(instance_id=self.client.instance_id, keys=keys, block_ids=pack_ids(ids),
                        cache_salt=self.salt, deadline_ms=int((time.time() + 5) * 1000))  # fmt: skip
        return self.call(msg, m.StoreResult)

    def get(self, keys: bytes, ids: list[int]) -> int:
        msg = m.PageGet(instance_id=self.client.instance_id, keys=keys, block_ids=pack_ids(ids),
                        cache_salt=self.salt, deadline_ms=int((time.time() + 5) * 1000))  # fmt: skip
        return int(self.call(msg, m.RetrieveResult).retrieved_tokens) // PS

    def page(self, i: int) -> torch.Tensor:
        return self.buf[:, :, i * PS : (i + 1) * PS].clone()


def test_pages_round_trip_by_key_and_prefix_exists(
    start_daemon: Callable[..., DaemonProcess], new_page: Callable[..., Page]
) -> None:
    d = start_daemon()
    a = new_page(d.endpoint)
    a.buf.copy_(torch.randn(a.buf.shape).to(torch.bfloat16))
    keys = keys_of("p0", "p1", "p2")
    r = a.set(keys, [5, 6, 7])
    assert (r.stored_chunks, r.skipped_chunks, r.failed_chunks, r.stored_tokens) == (3, 0, 0, 3 * PS)
    assert a.set(keys[:32], [5]).skipped_chunks == 1  # present: skipped
    assert a.exists(keys) == 3
    assert a.exists(keys_of("p0", "nope", "p2")) == 1  # the leading run only
    want = [a.page(i) for i in (5, 6, 7)]
    assert a.get(keys + keys_of("missing"), [20, 21, 22, 23]) == 3
    for i, w in zip((20, 21, 22), want, strict=True):
        assert torch.equal(a.page(i).view(torch.int16), w.view(torch.int16))


def test_salts_and_models_never_share_pages(
    start_daemon: Callable[..., DaemonProcess], new_page: Callable[..., Page]
) -> None:
    d = start_daemon()
    a = new_page(d.endpoint, salt="tenant-a")
    a.set(keys_of("x"), [1])
    assert a.exists(keys_of("x")) == 1
    assert new_page(d.endpoint, salt="tenant-b").exists(keys_of("x")) == 0
    assert new_page(d.endpoint, model="other").exists(keys_of("x")) == 0
    other = new_page(d.endpoint, salt="tenant-b")
    assert other.get(keys_of("x"), [3]) == 0


def test_hostile_page_requests_get_typed_errors_and_change_nothing(
    start_daemon: Callable[..., DaemonProcess], new_page: Callable[..., Page]
) -> None:
    d = start_daemon()
    a = new_page(d.endpoint)
    a.set(keys_of("k"), [2])
    iid = a.client.instance_id
    dl = int((time.time() + 5) * 1000)
    cases = {
        "no token": m.PageSet(instance_id=iid, keys=keys_of("z"), block_ids=pack_ids([1]), deadline_ms=dl),
        "stolen id, wrong token": m.PageGet(instance_id=iid, keys=keys_of("k"), block_ids=pack_ids([9]),
                                            token=b"x" * 32, deadline_ms=dl),
        "unknown instance": m.PageExists(instance_id=iid + 1, keys=keys_of("k")),
    }  # fmt: skip
    for what, body in cases.items():
        reply = raw_call(d.endpoint, body)
        assert isinstance(reply, m.Error), what
        assert reply.code in (m.ErrorCode.ACCESS_DENIED, m.ErrorCode.UNKNOWN_INSTANCE), (what, reply)
    token = a.client.session.token
    bad = {
        "malformed keys": m.PageExists(instance_id=iid, keys=b"short", token=token),
        "oversized count": m.PageExists(instance_id=iid, keys=b"\0" * 32 * 5000, token=token),
        "ids out of range": m.PageSet(instance_id=iid, keys=keys_of("o"), block_ids=pack_ids([PAGES]),
                                      token=token, deadline_ms=dl),
        "negative-looking ids": m.PageGet(instance_id=iid, keys=keys_of("k"),
                                          block_ids=pack_ids([2**32 - 1]), token=token, deadline_ms=dl),
        "fewer ids than keys": m.PageSet(instance_id=iid, keys=keys_of("q", "r"), block_ids=pack_ids([1]),
                                         token=token, deadline_ms=dl),
    }  # fmt: skip
    codes = {}
    for what, body in bad.items():
        reply = raw_call(d.endpoint, body)
        assert isinstance(reply, m.Error), (what, reply)
        assert reply.code is not m.ErrorCode.INTERNAL, (what, reply)
        codes[what] = reply.code
    assert codes["oversized count"] is m.ErrorCode.LIMIT
    assert codes["malformed keys"] is m.ErrorCode.CHUNK_MISMATCH
    assert codes["ids out of range"] is m.ErrorCode.BLOCK_ID
    assert a.exists(keys_of("o")) == 0 and a.exists(keys_of("q")) == 0  # nothing was stored
    assert a.exists(keys_of("k")) == 1 and a.get(keys_of("k"), [4]) == 1  # still served
    assert torch.equal(a.page(4).view(torch.int16), a.page(2).view(torch.int16))
    assert d.proc.poll() is None
