"""Where the disk tier's chunk files live, and how each is reached without following a link.

Apart from the tier (``disk``: index, size bound, records) because this is its one defence
that outlives the start-up check: the tier directory is checked once and then reached only
through a descriptor, but a subdirectory (``ab/``) could still be swapped for a symlink
while the daemon runs (only by its own uid or root: the tier is 0700), and ``O_NOFOLLOW``
on ``ab/ab...kvc`` guards only the last component. So every access opens the subdirectory
itself (``O_NOFOLLOW``, checked by ``fstat``: ours, 0700) and the file relative to that
descriptor, never a path with a slash in it: three system calls more per chunk, against a
chunk file's read or write.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from collections.abc import Iterator

from kvcache.errors import CorruptChunkError, UntrustedPathError
from kvcache.records import ChunkKey
from kvcache.trusted_dir import check_mode, open_private_dir

SUFFIX = ".kvc"
WHAT = "disk tier (--l2-disk-path)"
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO planted there never blocks
DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ChunkFiles:
    """The chunk files under the tier directory ``path``, open as ``root`` (not owned: the
    tier closes it)."""

    def __init__(self, path: str, root: int) -> None:
        self.path = path
        self.root = root

    def file(self, key: ChunkKey) -> str:
        """The chunk's file, as a path (for messages and tests)."""
        return os.path.join(self.path, *names(key))

    @contextlib.contextmanager
    def subdir(self, name: str, create: bool = False) -> Iterator[int]:
        """A descriptor of subdirectory ``name``, opened without following a link and checked
        (ours, 0700) at every use, not once: it may have been swapped since. ``create``: make
        it if missing, and raise ``UntrustedPathError`` (an ``OSError``) for a bad one; else
        a bad one is a ``CorruptChunkError`` (the chunk is a miss), a missing one
        ``FileNotFoundError``."""
        shown = os.path.join(self.path, name)
        what = f"{WHAT} subdirectory"
        if create:
            fd = open_private_dir(name, what, self.root, shown)
        else:
            try:
                fd = os.open(name, DIR, dir_fd=self.root)
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

    def unlink_chunk(self, key: ChunkKey) -> None:
        """Remove the chunk's file, if its subdirectory is still a real directory."""
        sub, name = names(key)
        try:
            fd = os.open(sub, DIR, dir_fd=self.root)
        except OSError:  # gone, or a link: no file of ours to remove there
            return
        try:
            unlink(name, fd)
        finally:
            os.close(fd)

    def open(self, key: ChunkKey) -> io.FileIO:
        """The chunk's file for reading; a symlink there (``O_NOFOLLOW``: ELOOP) or for its
        subdirectory, or anything but a regular file (a FIFO would block its reader for
        good), is corrupt."""
        sub, name = names(key)
        try:
            with self.subdir(sub) as dir_fd:
                fd = os.open(name, READ, dir_fd=dir_fd)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise CorruptChunkError(f"{self.file(key)} is a symlink, not a chunk file") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CorruptChunkError(f"{self.file(key)} is not a regular file")
        return io.FileIO(fd, "rb")


def names(key: ChunkKey) -> tuple[str, str]:
    """The chunk's subdirectory and file name: ``ab``, ``ab12...ef.kvc``."""
    name = f"{key:032x}"
    return name[:2], f"{name}{SUFFIX}"


def unlink(path: str, dir_fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path, dir_fd=dir_fd)


__all__ = ["DIR", "READ", "SUFFIX", "WHAT", "ChunkFiles", "names", "unlink"]
