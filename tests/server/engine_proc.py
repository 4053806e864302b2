"""A stand-in serving engine run as its own process by the daemon tests.

Usage: python engine_proc.py MODE ENDPOINT INSTANCE MODEL FORMAT SEED [extra JSON]
Prints one JSON object per line; the last line is the result. Not a test module: pytest
collects nothing here.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch

from kvcache.client import KVCacheClient, to_shared
from kvcache.layouts import KVFormat
from kvcache.observability.event import BlockAllocationRecord
from kvcache.protocol.errors import DaemonUnavailableError
from kvcache.testing import ENGINE_OF, caches_equal, clone_caches, make_kv_caches

NUM_BLOCKS, BLOCK_SIZE = 64, 4
DTYPES = {"NL_X_TWO_NB_BS_NH_HS": torch.float16, "TWO_X_NL_X_NBBS_NH_HS": torch.bfloat16}


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def build(fmt_name: str, seed: int) -> tuple[Any, Any, KVFormat]:
    fmt = KVFormat[fmt_name]
    kv = make_kv_caches(fmt, num_layers=3, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                        num_heads=2, head_size=16, dtype=DTYPES.get(fmt_name, torch.float32),
                        seed=seed)  # fmt: skip
    return to_shared(kv), clone_caches(kv), fmt


def zero(kv: object) -> None:
    if isinstance(kv, torch.Tensor):
        kv.zero_()
    else:
        for x in kv:  # type: ignore[attr-defined]
            zero(x)


def main(argv: list[str]) -> int:
    mode, endpoint, instance, model, fmt_name, seed = argv[:6]
    extra = json.loads(argv[6]) if len(argv) > 6 else {}
    kv, original, fmt = build(fmt_name, int(seed))
    client = KVCacheClient(endpoint, int(instance), model, timeout_s=extra.get("timeout", 10.0))
    reg = client.register_kv_caches(kv, engine=ENGINE_OF[fmt], block_size=BLOCK_SIZE)
    emit(event="registered", fmt=reg.fmt, chunk_size=reg.chunk_size)
    tokens = [int(seed) * 1000 + i for i in range(NUM_BLOCKS * BLOCK_SIZE)]
    blocks = list(range(NUM_BLOCKS))

    if mode == "roundtrip":
        stored = client.store(tokens, blocks)
        hit = client.lookup(tokens)
        zero(kv)
        got = client.retrieve(tokens, blocks)
        exact = caches_equal(kv, original)
        # Blocks 0-3 get new content for a second request: the L0 lifecycle subscriber sees
        # one eviction per block, attributed to this instance only.
        client.report_block_allocations([BlockAllocationRecord("req-a", blocks[:4], tokens[:16])])
        client.end_session("req-a")
        client.report_block_allocations([BlockAllocationRecord("req-b", blocks[:4], tokens[16:32])])
        client.close()
        emit(event="done", stored_tokens=stored.stored_tokens, hit=hit, got=got, exact=exact)
        return 0

    if mode == "kill_mid_store":
        emit(event="storing", pid=os.getpid())
        future = client.store_async(tokens, blocks)
        # Die while the daemon works on the store, if we can catch it in the act.
        while not future.done() and client.status()["in_flight"] == 0:
            pass
        os.kill(os.getpid(), signal.SIGKILL)
        return 1

    if mode == "verify":  # same model and layout as a writer with the same seed
        hit = client.lookup(tokens)
        zero(kv)
        got = client.retrieve(tokens, blocks)
        n_blocks = got // BLOCK_SIZE
        exact = _prefix_equal(kv, original, fmt, n_blocks)
        client.close()
        emit(event="done", hit=hit, got=got, exact=exact, chunk_size=reg.chunk_size)
        return 0

    if mode == "traffic":  # store and look up until the daemon goes away
        counts = {"ok": 0, "unavailable": 0, "other": 0}
        errors: list[str] = []
        i = 0
        deadline = time.monotonic() + float(extra.get("seconds", 30))
        while time.monotonic() < deadline:
            i += 1
            toks = [i * 100_000 + t for t in tokens]
            try:
                client.store(toks, blocks)
                client.lookup(toks)
                counts["ok"] += 1
                if counts["ok"] == 3:
                    emit(event="running")
            except DaemonUnavailableError:  # includes ShuttingDownError
                counts["unavailable"] += 1
                if counts["unavailable"] >= 2:
                    break
            except Exception as exc:
                counts["other"] += 1
                errors.append(f"{type(exc).__name__}: {exc}")
        client.close(unregister=False)
        emit(event="done", errors=errors[:5], **counts)
        return 0

    raise SystemExit(f"unknown mode {mode}")


def _prefix_equal(kv: object, original: object, fmt: KVFormat, n_blocks: int) -> bool:
    """Byte-exact on the first ``n_blocks`` blocks; the rest must still be zero."""
    from kvcache.layouts import describe, flatten_tensors
    from kvcache.reference import gather

    flat = flatten_tensors(kv, fmt)  # type: ignore[arg-type]
    shape = describe(flat, fmt, BLOCK_SIZE)
    head = list(range(n_blocks))
    tail = list(range(n_blocks, NUM_BLOCKS))
    ok = torch.equal(
        gather(kv, fmt, shape, head).view(torch.uint8),  # type: ignore[arg-type]
        gather(original, fmt, shape, head).view(torch.uint8),  # type: ignore[arg-type]
    )
    return ok and (not tail or not bool(gather(kv, fmt, shape, tail).view(torch.uint8).any()))  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
