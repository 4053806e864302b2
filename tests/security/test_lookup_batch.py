"""``LookupBatch`` from a hostile client, against a real daemon process.

Every byte of the batch is the client's: the item count, each item's ids, salt and key
extra, the instance and token it names. Each test sends one malformed or forbidden batch and
checks three things: a typed error comes back, nothing was looked up (the lookup counter moves
only by the valid lookup sent after it, which the dispatcher counts after anything earlier),
and the daemon still serves.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import AccessDeniedError, LimitExceededError
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, pack_ids
from kvcache.server.keygen import main as keygen
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches
from tests.server.helpers import scrape

from .conftest import raw_call

TOKENS, BLOCKS = list(range(64)), list(range(16))
MAX_IDS = 4096


def _cache() -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=16,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=0)  # fmt: skip
    return to_shared(kv)


def _lookups(d: DaemonProcess) -> float:
    text = scrape(d.metrics_url)
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvcache_lookup_requests_total{")
    )


def _counted(d: DaemonProcess, want: float) -> None:
    deadline = time.monotonic() + 20
    while _lookups(d) < want:
        assert time.monotonic() < deadline, f"lookup counter stuck at {_lookups(d)}, want {want}"
        time.sleep(0.02)
    assert _lookups(d) == want


def _item(tokens: list[int] | None = None, salt: str = "", **kw: str) -> m.LookupItem:
    return m.LookupItem(token_ids=pack_ids(TOKENS if tokens is None else tokens), cache_salt=salt, **kw)


@pytest.fixture
def daemon(start_daemon: Callable[..., DaemonProcess]) -> DaemonProcess:
    return start_daemon("--max-ids", str(MAX_IDS))


@pytest.fixture
def client(daemon: DaemonProcess) -> Iterator[KVCacheClient]:
    with KVCacheClient(daemon.ipc_endpoint, 1, "m", timeout_s=5) as c:
        c.register_kv_caches(_cache())
        assert c.store(TOKENS, BLOCKS).stored_tokens == 64
        yield c


def _still_serves_and_looked_up_nothing(d: DaemonProcess, c: KVCacheClient, before: float) -> None:
    assert c.lookup(TOKENS) == 64  # the one lookup the counter may gain
    _counted(d, before + 1)
    assert d.proc.poll() is None


def _raw_frame(endpoint: str, frame: bytes) -> m.ReplyBody:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(frame)
        assert sock.poll(5000), "no reply from the daemon"
        return decode_reply(sock.recv()).body
    finally:
        sock.close()


def test_a_batch_over_the_count_cap_or_empty_is_refused_before_any_lookup(
    daemon: DaemonProcess, client: KVCacheClient
) -> None:
    before = _lookups(daemon)
    too_many = m.LookupBatch(instance_id=1, items=[_item()] * (m.MAX_LOOKUP_BATCH + 1))
    reply = raw_call(daemon.ipc_endpoint, too_many)
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_MESSAGE
    assert "length <= 256" in reply.message
    empty = m.LookupBatch(instance_id=1, items=[])
    reply = raw_call(daemon.ipc_endpoint, empty)
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_MESSAGE
    _still_serves_and_looked_up_nothing(daemon, client, before)


def test_one_item_over_max_ids_refuses_the_whole_batch(daemon: DaemonProcess, client: KVCacheClient) -> None:
    before = _lookups(daemon)
    with pytest.raises(LimitExceededError, match="--max-ids"):
        client.lookup_batch([_item(), _item(list(range(MAX_IDS + 1)))])
    _still_serves_and_looked_up_nothing(daemon, client, before)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(m.LookupItem(token_ids=m.IdArray(b"\x01\x02\x03", 4)), id="ragged_ids"),
        pytest.param(_item(salt="a\x1fb"), id="separator_in_salt"),
        pytest.param(_item(key_extra="x\x1f"), id="separator_in_key_extra"),
    ],
)
def test_a_malformed_item_refuses_the_whole_batch(
    daemon: DaemonProcess, client: KVCacheClient, bad: m.LookupItem
) -> None:
    before = _lookups(daemon)
    reply = raw_call(daemon.ipc_endpoint, m.LookupBatch(instance_id=1, items=[_item(), bad]))
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_REQUEST, reply
    _still_serves_and_looked_up_nothing(daemon, client, before)


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"op": "lookup_batch", "instance_id": 1, "items": [1, 2, 3]}, id="items_not_structs"),
        pytest.param({"op": "lookup_batch", "instance_id": 1, "items": {"a": 1}}, id="items_not_a_list"),
        pytest.param({"op": "lookup_batch", "instance_id": -1, "items": []}, id="negative_instance"),
        pytest.param(
            {"op": "lookup_batch", "instance_id": 1, "items": [{"token_ids": [b"", 3]}]}, id="bad_width"
        ),
    ],
)
def test_undecodable_batches_get_bad_message(
    daemon: DaemonProcess, client: KVCacheClient, body: dict[str, object]
) -> None:
    before = _lookups(daemon)
    frame = msgspec.msgpack.encode({"v": m.PROTOCOL_VERSION, "id": 9, "body": body})
    reply = _raw_frame(daemon.ipc_endpoint, frame)
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_MESSAGE, reply
    _still_serves_and_looked_up_nothing(daemon, client, before)


def test_another_clients_instance_is_refused(daemon: DaemonProcess, client: KVCacheClient) -> None:
    before = _lookups(daemon)
    # A raw client that never registered names instance 1 with a made-up token.
    forged = m.LookupBatch(instance_id=1, items=[_item()], token=b"\x00" * 32)
    reply = raw_call(daemon.ipc_endpoint, forged)
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.ACCESS_DENIED, reply
    unknown = m.LookupBatch(instance_id=999, items=[_item()])
    reply = raw_call(daemon.ipc_endpoint, unknown)
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.UNKNOWN_INSTANCE, reply
    _still_serves_and_looked_up_nothing(daemon, client, before)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    for name in ("daemon", "tenant-a"):
        assert keygen([name, "--dir", str(tmp_path)]) == 0
    public = (tmp_path / "tenant-a.key").read_text().split('public-key = "')[1].split('"')[0]
    (tmp_path / "clients.toml").write_text(
        f'[[client]]\nname = "tenant-a"\npublic_key = "{public}"\nmodels = ["model-a"]\ncache_salts = ["a"]\n'
    )
    return tmp_path


def test_a_tenant_cannot_batch_a_lookup_in_another_tenants_salt(
    start_daemon: Callable[..., DaemonProcess], keys: Path
) -> None:
    d = start_daemon("--curve-secret-key", str(keys / "daemon.key_secret"),
                     "--clients", str(keys / "clients.toml"), tcp=True)  # fmt: skip
    with KVCacheClient(d.endpoint, 1, "model-a", timeout_s=5,
                       curve_server_key=str(keys / "daemon.key"),
                       curve_secret_key=str(keys / "tenant-a.key_secret")) as a:  # fmt: skip
        a.register_kv_caches(_cache())
        assert a.store(TOKENS, BLOCKS, cache_salt="a").stored_tokens == 64
        before = _lookups(d)
        for other in ("b", ""):  # another tenant's namespace, and the unsalted one
            with pytest.raises(AccessDeniedError, match="cache salt"):
                a.lookup_batch([_item(salt="a"), _item(salt=other)])
        hits = a.lookup_batch([_item(salt="a"), _item(TOKENS[:32], salt="a")])
        assert [h.hit_tokens for h in hits] == [64, 32]
        _counted(d, before + 2)  # only the two lookups of the allowed batch
        assert d.proc.poll() is None


def _headed(tokens: list[int], head: int, width: int = 4) -> m.LookupItem:
    """An item whose first ``head`` ids are the item before's, sent without them."""
    tail = tokens[head:]
    data = b"".join(t.to_bytes(width, "little") for t in tail)
    return m.LookupItem(token_ids=m.IdArray(data, width), head=head)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "items",
    [
        pytest.param([_headed(TOKENS, 16)], id="head_on_the_first_item"),
        pytest.param([_item(TOKENS[:32]), _headed(TOKENS, 33)], id="head_past_the_item_before"),
        pytest.param([_item(), _headed(TOKENS, 16, width=8)], id="head_of_another_width"),
    ],
)
def test_a_head_that_names_ids_the_batch_never_sent_refuses_it(
    daemon: DaemonProcess, client: KVCacheClient, items: list[m.LookupItem]
) -> None:
    before = _lookups(daemon)
    reply = raw_call(daemon.ipc_endpoint, m.LookupBatch(instance_id=1, items=items))
    assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.BAD_REQUEST, reply
    assert "head" in reply.message
    _still_serves_and_looked_up_nothing(daemon, client, before)


def test_heads_cannot_make_a_small_batch_hold_more_ids_than_max_ids(
    daemon: DaemonProcess, client: KVCacheClient
) -> None:
    """256 items that each repeat the whole item before (a few bytes each on the wire) would
    have the daemon build and hash 256 x MAX_IDS ids: refused before any is built, as an item
    over ``--max-ids`` is."""
    before = _lookups(daemon)
    full = list(range(MAX_IDS))
    items = [_item(full)] + [_headed(full, MAX_IDS)] * (m.MAX_LOOKUP_BATCH - 1)
    with pytest.raises(LimitExceededError, match="--max-ids"):
        client.lookup_batch(items)
    longer = [_item(full), m.LookupItem(token_ids=pack_ids([1]), head=MAX_IDS)]  # one item past it
    with pytest.raises(LimitExceededError, match="--max-ids"):
        client.lookup_batch(longer)
    _still_serves_and_looked_up_nothing(daemon, client, before)
