"""Chunk keys: a rolling prefix hash over token ids, one 128-bit key per full chunk.

Separate from the engine because keys are a contract: two processes (or two machines sharing a
Redis L2) must derive the same key for the same prefix, so nothing here may depend on
``PYTHONHASHSEED``, the platform's byte order or the Python version.

Definition (version 1)::

    root  = blake2b(SEED || u32le(len(model)) || model || u32le(len(salt)) || salt
                    || u32le(len(scope)) || scope, digest_size=16, person=PERSON)
    key_0 = root
    key_i = blake2b(key_{i-1} || tag || tokens of chunk i, digest_size=16, person=PERSON)

and ``ChunkKey`` is the 16-byte digest read as an unsigned little-endian 128-bit int.
Because every key folds in its predecessor, ``key_i`` names the whole prefix up to the end of
chunk ``i``, so a prefix lookup can stop at the first missing key.

Why these choices:

* **blake2b** (``hashlib``): in the standard library on every Python (xxhash and blake3 are not
  dependencies), cryptographic, so colliding prefixes cannot be crafted by a tenant, and at
  ~1 GB/s its cost for a 32k-token prompt (128 KiB of token bytes) is a fraction of a millisecond.
  16-byte digests make accidental collisions negligible (2^-64 at 2^32 stored chunks).
* **Tokens as little-endian uint32** (tag ``b"\\x04"``): every real vocabulary fits in 32 bits and
  this halves the bytes hashed compared with int64. ``array.array`` converts a Python list about
  3x faster than numpy. Token ids outside [0, 2^32) (negative sentinels, synthetic ids) fall back
  to little-endian int64 with a different tag (``b"\\x08"``), chunk by chunk (a chunk without such
  ids keeps its uint32 key), so the two encodings never collide.
* **The daemon's batched lookup hashes in native code** (``ChunkHasher.keys_of_run`` →
  ``csrc/kvc_keys.cpp``, BLAKE2b written from RFC 7693): the same chain, byte for byte (the
  tests hold it to ``hashlib`` and to ``keys``), with a step's independent chunks hashed four at
  a time in AVX2 lanes. Everything else hashes here, with ``hashlib``.
* **Scope** (model name, cache salt, and an opaque ``scope`` bytes the engine fills with the chunk
  geometry) enters only the root: different salts never share a key (tenant isolation), and
  caches of a different dtype or layer count can never be handed each other's bytes.
* **The caller's part of the scope** is one structured value, ``KeyScope`` (the tenant's salt,
  the request facts the serving engine would hash itself, and, for a shared door, whose it is).
  It enters the root as the ``salt`` field above, in the one encoding ``KeyScope.salt_field``
  defines: its parts joined by ``\x1f``, which no part may contain, trailing empty parts left
  out (so a plain salt hashes as itself, as it always did).
"""

from __future__ import annotations

import array
import hashlib
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcache.records import ChunkKey

#: Fixed seed of key version 1. Changing it (or anything above) invalidates every stored chunk.
SEED = b"kvcache.chunk-key.v1"
#: blake2b personalisation string (at most 16 bytes): separates our digests from any other use.
PERSON = b"kvcache-chunk-v1"
KEY_BYTES = 16
_TAG_U32 = b"\x04"
_TAG_I64 = b"\x08"
_U32_MAX = (1 << 32) - 1
_U32LE = np.dtype("<u4")


_SEP = "\x1f"


@dataclass(frozen=True, slots=True)
class KeyScope:
    """Whose chunks a request's keys name, besides the model and the chunk geometry.

    ``salt``: the tenant's ``cache_salt``, a namespace it chooses. ``extra``: what besides the
    tokens decides the KV (LoRA adapter, multimodal inputs: vLLM's ``key_extra``), as the
    serving engine states it. ``door``: set by the daemon for an instance of a *shared*
    principal (plain loopback TCP: any local user) to that principal's name, which no other
    request can produce: what it stores is never a hit for an engine on another door, and what
    they store never one for it. Built once at the edge (the daemon from the wire and the
    registration, an in-process caller directly); hashable, so the engine keeps one hasher per
    scope. ``ValueError`` when ``salt`` or ``extra`` holds the separator: no two scopes may
    encode alike.
    """

    salt: str = ""
    extra: str = ""
    door: str | None = None

    def __post_init__(self) -> None:
        if _SEP in self.salt or _SEP in self.extra:
            raise ValueError("cache_salt and key_extra may not contain \\x1f")

    def salt_field(self) -> str:
        """The ``salt`` field of the root digest (key version 1): the stored chunks of every
        release are keyed by exactly this string, so it may never change."""
        if self.door is not None:
            return _SEP.join((self.salt, self.extra, self.door))
        return f"{self.salt}{_SEP}{self.extra}" if self.extra else self.salt


def _lp(data: bytes) -> bytes:
    """Length-prefix a field so that ("ab", "c") and ("a", "bc") hash differently."""
    return struct.pack("<I", len(data)) + data


