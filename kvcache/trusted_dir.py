"""Trusting a local directory, the files in it and the processes behind its sockets.

The daemon's runtime directory (its Unix sockets), the disk tier (cached KV, as private as
the prompts it came from) and the client's view of both follow one rule, kept here so that
server, storage and client cannot drift apart: a directory is trusted only if it is a real
directory (no symlink: ``lstat``, or ``fstat`` of an ``O_NOFOLLOW`` descriptor), owned by the
expected uid and closed to everyone else (no group or other bits: 0700). Then no other user
(root aside) can add, replace or rename an entry in it, so a socket or a file found there was
put there by that uid: the check is made once, on the directory, rather than on every entry.

A socket's peer is checked as well, by ``SO_PEERCRED`` (the uid that called ``listen``):
a directory that is trusted today may be swapped tomorrow (a tmp cleaner removes it, another
user recreates it), and the peer check holds for the connection actually made.

Imports nothing of ``kvcache.server``: the client uses it without the daemon's code.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct

from kvcache.errors import UntrustedPathError

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_mode(st: os.stat_result, path: str, uid: int, what: str, kind: int = stat.S_IFDIR) -> None:
    """Raise ``UntrustedPathError`` unless ``st`` (of ``path``, links not followed) is of
    ``kind`` (a directory, or ``stat.S_IFREG`` for a file), owned by ``uid``, and has no group
    or other permission bits. The message names ``what`` and says how to fix it."""
    found = stat.S_IFMT(st.st_mode)
    if found != kind:
        if found == stat.S_IFLNK:
            raise UntrustedPathError(
                f"{what} {path} is a symlink; kvcache follows none there (another user could "
                f"aim it anywhere): give the real path, or remove {path} and let kvcache create it"
            )
        want = "directory" if kind == stat.S_IFDIR else "regular file"
        raise UntrustedPathError(f"{what} {path} is not a {want}: remove it or pick another path")
    if st.st_uid != uid:
        raise UntrustedPathError(
            f"{what} {path} is owned by uid {st.st_uid}, not by the expected uid {uid}: another "
            f"user may have planted it. Remove it (or, if its contents are trusted, chown {uid} "
            "it) or pick another path"
        )
    if st.st_mode & 0o077:
        mode = stat.S_IMODE(st.st_mode)
        want = "700" if kind == stat.S_IFDIR else "600"
        raise UntrustedPathError(
            f"{what} {path} is open to other users (mode {mode:o}, not 0{want}): they could read, and maybe "
            f"change, what is in it. chmod {want} {path} if its contents are trusted, else "
            "remove it"
        )


def check_private_dir(path: str, uid: int | None = None, what: str = "directory") -> None:
    """Raise ``UntrustedPathError`` unless ``path`` is a private directory of ``uid``
    (default: this process's); ``FileNotFoundError`` if it does not exist."""
    check_mode(os.lstat(path), path, os.getuid() if uid is None else uid, what)


def ensure_private_dir(path: str, what: str = "directory") -> str:
    """Create ``path`` (0700) if missing, then check it as ``check_private_dir`` does for this
    process's uid; an existing directory is never loosened or tightened, only refused."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    check_private_dir(path, what=what)
    return path


def open_private_dir(
    path: str, what: str = "directory", dir_fd: int | None = None, shown: str | None = None
) -> int:
    """Create ``path`` (0700) if missing and return a descriptor of it, checked as
    ``check_private_dir`` does for this process's uid but on the descriptor itself (``fstat``
    of an ``O_NOFOLLOW`` open), so nothing can be swapped in between. Work relative to it
    (``dir_fd=``): a later rename of ``path`` or of a directory above it then changes nothing.
    ``dir_fd``: resolve ``path`` relative to it; ``shown``: the path messages name."""
    shown = path if shown is None else shown
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700, dir_fd=dir_fd)
    try:
        fd = os.open(path, _OPEN_DIR, dir_fd=dir_fd)
    except OSError as exc:  # ELOOP / ENOTDIR: a symlink or a file where the directory should be
        check_mode(os.lstat(path, dir_fd=dir_fd), shown, os.getuid(), what)
        raise UntrustedPathError(f"{what} {shown} cannot be opened: {exc.strerror}") from None
    try:
        check_mode(os.fstat(fd), shown, os.getuid(), what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def peer_cred(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket, as the
    kernel recorded them at its ``connect`` or ``listen`` (``SO_PEERCRED``)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return int(pid), int(uid), int(gid)


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket."""
    return peer_cred(sock)[1]


def ipc_peer_uid(zap_address: str) -> int | None:
    """The uid libzmq appends to an ``ipc://`` peer's ZAP address (``host:uid:gid:pid``, read
    with ``SO_PEERCRED``); None for a TCP peer."""
    return _peer_field(zap_address, 1)


def ipc_peer_pid(zap_address: str) -> int | None:
    """The pid of an ``ipc://`` peer, as ``ipc_peer_uid`` reads its uid (0: the peer runs in
    a pid namespace this process cannot see)."""
    return _peer_field(zap_address, 3)


def _peer_field(zap_address: str, index: int) -> int | None:
    parts = zap_address.rsplit(":", 3)
    if len(parts) != 4:
        return None
    try:
        return int(parts[index])
    except ValueError:
        return None


__all__ = [
    "check_mode",
    "check_private_dir",
    "ensure_private_dir",
    "ipc_peer_pid",
    "ipc_peer_uid",
    "open_private_dir",
    "peer_cred",
    "peer_uid",
]
