"""A Redis L2 shared with someone else, against real daemons and a real ``redis-server``.

The door: every daemon that can write to the Redis (another operator's daemon, a tenant given
Redis credentials for its own daemon) can ``SET`` a record under any name. Chunk keys are
derived from public facts (model name, salt, tokens, geometry), so an attacker who knows a
victim's prompt (a shared system prompt, say) writes records under exactly the names the victim
will read. Before records were authenticated the victim served the attacker's bytes as its
KV: here a second daemon stores the same prompt with other KV, and the victim, restarted with
an empty L1, retrieved the attacker's bytes.

Now a daemon with ``--l2-redis-auth-key-file`` seals each record (HMAC-SHA256 over the Redis
key and the record) and serves only records sealed with its key: the attacker's record is a
miss, counted as ``kvcache_l2_load_failures_total{reason="forged"}`` and deleted, and the
victim's own records still come back after a restart. ``--l2-redis-trust-all`` keeps the old
trust (the control: there the attacker's bytes are served, so this test can fail).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.server.launch import DaemonProcess
from kvcache.testing import caches_equal, clone_caches, make_kv_caches
from kvcache.testing.redis_local import LocalRedis
from tests.server.helpers import scrape

BS, CS, CHUNKS = 4, 16, 2  # chunk size 16 is the suite's (conftest BASE_ARGS)
BLOCKS = list(range(CHUNKS * CS // BS))
OURS = [7_000 + t for t in range(CHUNKS * CS)]  # stored by the victim only
SHARED = [9_000 + t for t in range(CHUNKS * CS)]  # the prompt both store: the attacker last


@pytest.fixture
def redis_server() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


def _cache(seed: int) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=len(BLOCKS),
                        block_size=BS, num_heads=2, head_size=8, dtype=torch.float16,
                        seed=seed)  # fmt: skip
    assert isinstance(kv, list)
    return to_shared(kv)


def _key_file(tmp_path: Path, name: str, secret: str) -> str:
    path = tmp_path / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return str(path)


def _drained(c: KVCacheClient, timeout_s: float = 30) -> None:
    """Wait until the daemon's write-through queue is empty (status, not a flush)."""
    deadline = time.monotonic() + timeout_s
    while not all(t["inflight"]["store"] == 0 for t in c.status()["engine"]["l2"]):
        assert time.monotonic() < deadline, "L2 writes did not drain"
        time.sleep(0.01)


def _store(d: DaemonProcess, kv: list[torch.Tensor], *prompts: list[int]) -> None:
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=30) as c:
        c.register_kv_caches(kv)
        for prompt in prompts:
            r = c.store(prompt, BLOCKS)
            assert r.stored_chunks == CHUNKS and r.failed_chunks == 0, r
        _drained(c)


def _forged_loads(d: DaemonProcess) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in scrape(d.metrics_url).splitlines()
        if line.startswith("kvcache_l2_load_failures_total{") and 'reason="forged"' in line
    )


def _victim_and_attacker(
    start_daemon: Callable[..., DaemonProcess],
    redis_server: LocalRedis,
    victim_args: list[str],
    attacker_args: list[str],
) -> tuple[DaemonProcess, list[torch.Tensor], list[torch.Tensor]]:
    """The victim stores OURS and SHARED, the attacker (another daemon on the same Redis)
    stores SHARED with its own KV, then the victim restarts (empty L1): the restarted victim,
    its KV and the attacker's."""
    redis = ["--l2-redis-url", redis_server.url]
    ours, theirs = _cache(seed=1), _cache(seed=2)
    victim = start_daemon(*redis, *victim_args)
    _store(victim, to_shared(clone_caches(ours)), OURS, SHARED)
    victim.kill()
    attacker = start_daemon(*redis, *attacker_args)
    _store(attacker, to_shared(clone_caches(theirs)), SHARED)
    attacker.kill()
    return start_daemon(*redis, *victim_args), ours, theirs


def _sealed(d: DaemonProcess) -> bool:
    """Whether the daemon's Redis tier says it seals its records (``status``)."""
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=30) as c:
        (tier,) = c.status()["engine"]["l2"]
    return bool(tier["records_sealed"])


def _retrieve(d: DaemonProcess, prompt: list[int]) -> tuple[int, list[torch.Tensor]]:
    kv = _cache(seed=3)
    for t in kv:
        t.zero_()
    with KVCacheClient(d.endpoint, 1, "m", timeout_s=30) as c:
        c.register_kv_caches(kv)
        got = c.retrieve(prompt, BLOCKS)
    return got, kv


def test_a_record_another_daemon_wrote_is_never_served(
    start_daemon: Callable[..., DaemonProcess], redis_server: LocalRedis, tmp_path: Path
) -> None:
    victim_key = ["--l2-redis-auth-key-file", _key_file(tmp_path, "victim.key", "v" * 64)]
    attacker_key = ["--l2-redis-auth-key-file", _key_file(tmp_path, "attacker.key", "a" * 64)]
    victim, ours, theirs = _victim_and_attacker(start_daemon, redis_server, victim_key, attacker_key)
    got, kv = _retrieve(victim, SHARED)
    assert not caches_equal(kv, theirs), "the victim served the attacker's KV from the shared Redis"
    assert got == 0, f"{got} tokens of a record the victim never sealed were served"
    assert _forged_loads(victim) >= 1
    got, kv = _retrieve(victim, OURS)  # its own sealed records survive its restart
    assert got == CHUNKS * CS and caches_equal(kv, ours)
    assert _sealed(victim)


def test_an_unsealed_record_is_never_served_by_a_daemon_with_a_key(
    start_daemon: Callable[..., DaemonProcess], redis_server: LocalRedis, tmp_path: Path
) -> None:
    """The attacker's daemon runs without a key (or an older build): its plain records too."""
    victim_key = ["--l2-redis-auth-key-file", _key_file(tmp_path, "victim.key", "v" * 64)]
    victim, _, theirs = _victim_and_attacker(start_daemon, redis_server, victim_key, ["--l2-redis-trust-all"])
    got, kv = _retrieve(victim, SHARED)
    assert got == 0 and not caches_equal(kv, theirs)
    assert _forged_loads(victim) >= 1


def test_control_trust_all_serves_what_anyone_wrote(
    start_daemon: Callable[..., DaemonProcess], redis_server: LocalRedis
) -> None:
    """What ``--l2-redis-trust-all`` means (and what every daemon did before): the last writer
    of a record is believed. Shows the tests above can fail."""
    trust = ["--l2-redis-trust-all"]
    victim, _, theirs = _victim_and_attacker(start_daemon, redis_server, trust, trust)
    got, kv = _retrieve(victim, SHARED)
    assert got == CHUNKS * CS and caches_equal(kv, theirs)
    assert not _sealed(victim)
