"""A hostile decode client (``Retrieve.await_chunks``) against one real daemon with an L2 tier.

The wait a prefill/decode split asks for is the client's to choose: any client may name chunks
that will never arrive and ask the daemon to wait for them up to its bound
(``retrieve_wait_timeout_s``). That must delay only its own reply: every other client's
retrieve, whether its chunks are in L1 or must come up from L2, is served at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.errors import ChunkMismatchError, LimitExceededError
from kvcache.integrations.vllm.disagg import PARAMS_KEY, SplitRequests
from kvcache.integrations.vllm.plan import Admission, Planner, RetrieveSpec
from kvcache.integrations.vllm.stats import ConnectorTally
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import pack_ids
from kvcache.server.keygen import main as keygen
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from tests.helpers import daemon_starter, wait_until

from .conftest import BASE_ARGS, raw_call

TOKENS, BLOCKS = list(range(128)), list(range(32))  # 8 chunks of 16 tokens, 4 blocks each
SECRET = "7a11" + "0" * 28
LONG_MS = 20_000  # a hostile wait: far longer than any honest reply may take


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=32,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    disk = Path(tmp_path_factory.mktemp("l2")) / "tier"
    starter = daemon_starter(BASE_ARGS)
    start = next(starter)
    yield start("--l2-disk-path", str(disk), "--l2-disk-size-gb", "0.1")
    next(starter, None)


def _client(d: DaemonProcess, iid: int, seed: int) -> tuple[KVCacheClient, list[torch.Tensor]]:
    client = KVCacheClient(d.ipc_endpoint, iid, "m", timeout_s=30)
    kv = _cache(seed)
    client.register_kv_caches(kv)
    return client, kv


def test_a_wait_for_chunks_that_never_come_does_not_hold_back_other_retrieves(daemon: DaemonProcess) -> None:
    """The hostile client's wait sits on the daemon's retrieve waiter for its whole bound;
    an honest retrieve that needs that waiter (part of its prompt is cached, the rest may be
    in L2) must not queue behind it."""
    hostile, _ = _client(daemon, 11, 1)
    honest, kv = _client(daemon, 12, 2)
    with hostile, honest:
        mine = [t + 100 for t in TOKENS]
        assert honest.store(mine[:64], BLOCKS[:16]).stored_chunks == 4
        never = [t + 900 for t in TOKENS]  # nobody stores these
        waits = [hostile.retrieve_reply_async(never, BLOCKS, awaited=(8, LONG_MS)) for _ in range(2)]
        wait_until(lambda: honest.status()["in_flight"] == 2, 10, "the daemon to hold both waits")
        assert not any(w.done() for w in waits)
        start = time.monotonic()
        into = BLOCKS[16:] + BLOCKS[:16]  # the cached half lands in blocks 16..31
        got = honest.retrieve_reply_async(mine, into).result(timeout=30)
        took = time.monotonic() - start
        assert got.retrieved_tokens == 64
        assert took < 2.0, f"an honest retrieve waited {took:.1f} s behind another client's wait"
        assert not any(w.done() for w in waits)  # the hostile waits still run to their bound
        assert caches_equal([t[:, 16:] for t in kv], [t[:, :16] for t in kv])
        assert daemon.proc.poll() is None


Kv = list[torch.Tensor]


def _split_pair(d: DaemonProcess, bs: int) -> tuple[KVCacheClient, Kv, KVCacheClient, Kv]:
    """A prefill and a decode instance with ``bs``-token blocks (64 tokens each)."""

    def one(iid: int, seed: int) -> tuple[KVCacheClient, list[torch.Tensor]]:
        client = KVCacheClient(d.ipc_endpoint, iid, "m", timeout_s=30)
        kv = to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=64 // bs,
                                      block_size=bs, num_heads=2, head_size=8, dtype=torch.float16,
                                      seed=seed))  # fmt: skip
        client.register_kv_caches(kv)
        return client, kv

    return (*one(21 + bs, 1), *one(31 + bs, 2))


def _request(req_id: str, prompt: list[int], params: dict[str, Any] | None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=prompt, cache_salt=None, kv_transfer_params=params
    )


def _load(consumer: KVCacheClient, spec: RetrieveSpec) -> None:
    """Run a planned load as the connector's workers do (``worker._retrieve_async``)."""
    reply = consumer.retrieve_reply_async(spec.token_ids, spec.block_ids, spec.skip_tokens,
                                          key_extra=spec.key_extra, awaited=spec.awaited[:2])  # fmt: skip
    reply.result(timeout=10)


