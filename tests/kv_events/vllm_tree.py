"""Rebuild a router's prefix tree from recorded KV-event payloads with vLLM's own classes.

Run by ``test_vllm_prefix_tree.py`` under the vLLM venv's Python (it imports vLLM, and
nothing from kvcache). It serves many requests from one process, since importing vLLM costs
seconds: each stdin line ``FORMAT PAYLOADS`` (PAYLOADS a file holding a msgpack list of the
payload frames, in seq order) is answered by one stdout line, the tree as JSON:
``{medium: {block hash: [parent hash, token ids]}}``.

The map form is decoded by vLLM's ``KVEventBatch`` decoder itself. vLLM 0.32 no longer ships
the array form (<= 0.23), whose events are ``[class name, field, field, ...]`` in the class's
field order; they are turned into vLLM's classes by that order (``__struct_fields__``) and
``msgspec.convert``, so a field out of place or of the wrong type fails here too.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

CLASSES: dict[str, type[Any]] = {c.__name__: c for c in (BlockStored, BlockRemoved, AllBlocksCleared)}


def events_of(fmt: str, payload: bytes) -> list[Any]:
    if fmt == "map":
        return list(msgspec.msgpack.decode(payload, type=KVEventBatch).events)
    _ts, events, *_ = msgspec.msgpack.decode(payload)
    out = []
    for tag, *values in events:
        cls = CLASSES[tag]
        out.append(msgspec.convert(dict(zip(cls.__struct_fields__, values, strict=False)), cls))
    return out


def rebuild(fmt: str, payloads: list[bytes]) -> dict[str, dict[int, tuple[int | None, list[int]]]]:
    tree: dict[str, dict[int, tuple[int | None, list[int]]]] = {}
    for payload in payloads:
        for ev in events_of(fmt, payload):
            if isinstance(ev, AllBlocksCleared):
                tree.clear()
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    tree.get(ev.medium, {}).pop(h, None)
            else:
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes), ev
                held = tree.setdefault(ev.medium, {})
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    held[h] = (parent, ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size])
                    parent = h
    return tree


def main() -> None:
    for line in sys.stdin:
        fmt, path = line.split()
        with open(path, "rb") as f:
            payloads = msgspec.msgpack.decode(f.read(), type=list[bytes])
        tree = rebuild(fmt, payloads)
        print(json.dumps({m: {str(h): v for h, v in held.items()} for m, held in tree.items()}), flush=True)


if __name__ == "__main__":
    main()
