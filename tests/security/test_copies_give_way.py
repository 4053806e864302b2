"""A store flood's copies give way to another principal's work: against a real daemon.

The lanes decide which request starts, but once a flood's copies run, the kernel shares the
core between their copy thread and every thread serving another tenant; a CPU copy runs
native code without the interpreter lock, for a whole time slice each time. On the noisy
bench that took the victim's L1-hit p99 to 2.5x to 3.9x. So while a principal copies more
than another active one, its pieces are copied by a native thread in ``SCHED_IDLE``
(``transfer/lowered.py``, ``server/copy_share.py``), and at normal priority when it is alone.

What the test reads is the kernel's own account: the CPU time of the daemon's threads in
``SCHED_IDLE`` (only the lowered copy threads are, and one exists only once a copy gave
way). Alone, a flood's copies take none of it; beside an active victim, they do. Latency
itself is the bench's to measure, not a test's.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import pytest
import torch
import zmq

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.protocol import messages as m
from kvcache.protocol.codec import decode_reply, encode_request, pack_ids
from kvcache.server.launch import DaemonProcess
from kvcache.testing import make_kv_caches
from tests.security.principals import victim_and_attacker

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling classes")

BLOCK, CHUNK = 16, 256
STORES = 300  # the attacker's pipelined stores per phase, four chunks of 256 KiB each


def _kv(seed: int) -> list[torch.Tensor]:
    return to_shared(make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=4, num_blocks=64,
                                    block_size=BLOCK, num_heads=2, head_size=32, dtype=torch.float16,
                                    seed=seed))  # fmt: skip


def _idle_cpu_ms(pid: int) -> float:
    """CPU time (ms, the scheduler's own nanosecond count) of the daemon's threads in
    SCHED_IDLE, each of which must be a lowered copier (named ``kvcache-lowered``)."""
    return sum(_idle_threads(pid).values()) / 1e6


def _idle_threads(pid: int) -> dict[int, int]:
    """The daemon's threads in SCHED_IDLE (each a cache's lowered copier, made the first time
    one of its copies gave way), with the CPU time each used (ns)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            if os.sched_getscheduler(int(tid)) != os.SCHED_IDLE:
                continue
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                assert f.read().strip() == "kvcache-lowered", "a daemon thread other than a copier is lowered"
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError):  # the thread left meanwhile
            continue
    return out


def _flood(endpoint: str, client: KVCacheClient, base: int) -> None:
    """``STORES`` pipelined stores of fresh one-chunk prompts; returns once all are answered."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for i in range(STORES):
            tokens = pack_ids(list(range(base + i * 4 * CHUNK, base + (i + 1) * 4 * CHUNK)))
            blocks = pack_ids(list(range(4 * CHUNK // BLOCK)))
            body = m.Store(instance_id=2, token_ids=tokens, block_ids=blocks, token=client.session.token)
            sock.send(encode_request(i, body))
        for _ in range(STORES):
            assert sock.poll(60_000), "the daemon stopped answering the flood"
            reply = decode_reply(sock.recv())
            assert not isinstance(reply.body, m.Error) or reply.body.code is m.ErrorCode.LIMIT, reply.body
    finally:
        sock.close()


def test_a_store_flood_copies_at_the_lowest_priority_only_while_another_principal_is_active(
    start_daemon: Callable[..., DaemonProcess],
) -> None:
    d = start_daemon("--chunk-size", str(CHUNK), tcp=True)
    victim, attacker = victim_and_attacker(d)
    with victim, attacker:
        attacker.register_kv_caches(_kv(2))
        before = _idle_cpu_ms(d.pid)
        _flood(d.endpoint, attacker, 0)  # alone: no other principal has sent anything yet
        alone = _idle_cpu_ms(d.pid) - before

        victim.register_kv_caches(_kv(1))
        held = list(range(10**8, 10**8 + 2 * CHUNK))
        assert victim.store(held, list(range(2 * CHUNK // BLOCK))).stored_chunks == 2

        stop = threading.Event()
        rounds = [0]

        def busy_victim() -> None:  # keeps its principal active, and the least served
            while not stop.is_set():
                got = victim.retrieve(held, list(range(32, 32 + 2 * CHUNK // BLOCK)))
                rounds[0] += got == 2 * CHUNK  # an L1 hit, whole

        loop = threading.Thread(target=busy_victim)
        loop.start()
        try:
            before = _idle_cpu_ms(d.pid)
            _flood(d.endpoint, attacker, 10**7)
            beside = _idle_cpu_ms(d.pid) - before
        finally:
            stop.set()
            loop.join(30)
        lowered = len(_idle_threads(d.pid))  # while both caches (and their copiers) still exist
    assert rounds[0] > 0
    # Only the flood's cache gave way: the victim, served first while the flood's requests wait
    # on the lanes, never did (its cache would have a lowered copier of its own).
    assert lowered == 1, f"the victim's copies gave way to the flood ({lowered} lowered copiers)"
    # Alone, no copy gave way: no lowered thread exists yet. Beside the victim, they copy.
    assert alone == 0, f"the flood alone gave way: {alone:.2f} ms of CPU in SCHED_IDLE"
    assert beside > 5, f"the flood beside an active victim did not give way: {beside:.2f} ms in SCHED_IDLE"