@pytest.mark.parametrize("bs", [1, 4])
def test_every_token_a_decode_request_is_promised_holds_its_own_kv(daemon: DaemonProcess, bs: int) -> None:
    """The decode side promises vLLM the tokens its transfer parameters name (whole chunks,
    then the prefill side's tail chunk) and loads them into the blocks vLLM then allocates.
    When the prompt ends on a block boundary vLLM allocates blocks for all but its last token
    (it computes that one), which with one-token blocks is one block short of the tail: the
    padded tail chunk then copied the last tail token's KV into the block of the token
    before it, a block vLLM took as loaded. Every promised token must hold its own KV."""
    cs = 16
    producer, kv_p, consumer, kv_c = _split_pair(daemon, bs)
    with producer, consumer:
        prompt = [t + 7000 + 1000 * bs for t in range(3 * cs + 12)]  # 3 whole chunks, a 12-token tail
        n, whole = len(prompt), 3 * cs
        # The prefill side: its whole chunks, then its tail (disagg.SplitRequests.tail_store).
        p_planner, p_split = Planner(bs, cs), SplitRequests(ConnectorTally())
        p_blocks = list(range(n // bs))
        assert producer.store(prompt[:whole], p_blocks[: whole // bs]).stored_chunks == 3
        tail, secret = p_split.tail_store(p_planner, _request("p", prompt, None), p_blocks, whole, n)
        assert tail == 12
        (spec,) = p_planner.step([])[0].stores
        assert producer.store(spec.token_ids, spec.block_ids, key_extra=spec.key_extra).stored_chunks == 1
        # The decode side, as the connector's scheduler half drives it (get_num_new_matched_tokens,
        # then update_state_after_alloc with the blocks vLLM allocated), its loads as the workers run them.
        c_planner, c_split = Planner(bs, cs), SplitRequests(ConnectorTally())
        c_req = _request("c", prompt, {PARAMS_KEY: {"v": 1, "tokens": whole, "tail": tail, "secret": secret}})
        awaited = c_split.tokens(c_req, n, cs, bs)
        promised = c_planner.external_tokens(n, 0, awaited)
        c_blocks = list(range(-(-promised // bs)))
        got = c_split.get("c")
        first = min(promised, got.whole) if got.tail else promised
        c_planner.on_alloc(
            Admission("c", prompt, c_blocks, 0, first, is_async=True, awaited_tokens=got.whole, wait_ms=1000)
        )
        c_split.tail_load(c_planner, c_req, c_blocks, 0, "", 1000)
        for load in c_planner.step([])[0].retrieves:
            _load(consumer, load)
        assert promised >= whole
        for b, block in enumerate(c_blocks):  # the blocks of the promised tokens
            mine, theirs = [t[:, block] for t in kv_c], [t[:, p_blocks[b]] for t in kv_p]
            assert caches_equal(mine, theirs), f"block {b} ({promised} tokens promised): another block's KV"
        assert daemon.proc.poll() is None


def test_a_tail_its_blocks_cannot_hold_is_refused_and_writes_nothing(daemon: DaemonProcess) -> None:
    """Defence in depth under ``awaited``: blocks short of the tail (fewer than vLLM was told
    to allocate) give a tail load the daemon refuses (a typed error: the workers then have
    vLLM recompute those blocks), never a padded chunk whose last block lands in another's."""
    cs, bs = 16, 1
    producer, _kv_p, consumer, kv_c = _split_pair(daemon, bs)
    with producer, consumer:
        prompt = [t + 9000 for t in range(3 * cs + 12)]
        whole, tail = 3 * cs, 12
        planner, split = Planner(bs, cs), SplitRequests(ConnectorTally())
        req = _request("c", prompt, {PARAMS_KEY: {"v": 1, "tokens": whole, "tail": tail, "secret": SECRET}})
        split.tokens(req, len(prompt) + 1, cs, bs)  # as if one token longer: the tail is awaited
        split.tail_load(planner, req, list(range(whole + tail - 1)), 0, "", 300)  # one block short
        (spec,) = planner.step([])[0].retrieves
        before = clone_caches(kv_c)
        with pytest.raises(ChunkMismatchError, match="block ids"):
            _load(consumer, spec)
        assert caches_equal(kv_c, before) and daemon.proc.poll() is None


def test_one_clients_awaits_are_bounded_and_never_take_another_clients_share(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """Each await holds its request, keys and block ids up to the wait bound whatever
    arrives: a client's awaits hold at most ``--max-awaited-tokens`` token ids at once (past
    it a typed error, nothing held), and that bound is per client, so another tenant's
    decode requests still wait for their chunks and are served."""
    for name in ("daemon", "tenant-a", "tenant-b"):
        assert keygen([name, "--dir", str(tmp_path)]) == 0
    rules = ""
    for name in ("tenant-a", "tenant-b"):
        public = (tmp_path / f"{name}.key").read_text().split('public-key = "')[1].split('"')[0]
        rules += f'[[client]]\nname = "{name}"\npublic_key = "{public}"\n'
    (tmp_path / "clients.toml").write_text(rules)
    d = start_daemon("--curve-secret-key", str(tmp_path / "daemon.key_secret"), "--clients",
                     str(tmp_path / "clients.toml"), "--max-awaited-tokens", "256", tcp=True)  # fmt: skip

    def tenant(name: str, iid: int, seed: int) -> tuple[KVCacheClient, Kv]:
        keys = {"curve_server_key": str(tmp_path / "daemon.key"),
                "curve_secret_key": str(tmp_path / f"{name}.key_secret")}  # fmt: skip
        client = KVCacheClient(d.endpoint, iid, "m", timeout_s=10, **keys)
        kv = _cache(seed)
        client.register_kv_caches(kv)
        return client, kv

    (a, _kv_a), (b, _kv_b) = tenant("tenant-a", 41, 1), tenant("tenant-b", 42, 2)
    with a, b:
        never = [t + 20_000 for t in TOKENS]  # 128 tokens: two awaits fill a's 256
        held = [a.retrieve_reply_async(never, BLOCKS, awaited=(8, 1500)) for _ in range(2)]
        with pytest.raises(LimitExceededError, match="max-awaited-tokens"):
            a.retrieve_reply_async(never, BLOCKS, awaited=(8, 1500)).result(timeout=10)
        assert a.retrieve(never, BLOCKS) == 0  # an ordinary retrieve is not counted
        mine = [t + 30_000 for t in TOKENS]
        waiting = b.retrieve_reply_async(mine, BLOCKS, awaited=(8, 5000))  # b's own share
        assert b.store(mine, BLOCKS).stored_chunks == 8
        assert waiting.result(timeout=10).retrieved_tokens == 128
        assert all(h.result(timeout=10).retrieved_tokens == 0 for h in held)  # their bound passed
        assert a.retrieve_reply_async(never, BLOCKS, awaited=(8, 10)).result(timeout=10)  # freed
        assert d.proc.poll() is None


def test_page_requests_on_a_chunk_instance_are_refused_and_leave_nothing(daemon: DaemonProcess) -> None:
    """The page API (SGLang HiCache: one block per page) named against an instance whose
    chunks span several blocks (a vLLM registration: 4 blocks of 4 tokens per 16-token chunk):
    the copies cannot cover the chunks, so a set is refused with a typed error, no half-written
    page becomes visible, no slot stays pinned, and the instance is still served."""
    client, kv = _client(daemon, 51, 5)
    with client:
        keys, ids = bytes(range(32)) + bytes(range(1, 33)), [3, 9]
        token, dl = client.session.token, int((time.time() + 5) * 1000)
        before = clone_caches(kv)
        put = m.PageSet(instance_id=51, keys=keys, block_ids=pack_ids(ids), token=token, deadline_ms=dl)
        reply = raw_call(daemon.ipc_endpoint, put)
        assert isinstance(reply, m.Error) and reply.code is m.ErrorCode.CHUNK_MISMATCH, reply
        exists = raw_call(daemon.ipc_endpoint, m.PageExists(instance_id=51, keys=keys, token=token))
        assert isinstance(exists, m.PageExistsResult) and exists.hit_pages == 0
        get = m.PageGet(instance_id=51, keys=keys, block_ids=pack_ids(ids), token=token, deadline_ms=dl)
        got = raw_call(daemon.ipc_endpoint, get)
        assert isinstance(got, m.RetrieveResult) and got.retrieved_tokens == 0, got
        assert caches_equal(kv, before)
        assert client.status()["engine"]["l1"]["pinned_chunks"] == 0
        mine = [t + 40_000 for t in TOKENS]
        assert client.store(mine, BLOCKS).stored_chunks == 8 and client.lookup(mine) == 128
        assert daemon.proc.poll() is None
