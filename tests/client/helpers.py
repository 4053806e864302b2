"""What the client tests share: one daemon's flags, a prompt, and a CPU KV cache it can map."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvcache.client import to_shared
from kvcache.layouts import KVFormat
from kvcache.testing import make_kv_caches

ARGS = ["--chunk-size", "16", "--l1-size-gb", "0.2", "--heartbeat-timeout", "0.6"]
TOKENS, BLOCKS = list(range(128)), list(range(32))


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


def shared_cache(seed: int = 0) -> list[torch.Tensor]:
    kv = make_kv_caches(KVFormat.NL_X_TWO_NB_BS_NH_HS, num_layers=2, num_blocks=32,
                        block_size=4, num_heads=2, head_size=8, dtype=torch.float16, seed=seed)  # fmt: skip
    return to_shared(kv)
