"""Local-disk L2: one file per chunk, written atomically, bounded in size, rebuilt on restart.

The embedded default tier: it needs no server, survives a restart of the process (the index is
rebuilt by scanning the directory) and never hands back a damaged chunk (header + CRC, see
``codec``). Files live in 256 sub-directories (``ab/ab12...ef.kvc``) so no directory grows huge.

Atomicity: a chunk is written to a temp file in its final directory and ``os.replace``d into
place, so a reader sees the whole record or none (a crash leaves only ``*.tmp`` files, removed
on the next start). No fsync: this is a cache; after a power loss a torn file fails its CRC and
is dropped like any other corrupt record.

Privacy and trust: cached KV is as sensitive as the prompts it came from, and a chunk file
another user could replace is served as KV (its CRC is no MAC). So the tier directory and each
subdirectory must be real directories (no symlinks) of the daemon's uid, 0700, and each chunk
file a regular file of that uid, 0600 (``kvcache.trusted_dir``); anything else stops the tier
at start with a message that says how to fix it, never loosened or tightened silently. After
the check every file is reached relative to a descriptor of the checked directory, opened with
``O_NOFOLLOW``: nobody else can add an entry in it, and renaming a directory above it changes
nothing. Only the daemon's uid (or root) can then swap a subdirectory for a symlink while it
runs, and even that is not followed (``disk_files``). Files are created 0600 and directories
0700 whatever the umask.

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
import stat
import threading
import uuid
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import torch

from kvcache.errors import CorruptChunkError
from kvcache.observability.event import Event, EventSink, EventType, L2KeysEvicted, L2KeysFound, NullEventBus
from kvcache.records import ChunkIdentity, ChunkKey
from kvcache.storage.l2 import codec
from kvcache.storage.l2.base import Announce, L2Adapter, StoreItem, storage_error
from kvcache.storage.l2.disk_files import SUFFIX, WHAT, ChunkFiles, names, unlink
from kvcache.trusted_dir import check_mode, open_private_dir

_FULL = (errno.ENOSPC, errno.EDQUOT)
_PROBE_EVERY = 64
log = logging.getLogger(__name__)


class DiskL2Adapter(L2Adapter):
    """Chunk files under ``path``; at most ``size_bytes`` of them (LRU beyond that)."""

    backend = "disk"
    keeps_meta = True

    def __init__(self, path: str, size_bytes: int, bus: EventSink | None = None) -> None:
        self.path = os.path.abspath(path)
        self.size_bytes = size_bytes
        self._bus: EventSink = bus if bus is not None else NullEventBus()
        self._lock = threading.Lock()
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()  # key -> file bytes, LRU first
        self.used_bytes = 0
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

    # -- L2Adapter ------------------------------------------------------------------------
    def store(self, key: ChunkKey, chunk: torch.Tensor, announce: Announce | None = None) -> int:
        return self.store_with_meta(key, chunk, announce, b"")

    def store_many_with_meta(
        self, items: Sequence[StoreItem], metas: Sequence[bytes]
    ) -> list[int | Exception]:
        out: list[int | Exception] = []
        for (key, chunk, announce), meta in zip(items, metas, strict=True):
            try:
                out.append(self.store_with_meta(key, chunk, announce, meta))
            except Exception as exc:
                out.append(exc)
        return out

    def store_with_meta(
        self, key: ChunkKey, chunk: torch.Tensor, announce: Announce | None, meta: bytes
    ) -> int:
        """``store``, with ``meta`` in the record's header (``codec``, version 2)."""
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                if announce is not None:
                    announce(0)
                return 0
        payload = codec.tensor_bytes(chunk)
        header = codec.encode_header(key, chunk, payload, meta)
        size = len(header) + len(payload)
        if size > self.size_bytes:
            raise storage_error(f"chunk of {size} bytes exceeds the disk tier ({self.size_bytes})", "io")
        try:
            self._write(key, header, payload, size, announce)
        except OSError as err:
            if err.errno not in _FULL:  # EFBIG: this file is too big, evicting will not help
                reason = "full" if err.errno == errno.EFBIG else "io"
                raise storage_error(f"disk write of {key:032x} failed: {err}", reason) from err
            self._shrink_to_disk(size)  # evict our oldest chunks, bound ourselves by the disk
            try:
                self._write(key, header, payload, size, announce)
            except OSError as again:
                reason = "full" if again.errno in (*_FULL, errno.EFBIG) else "io"
                raise storage_error(f"disk write of {key:032x} failed: {again}", reason) from again
        self._full_logged = False
        return size

    def _write(
        self, key: ChunkKey, header: bytes, payload: memoryview, size: int, announce: Announce | None
    ) -> None:
        sub, final = names(key)
        tmp = f"{final}.{uuid.uuid4().hex[:8]}.tmp"
        # Made if missing (removed behind our back: ``rm -rf tier/*``), refused if a link.
        with self._files.subdir(sub, create=True) as dir_fd:
            self._write_in(dir_fd, key, tmp, final, header, payload, size, announce)

    def _write_in(
        self,
        dir_fd: int,
        key: ChunkKey,
        tmp: str,
        final: str,
        header: bytes,
        payload: memoryview,
        size: int,
        announce: Announce | None,
    ) -> None:
        """``_write`` in the subdirectory ``dir_fd``: ``tmp`` written, then renamed ``final``."""
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
                os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                if key not in self._index:
                    self._index[key] = size
                    self.used_bytes += size
                if announce is not None:
                    announce(size)
                self._writes += 1
                if self.capacity_bytes < self.size_bytes or self._writes % _PROBE_EVERY == 0:
                    self._probe_capacity(0)
                self._evict_over_limit()
        except BaseException:
            unlink(tmp, dir_fd)
            raise

    def _shrink_to_disk(self, need: int) -> None:
        """After ENOSPC: bound the tier by what the disk can hold, keeping room for ``need``
        more bytes, and evict down to it now. Logged once per full-disk episode."""
        with self._lock:
            before = self.used_bytes
            self._probe_capacity(need)
            # The probe may say there is room (space freed meanwhile, or reserved blocks):
            # still free at least this chunk's worth, oldest first, so the retry can fit.
            self.capacity_bytes = min(self.capacity_bytes, max(0, self.used_bytes - need))
            self._evict_over_limit()
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
            if key not in self._index:
                return False
            self._index.move_to_end(key)
        try:
            with self._files.open(key) as f:
                head = f.read(codec.MAX_HEADER)
                header = codec.decode_header(head)
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
                codec.check_payload(header, buf)
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
        for key in removed:
            self._files.unlink_chunk(key)
        return len(removed)

    def info(self) -> dict[str, Any]:
        with self._lock:
            return {
                "backend": self.backend,
                "path": self.path,
                "num_chunks": len(self._index),
                "used_bytes": self.used_bytes,
                "capacity_bytes": self.capacity_bytes,
                "configured_bytes": self.size_bytes,
            }

    # -- internals ------------------------------------------------------------------------
    def _file(self, key: ChunkKey) -> str:
        """The chunk's file, as a path (for messages and tests)."""
        return self._files.file(key)

    def _scan(self) -> None:
        """Rebuild the index from the files present, oldest modification first (LRU order)."""
        found: list[tuple[float, ChunkKey, int]] = []
        with os.scandir(self._root) as entries:
            subdirs = [e.name for e in entries if e.is_dir(follow_symlinks=False) or e.is_symlink()]
        for name in subdirs:
            found += self._scan_subdir(name)
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self.used_bytes += size
            self._evict_over_limit()  # the limit may have shrunk since last run
            keys = list(self._index)
            used = self.used_bytes
        if keys:  # tell holdings trackers (KV events) what survived the restart, and as what
            identities = [] if isinstance(self._bus, NullEventBus) else [self._identity(k) for k in keys]
            meta = L2KeysFound(backend=self.backend, keys=keys, num_bytes=used, identities=identities)
            self._bus.publish(Event(EventType.L2_KEYS_FOUND, meta))

    def _scan_subdir(self, name: str) -> list[tuple[float, ChunkKey, int]]:
        """(mtime, key, size) of the chunk files in one (checked) subdirectory; refuses one
        that is not a regular file of ours closed to others, removes crashed writes."""
        found: list[tuple[float, ChunkKey, int]] = []
        # Raises for a symlink or a directory another user could write.
        fd = open_private_dir(name, f"{WHAT} subdirectory", self._root, os.path.join(self.path, name))
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    if entry.name.endswith(".tmp"):
                        unlink(entry.name, fd)  # a write interrupted by a crash
                        continue
                    if not entry.name.endswith(SUFFIX):
                        continue
                    st = entry.stat(follow_symlinks=False)
                    shown = os.path.join(self.path, name, entry.name)
                    check_mode(st, shown, os.getuid(), f"{WHAT} chunk file", stat.S_IFREG)
                    try:
                        key = int(entry.name[: -len(SUFFIX)], 16)
                    except ValueError:
                        continue
                    found.append((st.st_mtime, key, st.st_size))
        finally:
            os.close(fd)
        return found

    def _identity(self, key: ChunkKey) -> ChunkIdentity | None:
        """How KV events announced ``key`` before the restart (its file's meta); None for a
        file without one (written by an older build) or one that cannot be read."""
        try:
            with self._files.open(key) as f:
                head = f.read(codec.MAX_HEADER)
                header = codec.decode_header(head)
                if header.header_len > len(head):
                    head += f.read(header.header_len - len(head))
                meta = codec.decode_meta(head, header)
            return msgspec.msgpack.decode(meta, type=ChunkIdentity) if meta else None
        except (OSError, CorruptChunkError, msgspec.DecodeError) as exc:
            log.debug("disk tier %s: no identity for %032x: %s", self.path, key, exc)
            return None

    def _evict_over_limit(self) -> None:
        """Drop least-recently-used files until the tier fits; the caller holds the lock."""
        evicted: list[tuple[ChunkKey, int]] = []
        while self.used_bytes > self.capacity_bytes and self._index:
            key, size = self._index.popitem(last=False)
            self.used_bytes -= size
            self._files.unlink_chunk(key)
            evicted.append((key, size))
        if evicted:
            meta = L2KeysEvicted(
                backend=self.backend,
                keys=[k for k, _ in evicted],
                num_bytes=sum(s for _, s in evicted),
            )
            self._bus.publish(Event(EventType.L2_KEYS_EVICTED, meta))

    def _forget(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        with self._lock:
            removed = [k for k in keys if k in self._index]
            for key in removed:
                self.used_bytes -= self._index.pop(key)
        return removed


__all__ = ["DiskL2Adapter"]
