"""Local-disk L2: one file per chunk, written atomically, bounded in size, rebuilt on restart.

The embedded default tier: it needs no server, survives a restart of the process (the index is
rebuilt by scanning the directory) and never hands back a damaged chunk (header + CRC, see
``codec``). Files live in 256 sub-directories (``ab/ab12...ef.<crc32>.kvc``) so no directory grows
huge.

Atomicity: a chunk is written to a temp file in its final directory and ``os.replace``d into
place, so a reader sees the whole record or none (a crash leaves only ``*.tmp`` files, removed
on the next start). No fsync: this is a cache; after a power loss a torn file fails its CRC and
is dropped like any other corrupt record. Integrity lives twice: the payload's CRC32 is in the
record's header *and* in the tier's metadata (the file name, kept in the index), and a read
serves a chunk only when the header, the index and the payload agree; a mismatch raises
``ChecksumMismatchError`` (a miss, counted in ``kvcache_l2_checksum_failures_total``) and the
file is removed. A restart rebuilds the index from whole, consistent files only
(``disk_scan``).

Shared out between tenants (``disk_index``): which file leaves first is the
``EvictionPolicy``'s (LRU, or S3-FIFO: ``--l2-disk-eviction``) within each tenant, and the
tenant it leaves from is the one holding the most of the tier, never one holding less than the
writer, as in L1 (``storage.shares``), so one principal storing more than the tier holds no
longer evicts every other principal's chunks. Each write carries its tenant down from the
engine (``AsyncL2.submit_store``), and its record names it (``codec`` version 3), so a restart
charges every file to its owner again. ``info`` shows each tenant's bytes (``tenant_bytes``),
which the daemon shows its operator only.

Privacy and trust: cached KV is as sensitive as the prompts it came from, and a chunk file
another user could replace is served as KV (its CRC is no MAC). So the tier directory and each
subdirectory must be real directories (no symlinks) of the daemon's uid, 0700, and each chunk
file a regular file of that uid, 0600 (``kvcache.trusted_dir``); anything else stops the tier
at start with a message that says how to fix it, never loosened or tightened silently. After
the check every file is reached relative to a descriptor of the checked directory, opened with
``O_NOFOLLOW``: nobody else can add an entry in it, and renaming a directory above it changes
nothing. Only the daemon's uid (or root) can then swap a subdirectory for a symlink while it
runs, and even that is not followed: every read, write, rename, unlink and the restart scan
opens the subdirectory itself without following a link and works relative to it
(``disk_access``). Files are created 0600 and directories 0700 whatever the umask.

A full disk (ENOSPC, EDQUOT) is not the end of the tier: it evicts its own oldest chunks and
retries once, and from then on bounds itself by what the disk really has free: re-read at every
write while the disk (not the configured size) is the bound, so the bound grows back as soon as
space is freed, and every ``_PROBE_EVERY`` writes otherwise (someone else may fill the disk).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcache.errors import ChecksumMismatchError, CorruptChunkError
from kvcache.observability.event import Event, EventSink, EventType, L2KeysEvicted, L2KeysFound, NullEventBus
from kvcache.records import ChunkKey
from kvcache.storage.l1.lru import LRUPolicy
from kvcache.storage.l2 import codec
from kvcache.storage.l2.base import Announce, EvictionPolicy, L2Adapter, StoreItem, storage_error
from kvcache.storage.l2.disk_access import WHAT, ChunkFiles, unlink
from kvcache.storage.l2.disk_index import DiskIndex
from kvcache.storage.l2.disk_scan import names, scan_tier
from kvcache.trusted_dir import open_private_dir

_FULL = (errno.ENOSPC, errno.EDQUOT)
_PROBE_EVERY = 64
log = logging.getLogger(__name__)


class DiskL2Adapter(L2Adapter):
    """Chunk files under ``path``; at most ``size_bytes`` of them (``policy``, a class or
    factory, makes each tenant's order of who leaves)."""

    backend = "disk"
    keeps_meta = True

    def __init__(
        self,
        path: str,
        size_bytes: int,
        bus: EventSink | None = None,
        policy: Callable[[], EvictionPolicy] = LRUPolicy,
    ) -> None:
        self.path = os.path.abspath(path)
        self.size_bytes = size_bytes
        self._bus: EventSink = bus if bus is not None else NullEventBus()
        self._lock = threading.Lock()
        self._index = DiskIndex(policy)  # files, their owners, who leaves; under ``_lock``
        self.recovery: dict[str, float] = {}
        """What the last start's scan found: files kept, damaged files removed, seconds."""
        self.capacity_bytes = size_bytes
        """The bound in force: ``size_bytes``, or less while the disk has less free."""
        self._writes = 0
        self._full_logged = False
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._root = open_private_dir(self.path, WHAT)
        """Every file is reached relative to this descriptor of the checked directory."""
        weakref.finalize(self, os.close, self._root)  # never while a method may still use it
        self._files = ChunkFiles(self.path, self._root)
        self._scan()

    @property
    def used_bytes(self) -> int:
        """Bytes of the chunk files the tier holds."""
        return self._index.used_bytes

    # -- L2Adapter ------------------------------------------------------------------------
    def store(self, key: ChunkKey, chunk: torch.Tensor, announce: Announce | None = None) -> int:
        return self.store_with_meta(key, chunk, announce, b"")

    def store_many_with_meta(
        self, items: Sequence[StoreItem], metas: Sequence[bytes], tenants: Sequence[str] = ()
    ) -> list[int | Exception]:
        out: list[int | Exception] = []
        owners = tenants or [""] * len(items)
        for (key, chunk, announce), meta, tenant in zip(items, metas, owners, strict=True):
            try:
                out.append(self.store_with_meta(key, chunk, announce, meta, tenant))
            except Exception as exc:
                out.append(exc)
        return out

    def store_with_meta(
        self, key: ChunkKey, chunk: torch.Tensor, announce: Announce | None, meta: bytes, tenant: str = ""
    ) -> int:
        """``store``, with ``meta`` in the record's header (``codec``, version 2) and
        ``tenant``, whose share of the tier the file counts against (version 3; "", the
        default tenant, is recorded as no tenant). A key the tier holds already keeps its
        file and its owner, whoever writes it again."""
        with self._lock:
            if key in self._index:
                self._index.touch(key)
                if announce is not None:
                    announce(0)
                return 0
        owner = codec.bounded_tenant(tenant)  # what a restart reads back, so charged as that
        payload = codec.tensor_bytes(chunk)
        header = codec.encode_header(key, chunk, payload, meta, owner)
        crc = codec.decode_header(header).crc32
        size = len(header) + len(payload)
        if size > self.size_bytes:
            raise storage_error(f"chunk of {size} bytes exceeds the disk tier ({self.size_bytes})", "io")
        try:
            self._write(key, crc, header, payload, size, announce, owner)
        except OSError as err:
            if err.errno not in _FULL:  # EFBIG: this file is too big, evicting will not help
                reason = "full" if err.errno == errno.EFBIG else "io"
                raise storage_error(f"disk write of {key:032x} failed: {err}", reason) from err
            self._shrink_to_disk(size, owner)  # evict oldest chunks, bound ourselves by the disk
            try:
                self._write(key, crc, header, payload, size, announce, owner)
            except OSError as again:
                reason = "full" if again.errno in (*_FULL, errno.EFBIG) else "io"
                raise storage_error(f"disk write of {key:032x} failed: {again}", reason) from again
        self._full_logged = False
        return size

    def _write(
        self,
        key: ChunkKey,
        crc: int,
        header: bytes,
        payload: memoryview,
        size: int,
        announce: Announce | None,
        tenant: str,
    ) -> None:
        sub, final = names(key, crc)
        tmp = f"{final}.{uuid.uuid4().hex[:8]}.tmp"
        # Made if missing (removed behind our back: ``rm -rf tier/*``), refused if a link.
        with self._files.subdir(sub, create=True) as dir_fd:
            self._write_in(dir_fd, key, crc, tmp, final, header, payload, size, announce, tenant)

    def _write_in(
        self,
        dir_fd: int,
        key: ChunkKey,
        crc: int,
        tmp: str,
        final: str,
        header: bytes,
        payload: memoryview,
        size: int,
        announce: Announce | None,
        tenant: str,
    ) -> None:
        """``_write`` in the subdirectory ``dir_fd``: ``tmp`` written, then renamed ``final``,
        charged to ``tenant``; room is made on its behalf."""
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            with open(fd, "wb", buffering=0) as f:  # the slow part, outside the lock
                f.write(header)
                view = payload
                while view:  # raw writes may be short
                    n = f.write(view)
                    view = view[n:]
            # NOTE: rename, index, events and evictions happen under one lock, so the index,
            # the files and the published events agree even with several writer threads.
            with self._lock:
                if key in self._index:  # stored meanwhile: that file (and its owner) stays
                    unlink(tmp, dir_fd)
                    size = 0
                else:
                    os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                    self._index.add(key, size, crc, tenant)
                if announce is not None:
                    announce(size)
                self._writes += 1
                if self.capacity_bytes < self.size_bytes or self._writes % _PROBE_EVERY == 0:
                    self._probe_capacity(0)
                self._evict_over_limit(tenant)
        except BaseException:
            unlink(tmp, dir_fd)
            raise

    def _shrink_to_disk(self, need: int, tenant: str) -> None:
        """After ENOSPC: bound the tier by what the disk can hold, keeping room for ``need``
        more bytes of ``tenant``'s, and evict down to it now, on its behalf. Logged once per
        full-disk episode."""
        with self._lock:
            before = self.used_bytes
            self._probe_capacity(need)
            # The probe may say there is room (space freed meanwhile, or reserved blocks):
            # still free at least this chunk's worth, oldest first, so the retry can fit.
            self.capacity_bytes = min(self.capacity_bytes, max(0, self.used_bytes - need))
            self._evict_over_limit(tenant)
            freed = before - self.used_bytes
        if not self._full_logged:
            self._full_logged = True
            log.warning(
                "disk tier %s: the disk is full; evicted %d bytes of the oldest chunks, now "
                "bounded at %d bytes (of %d configured) while the disk stays this full",
                self.path, freed, self.capacity_bytes, self.size_bytes,
            )  # fmt: skip

    def _probe_capacity(self, need: int) -> None:
        """Re-read the disk's free space; the caller holds the lock."""
        try:
            free = shutil.disk_usage(self.path).free
        except OSError:
            return
        self.capacity_bytes = min(self.size_bytes, max(0, self.used_bytes + free - need))

    def load(self, key: ChunkKey, out: torch.Tensor) -> bool:
        with self._lock:
            there = self._index.get(key)
            if there is None:
                return False
            self._index.touch(key)
        crc = there[1]
        try:
            with self._files.open(*names(key, crc)) as f:
                head = f.read(codec.MAX_HEADER)
                header = codec.decode_header(head)
                if header.crc32 != crc:
                    raise ChecksumMismatchError(
                        f"record checksum {header.crc32:08x}, tier metadata {crc:08x}"
                    )
                codec.check_fits(header, key, out)
                buf = codec.out_buffer(out)
                if header.header_len > len(head):  # a long meta: the payload starts further on
                    f.seek(header.header_len)
                got = head[header.header_len :]
                if len(got) > header.nbytes:  # a short payload with bytes after it
                    raise CorruptChunkError(
                        f"file holds {len(got)}+ payload bytes, header says {header.nbytes}"
                    )
                buf[: len(got)] = got
                filled = len(got)
                while filled < header.nbytes:
                    n = f.readinto(buf[filled:])
                    if not n:
                        break
                    filled += n
                if filled != header.nbytes or f.read(1):
                    raise CorruptChunkError(
                        f"file holds {filled}+ payload bytes, header says {header.nbytes}"
                    )
                codec.check_payload(header, buf)  # the payload against the record's CRC = the index's
        except FileNotFoundError:  # deleted behind our back: a miss
            self._forget([key])
            return False
        except CorruptChunkError:
            self.delete([key])
            raise
        except OSError as err:
            raise storage_error(f"disk read of {key:032x} failed: {err}", "io") from err
        return True

    def contains(self, keys: Sequence[ChunkKey]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        removed = self._forget(keys)
        for key, crc in removed:
            self._files.unlink(*names(key, crc))
        return len(removed)

    def victim_for(self, nbytes: int, tenant: str = "") -> ChunkKey | None:
        with self._lock:
            if self.used_bytes + nbytes <= self.capacity_bytes:
                return None
            return self._index.victim_for(codec.bounded_tenant(tenant), nbytes)

    def info(self) -> dict[str, Any]:
        with self._lock:
            return {
                "backend": self.backend,
                "path": self.path,
                "num_chunks": len(self._index),
                "used_bytes": self.used_bytes,
                "capacity_bytes": self.capacity_bytes,
                "configured_bytes": self.size_bytes,
                "tenant_bytes": self._index.held(),
                "recovery": dict(self.recovery),
            }

    # -- internals ------------------------------------------------------------------------
    def _file(self, key: ChunkKey) -> str:
        """The chunk's file, as a path (for messages and tests; the adapter never opens it)."""
        there = self._index.get(key)
        return self._files.shown(*names(key, there[1] if there is not None else 0))

    def _scan(self) -> None:
        """Rebuild the index from the whole, consistent files present, oldest modification
        first (the policy's insertion order), each charged to the tenant its record names
        ("" for none); damaged ones are removed (``disk_scan``)."""
        start = time.perf_counter()
        # Raises for a symlink or a directory another user could write: the tier stops.
        found, dropped = scan_tier(self._files)
        metas: dict[ChunkKey, bytes] = {}
        with self._lock:
            for f in found:
                old = self._index.pop(f.key)
                if old is not None:  # two names for one key: the newer stays
                    self._files.unlink(*names(f.key, old[1]))
                self._index.add(f.key, f.size, f.crc, f.tenant)
                metas[f.key] = f.meta
            self._evict_over_limit(None)  # the limit may have shrunk since last run: the fullest pays
            keys = self._index.keys()
            used = self.used_bytes
        self.recovery = {"files": len(keys), "dropped": dropped, "seconds": time.perf_counter() - start}
        if dropped:
            log.warning("disk tier %s: removed %d damaged chunk files at start", self.path, dropped)
        if keys:  # tell holdings trackers (KV events) what survived the restart, and as what
            identities = (
                [] if isinstance(self._bus, NullEventBus) else [codec.chunk_identity(metas[k]) for k in keys]
            )
            meta = L2KeysFound(backend=self.backend, keys=keys, num_bytes=used, identities=identities)
            self._bus.publish(Event(EventType.L2_KEYS_FOUND, meta))

    def _evict_over_limit(self, tenant: str | None) -> None:
        """Drop victims until the tier fits, on ``tenant``'s behalf (None: no writer, the
        fullest tenant's first); the caller holds the lock."""
        evicted = self._index.evict_to(self.capacity_bytes, tenant)
        for key, _, crc in evicted:
            self._files.unlink(*names(key, crc))
        if evicted:
            meta = L2KeysEvicted(
                backend=self.backend,
                keys=[k for k, _, _ in evicted],
                num_bytes=sum(s for _, s, _ in evicted),
            )
            self._bus.publish(Event(EventType.L2_KEYS_EVICTED, meta))

    def _forget(self, keys: Sequence[ChunkKey]) -> list[tuple[ChunkKey, int]]:
        """Drop ``keys`` from the index; (key, crc) of those that were there."""
        removed: list[tuple[ChunkKey, int]] = []
        with self._lock:
            for key in keys:
                there = self._index.pop(key)
                if there is not None:
                    removed.append((key, there[1]))
        return removed


__all__ = ["DiskL2Adapter"]
