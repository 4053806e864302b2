"""Closing a client whose background thread is stuck, against real daemons, in a child process
(``stuck_close.py``): a libzmq assertion there would abort the process, seen here as a signal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_close_keeps_the_peer_check_until_a_stuck_thread_lets_go_of_its_socket() -> None:
    """A caller's callback holds the background thread past ``close``'s wait, and the daemon
    restarts meanwhile, so the thread's socket connects again. ``close`` stopped the ZAP handler
    (which libzmq asks about each of that socket's connections) and then destroyed the context
    under the thread: a handler going while a handshake reaches it aborts the process in libzmq
    (``zap_client.cpp:50``, reproduced with plain sockets), and the thread, once let go, died on
    its destroyed socket (``ZMQError: Socket operation on non-socket``) without resolving what
    it still held. The handler and the context now outlive the thread's socket."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("stuck_close.py"))], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, f"exit status {done.returncode}:\n{done.stderr}"
