"""One principal's flood never holds another principal's requests: against a real daemon.

The daemon is shared by tenants; each is a principal (the daemon's own user on the Unix
socket, plain loopback TCP, a listed CURVE client). Before the fair share, one tenant that
pipelined 15,000 retrieves awaiting a chunk nobody stores made another tenant's L1-hit
retrieve take 7.7 s (4 ms without the flood; 10 s and a timeout in the issue's runs), and
its own awaits were answered 10 s past their bound: the worker lanes were one FIFO, and
every wake-up looked at every waiting retrieve. The victim here asserts an order, not a
speed: its retrieves are all answered while every one of the attacker's awaits is still
held (they end at their bound, seconds later), and the awaits past the attacker's count
bound are refused at once, typed, and counted under its principal.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import zmq

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from tests.security.principals import victim_and_attacker
from tests.server.helpers import scrape

TOKENS, BLOCKS = list(range(128)), list(range(32))  # 8 chunks of 16 tokens
AWAITING = 1000  # --max-awaiting-retrieves for the test
FLOOD = 3000  # the attacker's pipelined awaits: AWAITING held, the rest refused
AWAIT_MS = 6000
CHUNK_BYTES = 2 * 2 * 16 * 2 * 8 * 2  # K and V x layers x tokens x heads x head size x fp16
LATE_S = 5.0  # how far past its bound an await may be answered on a loaded CI machine


def _kv(seed: int) -> list[torch.Tensor]:
    return to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=32,
                                    block_size=4, num_heads=2, head_size=8, dtype=torch.float16,
                                    seed=seed))  # fmt: skip


def test_an_await_flood_never_holds_another_principals_l1_hits_and_ends_at_its_bound(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--max-awaiting-retrieves", str(AWAITING), tcp=True)
    victim, attacker = victim_and_attacker(d)
    with victim, attacker:
        kv_victim = _kv(1)
        victim.register_kv_caches(kv_victim)
        attacker.register_kv_caches(_kv(2))
        assert victim.store(TOKENS, BLOCKS).stored_chunks == 8
        held = m.Retrieve(instance_id=2, token_ids=pack_ids([t + 9000 for t in TOKENS]),
                          block_ids=pack_ids(BLOCKS), token=attacker.session.token,
                          await_chunks=1, await_ms=AWAIT_MS)  # fmt: skip
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(d.endpoint)
        try:
            sent_at = time.monotonic()
            for i in range(FLOOD):
                sock.send(encode_request(i, held))
            refused, answered, late = 0, 0, 0.0
            while refused < FLOOD - AWAITING:  # past the count bound: LIMIT at once
                assert sock.poll(30_000), f"only {refused} awaits refused"
                reply = decode_reply(sock.recv())
                assert isinstance(reply.body, m.Error), f"an await answered before its bound: {reply.body}"
                assert reply.body.code is m.ErrorCode.LIMIT
                assert "--max-awaiting-retrieves" in reply.body.message
                refused += 1
            # Every held await still waits (its bound is seconds away): the victim's L1 hits
            # must all be answered before any of them.
            for _ in range(20):
                assert victim.retrieve(TOKENS, BLOCKS) == 128
            assert not sock.poll(0), "an attacker's await was answered before the victim's hits"
            while answered < AWAITING:
                assert sock.poll(30_000), f"{answered} of {AWAITING} held awaits answered"
                reply = decode_reply(sock.recv())
                assert isinstance(reply.body, m.RetrieveResult) and reply.body.retrieved_tokens == 0
                answered += 1
                late = max(late, time.monotonic() - sent_at - AWAIT_MS / 1000)
            assert late < LATE_S, f"the last await was answered {late:.1f} s past its bound"
        finally:
            sock.close()
        # The refusals are counted under the attacker's principal, with the bound's flag.
        refusals = [
            line
            for line in scrape(d.metrics_url).splitlines()
            if line.startswith("kvcache_requests_refused_total{")
        ]
        assert len(refusals) == 1, refusals
        assert 'limit="--max-awaiting-retrieves"' in refusals[0]
        assert float(refusals[0].rsplit(" ", 1)[1]) == FLOOD - AWAITING
        # Its awaits all answered, the attacker's budget is whole again.
        assert victim.retrieve(TOKENS, BLOCKS) == 128


def test_a_store_flood_never_evicts_another_principals_share_of_l1(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    """L1 is one pool: under one eviction order for all, a tenant storing fresh prompts as fast
    as it can pushed every other tenant's prefixes out, and their hits became misses (the
    victim's 8 chunks were gone after a flood of 20 times L1). Room is now taken from the
    tenant holding the most, so a victim within its equal share keeps every chunk, while the
    attacker's own stores go on (each evicting its older ones)."""
    # L1 of about 48 chunks of 2 KiB (the extent bound lets it grow in quarters)
    d = start_daemon("--l1-size-gb", str(96 * 1024 / 2**30), tcp=True)
    victim, attacker = victim_and_attacker(d)
    with victim, attacker:
        victim.register_kv_caches(_kv(1))
        attacker.register_kv_caches(_kv(2))
        assert victim.store(TOKENS, BLOCKS).stored_chunks == 8
        capacity = victim.status()["engine"]["l1"]["capacity_bytes"]
        prompts = [[10_000 * (i + 1) + t for t in TOKENS] for i in range(120)]  # 20x L1
        pending = [attacker.store_async(p, BLOCKS) for p in prompts]
        stored = sum(f.result(60).stored_chunks for f in pending)
        assert stored >= 8 * 20  # the flood's own stores go on (3x L1), evicting its own
        held = victim.status()["engine"]["l1"]["tenant_bytes"]
        assert victim.lookup(TOKENS) == len(TOKENS), f"the flood evicted the victim's chunks: {held}"
        assert victim.retrieve(TOKENS, BLOCKS) == len(TOKENS)
        assert attacker.lookup(prompts[-1]) == len(TOKENS)  # its newest prompt is held
        held = victim.status()["engine"]["l1"]["tenant_bytes"]
        assert set(held) == {"loopback", f"uid:{os.getuid()}"}
        assert held[f"uid:{os.getuid()}"] == 8 * CHUNK_BYTES  # the victim's 8, whole
        assert held["loopback"] <= capacity - 8 * CHUNK_BYTES  # the attacker holds the rest


