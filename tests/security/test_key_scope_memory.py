"""What one client's lookups make the daemon keep must stay bounded.

Found by a hostile-client pass: ``InstanceState.hasher`` cached one ``ChunkHasher`` per
``KeyScope`` (up to 4096 per instance), keyed by the scope itself, so the cache kept every
``cache_salt`` and ``key_extra`` string a request carried, whatever its length. Each lookup
naming a new ``key_extra`` of a few MB left that many MB in the daemon for good (up to 4096 of
them per instance, and an instance may have 256 neighbours), until the host's OOM killer ended
the daemon for every engine. The wire bounds a salt now (``records.MAX_NAME``) but not a key
extra (a request with many images has a long one): a scope that long is no longer remembered.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches

from .conftest import raw_call

EXTRA_BYTES = 8 << 20
LOOKUPS = 12  # 96 MB of key_extra in all


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def test_lookups_with_ever_new_key_extras_do_not_grow_the_daemon_without_bound(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon()
    kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                                  block_size=4, num_heads=2, head_size=8, dtype=torch.float16))  # fmt: skip
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=20) as c:
        c.register_kv_caches(kv)
        token = c.session.token
        for i in range(2):  # warm up whatever a first lookup allocates
            raw_call(d.endpoint, m.Lookup(instance_id=1, token=token, token_ids=pack_ids(range(16)),
                                          key_extra=f"warm{i}"))  # fmt: skip
        before = _rss_mb(d.pid)
        for i in range(LOOKUPS):
            extra = f"{i}:" + "x" * EXTRA_BYTES
            reply = raw_call(d.endpoint, m.Lookup(instance_id=1, token=token,
                                                  token_ids=pack_ids(range(16)), key_extra=extra),
                             timeout_ms=20_000)  # fmt: skip
            assert isinstance(reply, m.LookupResult), reply
        grown = _rss_mb(d.pid) - before
        assert d.proc.poll() is None
        assert c.ping()
    assert grown < 64, (
        f"the daemon grew by {grown} MB after {LOOKUPS} lookups with a new {EXTRA_BYTES >> 20} MB "
        "key_extra each: it keeps every scope string a client sends"
    )
