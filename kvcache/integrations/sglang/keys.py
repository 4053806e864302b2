"""SGLang page keys on the wire: 32 bytes each, concatenated (``PageExists.keys``).

SGLang names a page by the hex SHA-256 chained over the prompt's pages (``get_hash_str``, seeded
by its extra key / cache salt). Those are sent as their 32 raw bytes; any other string (another
pool's suffixed key, a key a future SGLang formats differently) as the SHA-256 of its UTF-8
bytes, so every key is 32 bytes and two different strings never share one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KEY_BYTES = 32
_HEX = frozenset("0123456789abcdefABCDEF")


def pack_page_keys(keys: Sequence[str]) -> bytes:
    if all(isinstance(k, str) and len(k) == 2 * KEY_BYTES for k in keys):
        try:
            return bytes.fromhex("".join(keys))
        except ValueError:
            pass
    return b"".join(_one(k) for k in keys)


def _one(key: str) -> bytes:
    if not isinstance(key, str):
        raise TypeError(f"page keys are strings, got {type(key).__name__}")
    if len(key) == 2 * KEY_BYTES and _HEX.issuperset(key):
        return bytes.fromhex(key)
    return hashlib.sha256(b"sglang-key:" + key.encode("utf-8")).digest()


__all__ = ["KEY_BYTES", "pack_page_keys"]
