"""Two principals of one real daemon, as the fair-share tests need them."""

from __future__ import annotations

from kvcache.client import KVCacheClient
from kvcache.server.launch import DaemonProcess


def victim_and_attacker(d: DaemonProcess) -> tuple[KVCacheClient, KVCacheClient]:
    """Instance 1 on the Unix socket (principal: this uid) and instance 2 on plain loopback
    TCP (principal: loopback): two principals the daemon shares out between. Not yet
    connected: enter both (``with victim, attacker:``)."""
    assert d.ipc_endpoint is not None
    victim = KVCacheClient(d.ipc_endpoint, 1, "m", timeout_s=30)
    attacker = KVCacheClient(d.endpoint, 2, "m", timeout_s=30)
    return victim, attacker
