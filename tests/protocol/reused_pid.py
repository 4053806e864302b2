"""Run inside a new pid namespace (``unshare -Urpf``, see ``test_peer_check``): a daemon's
process exits and the next one listening on its socket gets the same pid, as restarts in a
small pid space do. The client's peer check must then watch the new process, not keep the
old one's pidfd under that pid: a connection the live daemon drops would otherwise fail
its calls as "exited" while it may still copy into the engine's blocks.

Exit status: 0 held, 1 broken (the reason on stderr), 77 the pid could not be reused.
The "daemons" are bare ROUTERs (a real process each, listening on the socket), which take
every request and answer none, and drop a connection that sends a frame over 64 KiB.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import zmq

from kvcache.errors import DaemonUnavailableError
from kvcache.protocol import messages as m
from kvcache.protocol.channel import Channel
from kvcache.protocol.peer_check import DaemonUidCheck

SERVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
sock.bind(sys.argv[1])
print("up", flush=True)
while True:
    sock.recv_multipart()
"""


class CountedCheck(DaemonUidCheck):
    """The peer check, releasing ``approved`` after each connection it approves."""

    def __init__(self, context: zmq.Context[Any], uid: int) -> None:
        self.approved = threading.Semaphore(0)
        super().__init__(context, uid)

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        reply = super()._answer(msg)
        if reply[2] == b"200":
            self.approved.release()
        return reply


def start(endpoint: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", SERVER, endpoint], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


def approved(check: CountedCheck, chan: Channel) -> bool:
    """Whether the check approved a connection of ``chan`` within 10 s; the channel connects
    again (a fresh socket) while its owner waits on it, as the client's thread does."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if check.approved.acquire(timeout=0.05):
            return True
        chan.receive(0.05)
    return False


def fail(why: str) -> None:
    print(why, file=sys.stderr)
    sys.exit(1)


def main() -> None:
    endpoint = f"ipc://{tempfile.mkdtemp()}/daemon.sock"
    old = start(endpoint)
    ctx: zmq.Context[Any] = zmq.Context()
    check = CountedCheck(ctx, os.getuid())
    chan = Channel(ctx, endpoint, check.sockopts, daemon=check)
    if not approved(check, chan):
        fail("the first daemon was never approved")
    old.kill()
    old.wait()
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(old.pid - 1))
    new = start(endpoint)
    if new.pid != old.pid:
        sys.exit(77)
    if not approved(check, chan):
        fail("the restarted daemon was never approved")
    if check.exited(new.pid):
        fail(f"pid {new.pid} is said to have exited while its daemon runs")
    chan._sock.send(b"x" * (1 << 17))  # over the live daemon's frame cap: it drops the connection
    try:
        chan.call(m.Ping(), timeout_s=0.5)
    except DaemonUnavailableError as exc:
        if "exited" in str(exc):
            fail(f"a call at a live daemon failed as lost: {exc}")
    else:
        fail("the daemon answered nothing, yet the call returned")
    new.kill()
    chan.close()
    check.close()
    ctx.term()


if __name__ == "__main__":
    main()