def root_key_bytes(model_name: str, cache_salt: str = "", scope: bytes = b"") -> bytes:
    """The 16-byte digest that seeds the chain for one (model, salt, scope)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=PERSON)
    h.update(SEED)
    h.update(_lp(model_name.encode("utf-8")))
    h.update(_lp(cache_salt.encode("utf-8")))
    h.update(_lp(scope))
    return h.digest()


def pack_tokens(token_ids: Sequence[int] | Any) -> tuple[bytes, memoryview, int]:
    """Pack token ids into ``(tag, little-endian bytes, item size)``; see the module docstring."""
    if isinstance(token_ids, np.ndarray) or hasattr(token_ids, "numpy"):
        arr = np.asarray(token_ids.cpu().numpy() if hasattr(token_ids, "cpu") else token_ids)
        if arr.ndim != 1:
            raise ValueError(f"token_ids must be one-dimensional, got shape {arr.shape}")
        if arr.size and arr.dtype.kind not in "iu":
            raise TypeError(f"token_ids must be integers, got dtype {arr.dtype}")
        in_range = arr.dtype.kind == "u" and arr.dtype.itemsize <= 4  # ids off the wire: no scan
        if in_range or arr.size == 0 or (int(arr.min()) >= 0 and int(arr.max()) <= _U32_MAX):
            packed = np.ascontiguousarray(arr, dtype="<u4")
            return _TAG_U32, packed.data.cast("B"), 4
        return _TAG_I64, np.ascontiguousarray(arr, dtype="<i8").data.cast("B"), 8
    seq = token_ids if isinstance(token_ids, list) else list(token_ids)
    try:
        a = array.array("I", seq)
        tag, size = _TAG_U32, 4
        if a.itemsize != 4:  # pragma: no cover - no supported platform has a 64-bit C unsigned int
            raise OverflowError
    except OverflowError:
        a = array.array("q", seq)
        tag, size = _TAG_I64, 8
    if sys.byteorder != "little":  # pragma: no cover - all supported platforms are little-endian
        a.byteswap()
    return tag, memoryview(a).cast("B"), size


class ChunkHasher:
    """Derives the chunk keys of token sequences for one (model, salt, scope, chunk size).

    Cheap to build (one digest); the engine keeps one per (instance, salt) it sees.
    """

    __slots__ = ("_root", "chunk_size")

    def __init__(self, model_name: str, chunk_size: int, *, cache_salt: str = "", scope: bytes = b"") -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self._root = root_key_bytes(model_name, cache_salt, scope)

    def num_full_chunks(self, num_tokens: int) -> int:
        return num_tokens // self.chunk_size

    def keys(self, token_ids: Sequence[int] | Any, max_chunks: int | None = None) -> list[ChunkKey]:
        """Keys of the full chunks of ``token_ids`` (a trailing partial chunk has no key)."""
        n = len(token_ids) // self.chunk_size
        if max_chunks is not None:
            n = min(n, max_chunks)
        if n == 0:
            return []
        tag, buf, size = pack_tokens(token_ids[: n * self.chunk_size])
        step = self.chunk_size * size
        prev = self._root
        out: list[ChunkKey] = []
        blake2b = hashlib.blake2b
        for i in range(n):
            h = blake2b(prev, digest_size=KEY_BYTES, person=PERSON)
            if tag == _TAG_U32:
                h.update(tag)
                h.update(buf[i * step : (i + 1) * step])
            else:  # rare: re-pack chunk by chunk so in-range chunks keep their u32 keys
                c_tag, c_buf, _ = pack_tokens(token_ids[i * self.chunk_size : (i + 1) * self.chunk_size])
                h.update(c_tag)
                h.update(c_buf)
            prev = h.digest()
            out.append(int.from_bytes(prev, "little"))
        return out

    def keys_of_run(self, prompts: Sequence[bytes | memoryview]) -> tuple[list[list[ChunkKey]], list[int]]:
        """``keys`` of each of ``prompts`` (token ids packed as little-endian uint32, as the
        wire carries them and ``u32_bytes`` gives them), in order, as one scheduler step asks
        them: one native call (``_native.chain_keys_u32``, the chain defined above) that hashes
        a head a prompt shares with the prompt before once, and the chunks that follow it four
        at a time. Also returns how many leading keys each prompt shares with the one before
        (its keys are those same objects: ``L1Pool.resident_many`` walks them once). The
        hashing runs without the interpreter lock, so other threads go on meanwhile."""
        from kvcache import _native  # the daemon's path; importing keys needs no native build

        keys, shared = _native.chain_keys_u32(self._root, PERSON, self.chunk_size, prompts)
        return keys, shared


def u32_bytes(token_ids: Sequence[int] | Any) -> memoryview | None:
    """``token_ids`` as the chain hashes them when every id fits in uint32 (little-endian
    uint32 bytes, ``ChunkHasher.keys_of_run``'s input), else None (hashed by ``keys``)."""
    tag, view, _ = pack_tokens(token_ids)
    return view if tag == _TAG_U32 else None


def chunk_keys(
    token_ids: Sequence[int] | Any,
    model_name: str,
    *,
    chunk_size: int = 256,
    cache_salt: str = "",
    scope: bytes = b"",
) -> list[ChunkKey]:
    """One-shot form of ``ChunkHasher(...).keys(token_ids)``."""
    return ChunkHasher(model_name, chunk_size, cache_salt=cache_salt, scope=scope).keys(token_ids)


def fold64(key: ChunkKey) -> int:
    """Fold a 128-bit key to 64 bits (XOR of halves) for consumers limited to int64 hashes."""
    return (key >> 64) ^ (key & ((1 << 64) - 1))


__all__ = [
    "KEY_BYTES",
    "PERSON",
    "SEED",
    "ChunkHasher",
    "KeyScope",
    "chunk_keys",
    "fold64",
    "root_key_bytes",
    "u32_bytes",
]
