"""Run as a child process (``test_close``): close a client whose background thread is stuck in a
caller's callback, restart the daemon at the same endpoint, then let the thread go.

In a process of its own because what can go wrong is a libzmq assertion, which aborts the whole
process (the engine, in production): the parent sees a signal, not a failed assertion.

The thread's DEALER stays open until the thread ends, and libzmq asks the ZAP handler
(``peer_check.DaemonUidCheck``) about each connection it makes (one per socket: the channel
replaces its socket to reconnect, ``protocol.channel``; the thread may do so once it is let go,
and a handshake may still be under way when it ends). That handler must therefore outlive the
socket: libzmq aborts (``zap_client.cpp:50``, "Transport endpoint is not connected")
when a connection's handshake reaches ZAP while the handler's socket is going away. Exit status:
0 when the handler outlived the thread, which then ended cleanly; 1 with a message otherwise.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from typing import Any

from kvcache.client import KVCacheClient
from kvcache.protocol import messages as m
from kvcache.server.launch import DaemonProcess
from tests.client.helpers import ARGS, wait_for

TIMEOUT_S = 0.5
CHECK = "kvcache-peer-check"
THREAD = "kvcache-client-41"


def threads(name: str) -> int:
    return sum(t.name == name for t in threading.enumerate())


def main() -> int:
    errors: list[str] = []
    threading.excepthook = lambda a: errors.append(f"{a.thread.name if a.thread else '?'}: {a.exc_value!r}")
    scratch = tempfile.mkdtemp()
    runtime_dir = os.path.join(scratch, "run")  # both daemons': the same ipc:// endpoint
    with DaemonProcess(ARGS, runtime_dir=runtime_dir) as first:
        c = KVCacheClient(first.endpoint, 41, "stuck", timeout_s=TIMEOUT_S)
        assert threads(CHECK) == 1
        release, stuck = threading.Event(), threading.Event()

        def hold(_: Future[Any]) -> None:  # a caller's callback that does not return (yet)
            if threading.current_thread().name == THREAD:
                stuck.set()
                release.wait(60)

        while not stuck.is_set():  # until one runs on the background thread (a reply may win)
            c.session.submit(m.Ping(), m.Pong).add_done_callback(hold)
            stuck.wait(0.2)
        start = time.monotonic()
        c.close()
        took = time.monotonic() - start
        if took > TIMEOUT_S + 3:
            errors.append(f"close took {took:.1f} s with the thread stuck")
    # The first daemon is gone; a second listens where the stuck thread's socket points.
    with DaemonProcess(ARGS, runtime_dir=runtime_dir):
        # A sleep on purpose: the check below is that the handler is *not* stopped, by close or
        # by anything it left behind, while the stuck thread's socket is open; an absence has
        # no event to wait on.
        time.sleep(0.5)
        if threads(CHECK) != 1:
            errors.append("the ZAP handler was stopped while the stuck thread's socket was still open")
        release.set()
        wait_for(lambda: threads(THREAD) == 0, 10, "the background thread to end")
        wait_for(lambda: threads(CHECK) == 0, 10, "the ZAP handler to stop after it")
    shutil.rmtree(scratch, ignore_errors=True)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
