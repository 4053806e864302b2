"""How the disk tier reaches a file in one of its subdirectories without following a link.

Apart from the tier (``disk``: index, size bound, records) and from the file names and the
restart scan (``disk_scan``) because this is the tier's one defence that outlives the
start-up check: the tier directory is checked once and then reached only through a
descriptor, but a subdirectory (``ab/``) could still be swapped for a symlink while the
daemon runs (only by its own uid or root: the tier is 0700), and ``O_NOFOLLOW`` on
``ab/ab...kvc`` guards only the last component. So every access (read, write, rename,
unlink, and the scan's listing) opens the subdirectory itself (``O_NOFOLLOW``, checked by
``fstat``: ours, 0700) and the file relative to that descriptor, never a path with a slash
in it: three system calls more per chunk, against a chunk file's read or write.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from collections.abc import Iterator

from kvcache.errors import CorruptChunkError, UntrustedPathError
from kvcache.trusted_dir import check_mode, open_private_dir

WHAT = "disk tier (--l2-disk-path)"
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO planted there never blocks
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ChunkFiles:
    """The files in the subdirectories of the tier directory ``path``, open as ``root`` (not
    owned: the tier closes it). A file is named by its subdirectory and its name in it."""

    def __init__(self, path: str, root: int) -> None:
        self.path = path
        self.root = root

    def shown(self, sub: str, name: str = "") -> str:
        """The file (or, without ``name``, the subdirectory) as a path, for messages and tests."""
        return os.path.join(self.path, sub, name) if name else os.path.join(self.path, sub)

    @contextlib.contextmanager
    def subdir(self, sub: str, create: bool = False) -> Iterator[int]:
        """A descriptor of subdirectory ``sub``, opened without following a link and checked
        (ours, 0700) at every use, not once: it may have been swapped since. ``create``: make
        it if missing, and raise ``UntrustedPathError`` (an ``OSError``) for a bad one (a
        write, and the start-up scan, which stops the tier); else a bad one is a
        ``CorruptChunkError`` (the chunk is a miss), a missing one ``FileNotFoundError``."""
        shown = self.shown(sub)
        what = f"{WHAT} subdirectory"
        if create:
            fd = open_private_dir(sub, what, self.root, shown)
        else:
            try:
                fd = os.open(sub, DIR, dir_fd=self.root)
            except OSError as err:
                if err.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise CorruptChunkError(f"{shown} is a symlink or not a directory") from None
            try:
                check_mode(os.fstat(fd), shown, os.getuid(), what)
            except UntrustedPathError as exc:
                os.close(fd)
                raise CorruptChunkError(str(exc)) from None
        try:
            yield fd
        finally:
            os.close(fd)

    def open(self, sub: str, name: str) -> io.FileIO:
        """File ``name`` of subdirectory ``sub``, for reading (``open_regular``); a link in
        place of the subdirectory is corrupt too."""
        with self.subdir(sub) as dir_fd:
            return open_regular(name, dir_fd, self.shown(sub, name))

    def unlink(self, sub: str, name: str) -> None:
        """Remove file ``name`` of ``sub``, if ``sub`` is still a real directory (a link in
        its place holds no file of ours: nothing is removed behind it)."""
        try:
            fd = os.open(sub, DIR, dir_fd=self.root)
        except OSError:  # gone, or a link
            return
        try:
            unlink(name, fd)
        finally:
            os.close(fd)


def open_regular(name: str, dir_fd: int, shown: str) -> io.FileIO:
    """File ``name`` in directory ``dir_fd``, for reading; a symlink there (``O_NOFOLLOW``:
    ELOOP), or anything but a regular file (a FIFO would block its reader for good), is
    corrupt. ``shown``: the path messages name."""
    try:
        fd = os.open(name, READ, dir_fd=dir_fd)
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        raise CorruptChunkError(f"{shown} is a symlink, not a chunk file") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptChunkError(f"{shown} is not a regular file")
    return io.FileIO(fd, "rb")


def unlink(name: str, dir_fd: int) -> None:
    """Remove ``name`` from directory ``dir_fd``; already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


__all__ = ["DIR", "READ", "WHAT", "ChunkFiles", "open_regular", "unlink"]
