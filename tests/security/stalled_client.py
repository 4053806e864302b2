"""An engine process for ``test_handshake_drops``: a real ``KVCacheClient`` pinging ENDPOINT
for SECONDS while another thread holds the interpreter lock STALL_S at a time, as a busy
engine's full garbage collection or a long C call does (the client's ZAP handler is a Python
thread, so its answers wait that long). Exits 0 if the process lived through it.

Run as ``python -m tests.security.stalled_client ENDPOINT SECONDS STALL_S``: in a child
process, so that a libzmq assertion aborting it is seen as a return code, not as the end of
the test run."""

from __future__ import annotations

import contextlib
import ctypes
import sys
import threading
import time

from kvcache.client import KVCacheClient

_HOLDS_THE_LOCK = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL for its whole duration


def _stall(stall_s: float) -> None:
    usleep = _HOLDS_THE_LOCK.usleep
    while True:
        usleep(round(stall_s * 1e6))
        time.sleep(stall_s / 3)


def main() -> None:
    endpoint, seconds, stall_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    client = KVCacheClient(endpoint, 1, "victim", timeout_s=0.5)
    threading.Thread(target=_stall, args=(stall_s,), daemon=True).start()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with contextlib.suppress(Exception):  # nothing answers: timeouts, then the breaker
            client.ping()
        time.sleep(0.05)
    print("alive", flush=True)


if __name__ == "__main__":
    main()
