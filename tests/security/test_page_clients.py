"""Hostile SGLang page clients (``PageExists`` / ``PageSet`` / ``PageGet``) against a real daemon.

Beyond ``tests/server/test_pages.py`` (tokens, malformed and oversized key lists, ids out of a
pool): a tenant naming another tenant's pages (its salt, its instance), page and id counts that
do not match, and a host pool that shrinks (truncated under the daemon, claimed smaller by
another client, or registered again smaller by its own). Each gets a typed error, changes
nothing, and the honest client is still served.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvcache.errors import AccessDeniedError, BlockIdError
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.keygen import main as keygen
from kvcache.server.launch import DaemonProcess
from kvcache.transport import memfd
from tests.security.conftest import raw_call
from tests.server import test_pages
from tests.server.test_pages import PAGES, Page, keys_of

new_page = test_pages.new_page  # the fixture: each test's page clients closed at its end


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def _filled(page: Page, seed: int) -> Page:
    g = torch.Generator().manual_seed(seed)
    page.buf.copy_(torch.randn(page.buf.shape, generator=g).to(torch.bfloat16))
    return page


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    """CURVE keys for the daemon and two tenants, each held to its own model and salt."""
    for name in ("daemon", "tenant-a", "tenant-b"):
        assert keygen([name, "--dir", str(tmp_path)]) == 0
    rules = ""
    for name, salt in (("tenant-a", "a"), ("tenant-b", "b")):
        public = (tmp_path / f"{name}.key").read_text().split('public-key = "')[1].split('"')[0]
        rules += f'[[client]]\nname = "{name}"\npublic_key = "{public}"\n'
        rules += f'models = ["m"]\ncache_salts = ["{salt}"]\n'
    (tmp_path / "clients.toml").write_text(rules)
    return tmp_path


def test_a_tenant_naming_another_tenants_pages_is_refused(
    start_daemon: Callable[..., DaemonProcess], tenants: Path, new_page: Callable[..., Page]
) -> None:
    d = start_daemon("--curve-secret-key", str(tenants / "daemon.key_secret"),
                     "--clients", str(tenants / "clients.toml"), tcp=True)  # fmt: skip

    def tenant(name: str, salt: str) -> Page:
        return new_page(d.endpoint, salt=salt, curve_server_key=str(tenants / "daemon.key"),
                    curve_secret_key=str(tenants / f"{name}.key_secret"))  # fmt: skip

    a, b = _filled(tenant("tenant-a", "a"), 1), _filled(tenant("tenant-b", "b"), 2)
    assert a.set(keys_of("secret0", "secret1"), [3, 4]).stored_chunks == 2
    b_before = b.buf.clone()
    b.salt = "a"  # b names a's pages under a's salt: every page request is refused
    for op in (lambda: b.exists(keys_of("secret0")), lambda: b.get(keys_of("secret0"), [7]),
               lambda: b.set(keys_of("planted"), [1])):  # fmt: skip
        with pytest.raises(AccessDeniedError, match="cache salt"):
            op()
    b.salt = "b"
    # a's instance id with b's own token (b's connection): refused before any key is looked at
    dl = int((time.time() + 5) * 1000)
    steal = m.PageGet(instance_id=a.client.instance_id, keys=keys_of("secret0"), block_ids=pack_ids([7]),
                      token=b.client.session.token, cache_salt="a", deadline_ms=dl)  # fmt: skip
    with pytest.raises(AccessDeniedError):
        b.call(steal, m.RetrieveResult)
    assert _same(b.buf, b_before)  # nothing landed in b's pool
    assert b.exists(keys_of("secret0")) == 0  # under its own salt, a's pages do not exist
    assert a.exists(keys_of("planted")) == 0 and a.exists(keys_of("secret0", "secret1")) == 2
    assert a.get(keys_of("secret0", "secret1"), [10, 11]) == 2  # a is still served, bytes intact
    assert _same(a.page(10), a.page(3)) and _same(a.page(11), a.page(4))
    assert d.proc.poll() is None


def test_page_and_id_counts_that_do_not_match_are_refused(
    start_daemon: Callable[..., DaemonProcess], new_page: Callable[..., Page]
) -> None:
    d = start_daemon("--max-ids", "64")
    a = _filled(new_page(d.endpoint), 3)
    a.set(keys_of("k"), [2])
    iid, token = a.client.instance_id, a.client.session.token
    dl = int((time.time() + 5) * 1000)
    C = m.ErrorCode

    def get(keys: bytes, ids: list[int]) -> m.PageGet:
        return m.PageGet(instance_id=iid, keys=keys, block_ids=pack_ids(ids), token=token, deadline_ms=dl)

    def put(keys: bytes, ids: list[int]) -> m.PageSet:
        return m.PageSet(instance_id=iid, keys=keys, block_ids=pack_ids(ids), token=token, deadline_ms=dl)

    bad = {
        "more ids than keys": (get(keys_of("k"), [5, 6]), C.CHUNK_MISMATCH),
        "ids but no keys": (put(b"", [5]), C.CHUNK_MISMATCH),
        "keys one past the id limit": (put(b"\1" * 32 * 65, list(range(1, 66))), C.LIMIT),
        "ids past the id limit": (get(keys_of("k"), list(range(65))), C.LIMIT),
        "one id past the pool": (get(keys_of("k", "k"), [1, PAGES]), C.BLOCK_ID),
    }
    before = a.buf.clone()
    for what, (body, code) in bad.items():
        reply = raw_call(d.endpoint, body)
        assert isinstance(reply, m.Error) and reply.code is code, (what, reply)
    assert _same(a.buf, before)  # no page was copied in, not even the valid first one
    assert a.exists(b"\1" * 32) == 0  # nothing stored
    assert a.get(keys_of("k"), [9]) == 1 and _same(a.page(9), a.page(2))
    assert d.proc.poll() is None


def test_a_host_pool_that_shrinks_is_refused_and_its_pages_survive(
    start_daemon: Callable[..., DaemonProcess], new_page: Callable[..., Page]
) -> None:
    d = start_daemon()
    a = _filled(new_page(d.endpoint), 4)
    other = _filled(new_page(d.endpoint, model="other"), 5)
    assert a.set(keys_of("p0", "p1"), [30, 31]).stored_chunks == 2
    want = [a.page(30), a.page(31)]
    # 1. Truncating the registered memory under the daemon: the memfd is sealed against it.
    _, fds = memfd.export_cpu_tensors([a.buf])
    for fd in fds:
        for size in (0, os.fstat(fd).st_size // 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    assert a.get(keys_of("p0"), [5]) == 1 and _same(a.page(5), want[0])
    # 2. Another client claiming a's instance id with a smaller pool: refused, nothing changes.
    with pytest.raises(AccessDeniedError, match="another live client"):
        new_page(d.endpoint, pages=4, instance_id=a.client.instance_id)
    assert a.get(keys_of("p1"), [29]) == 1 and _same(a.page(29), want[1])  # the full pool still works
    # 3. a registers again, smaller (the same client replaces its registration): the old host
    # indices are out of range now, and the pages it stored survive into the smaller pool.
    a.register(4)
    with pytest.raises(BlockIdError):
        a.get(keys_of("p0"), [30])
    with pytest.raises(BlockIdError):
        a.set(keys_of("p9"), [4])
    assert a.exists(keys_of("p9")) == 0
    assert a.get(keys_of("p0", "p1"), [0, 3]) == 2  # the pages survive into the smaller pool
    assert _same(a.page(0), want[0]) and _same(a.page(3), want[1])
    assert other.set(keys_of("o"), [1]).stored_chunks == 1 and other.get(keys_of("o"), [2]) == 1
    assert d.proc.poll() is None