def _drained(c: KVCacheClient, timeout_s: float = 60) -> dict[str, Any]:
    """The disk tier's status once no write to it is in flight (the daemon has no flush to
    ask for: its status is read until the queue is empty)."""
    deadline = time.monotonic() + timeout_s
    while True:
        (disk,) = c.status()["engine"]["l2"]
        if disk["inflight"]["store"] == 0:
            return disk
        assert time.monotonic() < deadline, "the disk tier's writes did not drain"
        time.sleep(0.01)


def test_a_store_flood_never_evicts_another_principals_share_of_the_disk_tier(
    start_daemon: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """The disk tier had one eviction order for all: a tenant storing 24 times the tier
    evicted every other tenant's chunk files first (the oldest), and the victim's prompt,
    gone from L1 too, was a miss. Room is now taken from the tenant holding the most of the
    tier, so a victim within its equal share keeps every file, and what L1 no longer holds of
    its prompts is still served, from disk."""
    # L1 of 24 chunks of 2 KiB; the disk tier of about 40 chunk files (each a little over 2 KiB)
    d = start_daemon("--l1-size-gb", str(48 * 1024 / 2**30), "--l2-disk-path", str(tmp_path / "tier"),
                     "--l2-disk-size-gb", str(96 * 1024 / 2**30), tcp=True)  # fmt: skip
    victim, attacker = victim_and_attacker(d)
    me, older, newer = f"uid:{os.getuid()}", TOKENS, [t + 5_000 for t in TOKENS]
    with victim, attacker:
        kv_victim = _kv(1)
        want = clone_caches(kv_victim)
        victim.register_kv_caches(kv_victim)
        attacker.register_kv_caches(_kv(2))
        assert victim.store(older, BLOCKS).stored_chunks == victim.store(newer, BLOCKS).stored_chunks == 8
        disk = _drained(victim)
        assert disk["num_chunks"] == 16
        mine = disk["used_bytes"]  # its 16 files: within an equal share of the tier
        prompts = [[10_000 * (i + 1) + t for t in TOKENS] for i in range(120)]  # 960 chunks
        pending = [attacker.store_async(p, BLOCKS) for p in prompts]
        assert sum(f.result(60).stored_chunks for f in pending) >= 8 * 60
        disk = _drained(victim)
        assert disk["stores"] - 16 > 10 * disk["num_chunks"]  # the flood wrote over 10x the tier
        # L1 keeps the victim's share only: its older prompt's head left it, and comes from disk
        hit = victim.lookup_tiers(older)
        assert (hit.hit_tokens, hit.l2_hit_tokens > 0) == (len(TOKENS), True), "the flood evicted its files"
        for t in kv_victim:
            t.zero_()
        assert victim.retrieve(older, BLOCKS) == len(TOKENS) and caches_equal(kv_victim, want)
        disk = _drained(victim)
        assert set(disk["tenant_bytes"]) == {me, "loopback"}
        assert disk["tenant_bytes"][me] == mine  # all 16 of its files
        assert attacker.lookup(prompts[-1]) == len(TOKENS)  # the flood's newest prompt is held
        # Only the operator sees the tiers' fill: another principal sees no L1 or L2 usage.
        assert set(attacker.status()["engine"]) == {"chunk_size", "instances"}
