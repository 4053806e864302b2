"""The disk tier's file names, and the restart scan that trusts only whole, consistent files.

Split from ``disk`` because this is what a restart trusts: the tier's metadata is the file
*name* (``ab/<key>.<crc32>.kvc``), the chunk's record is the file's *content* (``codec``:
header with key, shape, dtype, size and the same CRC32, then the payload). The two are written
by different system calls (the content by ``write``, the name by the atomic ``os.replace`` that
publishes the file), so a torn write, a truncated file or a file swapped for another record
disagrees with one of them, and is dropped here or at its first read, never served.

The scan after a restart reads one header per file (never a payload) and keeps a file only
when its name parses, its header decodes (meta checksum included), names the same key and
CRC, and the file's size is exactly header plus payload: a crash mid-write (only ``*.tmp``
files, removed), a truncated or extended file, a header torn by a crash or a disk error, and a
record renamed under another key are all removed before the tier answers anything. The payload
is verified against both CRCs at every read (``DiskL2Adapter.load``), so a payload torn in the
middle (size intact) is a miss, counted, at its first read. Cost: one ``open`` and one read of
at most a few hundred bytes per file, so the bound is per *file*, not per byte (docs: disk tier).

Files named ``<key>.kvc`` (written by builds before the name carried the CRC) are checked the
same way and renamed to the new name, so an upgrade keeps the cache.

Each file is charged again to the tenant its record names (``codec`` version 3), so a restart
keeps every tenant's share of the tier as it was; a file that names none (written by an older
build, or by the default tenant of library use) is charged to the tenant "", one party of its
own. The recorded tenant is read as untrusted bytes (``codec.decode_extras``: bounded, strict
UTF-8): a file whose tenant does not decode is dropped like any other damaged record.

Like every other access, the scan reaches a subdirectory only through ``disk_access`` (opened
without following a link, checked on its descriptor) and each file relative to it: a link
planted in place of a subdirectory stops the tier at start, one in place of a chunk file is
refused before it is read.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass

from kvcache.errors import CorruptChunkError
from kvcache.records import ChunkKey
from kvcache.storage.l2 import codec
from kvcache.storage.l2.disk_access import WHAT, ChunkFiles, open_regular, unlink
from kvcache.trusted_dir import check_mode

SUFFIX = ".kvc"


def names(key: ChunkKey, crc: int) -> tuple[str, str]:
    """The chunk's subdirectory and file name: ``ab``, ``ab12...ef.<crc32>.kvc``."""
    name = f"{key:032x}"
    return name[:2], f"{name}.{crc:08x}{SUFFIX}"


def rel_name(key: ChunkKey, crc: int) -> str:
    """The chunk's file relative to the tier directory: ``ab/ab12...ef.<crc32>.kvc`` (for
    messages and tests; the tier never opens a path with a slash, see ``disk_access``)."""
    return "/".join(names(key, crc))


def parse_name(name: str) -> tuple[ChunkKey, int | None] | None:
    """(key, crc) of a chunk file's name; crc None for an old ``<key>.kvc``; None for a
    name that is no chunk file of ours."""
    if not name.endswith(SUFFIX):
        return None
    parts = name[: -len(SUFFIX)].split(".")
    try:
        if len(parts) == 1 and len(parts[0]) == 32:
            return int(parts[0], 16), None
        if len(parts) == 2 and len(parts[0]) == 32 and len(parts[1]) == 8:
            return int(parts[0], 16), int(parts[1], 16)
    except ValueError:
        return None
    return None


def read_head(f: io.FileIO) -> tuple[codec.ChunkHeader, bytes]:
    """The record's header, and its bytes up to the payload (meta included)."""
    head = f.read(codec.MAX_HEADER)
    header = codec.decode_header(head)
    if header.header_len > len(head):  # a long meta: read up to the payload
        head += f.read(header.header_len - len(head))
    return header, head


@dataclass(frozen=True, slots=True)
class Found:
    """One whole, consistent chunk file found by the scan."""

    key: ChunkKey
    crc: int
    size: int
    mtime: float
    meta: bytes
    tenant: str
    """Whose share of the tier it counts against; "" for a file that names no tenant."""


def scan_tier(files: ChunkFiles) -> tuple[list[Found], int]:
    """The whole chunk files of every subdirectory, oldest modification first (the order the
    tier's policies take them in), and how many damaged ones were removed; raises as
    ``scan_subdir`` does."""
    found: list[Found] = []
    dropped = 0
    with os.scandir(files.root) as entries:
        subdirs = [e.name for e in entries if e.is_dir(follow_symlinks=False) or e.is_symlink()]
    for name in subdirs:
        kept, bad = scan_subdir(files, name)
        found += kept
        dropped += bad
    found.sort(key=lambda f: (f.mtime, f.key))
    return found, dropped


def scan_subdir(files: ChunkFiles, sub: str) -> tuple[list[Found], int]:
    """The whole chunk files of subdirectory ``sub``, and how many damaged ones it removed.
    Raises ``UntrustedPathError`` for a subdirectory that is a link or not a private one of
    ours, and for a chunk file that is not a regular file of ours closed to others, before
    reading it; removes crashed writes (``*.tmp``)."""
    found: list[Found] = []
    dropped = 0
    with files.subdir(sub, create=True) as fd:  # checked on its descriptor, never followed
        with os.scandir(fd) as entries:
            listed = list(entries)
        for entry in listed:
            if entry.name.endswith(".tmp"):
                unlink(entry.name, fd)  # a write interrupted by a crash
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            st = entry.stat(follow_symlinks=False)
            shown = files.shown(sub, entry.name)
            check_mode(st, shown, os.getuid(), f"{WHAT} chunk file", stat.S_IFREG)
            parsed = parse_name(entry.name)
            if parsed is None:
                continue
            key, crc = parsed
            try:
                with open_regular(entry.name, fd, shown) as f:
                    header, head = read_head(f)
                meta, tenant = codec.decode_extras(head, header)
                if header.key != key or (crc is not None and header.crc32 != crc):
                    raise CorruptChunkError("name and record disagree")
                if st.st_size != header.header_len + header.nbytes:
                    raise CorruptChunkError(
                        f"{st.st_size} bytes, record says {header.header_len + header.nbytes}"
                    )
            except (CorruptChunkError, OSError):
                unlink(entry.name, fd)
                dropped += 1
                continue
            if crc is None:  # an older build's name: give it the metadata it lacks
                os.replace(entry.name, names(key, header.crc32)[1], src_dir_fd=fd, dst_dir_fd=fd)
            found.append(Found(key, header.crc32, st.st_size, st.st_mtime, meta, tenant or ""))
    return found, dropped


__all__ = [
    "SUFFIX",
    "Found",
    "names",
    "parse_name",
    "read_head",
    "rel_name",
    "scan_subdir",
    "scan_tier",
]
