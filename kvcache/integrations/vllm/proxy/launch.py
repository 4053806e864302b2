"""Start the proxy as a child process and wait until it listens.

Shared by the disaggregation benchmark and the tests, which run the proxy with vLLM's python
(it has aiohttp) from a process that may not have it; standard library only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import kvcache

_READY = re.compile(r"kvcache proxy ready on (?P<url>http://\S+)")
REPO = Path(kvcache.__file__).resolve().parents[1]


class ProxyProcess:
    """``python -m kvcache.integrations.vllm.proxy`` run by ``python`` on a free port (unless
    ``args`` names one); ``url`` is where it listens. Its output is kept in ``lines``."""

    def __init__(self, python: str, prefill: Sequence[str], decode: Sequence[str], args: Sequence[str] = (),
                 ready_timeout_s: float = 60.0) -> None:  # fmt: skip
        port = [] if "--port" in args else ["--port", "0"]
        argv = [python, "-m", "kvcache.integrations.vllm.proxy", "--prefill", *prefill, "--decode", *decode,
                *port, *args]  # fmt: skip
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd="/")  # fmt: skip
        self.lines: list[str] = []
        self._ready = threading.Event()
        self._new_line = threading.Condition()
        self.url = ""
        threading.Thread(target=self._read, name="proxy-output", daemon=True).start()
        if not self._ready.wait(ready_timeout_s) or not self.url:
            self.kill()
            raise RuntimeError("the proxy did not start:\n" + self.log)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._new_line:
                self.lines.append(line)
                self._new_line.notify_all()
            if m := _READY.search(line):
                self.url = m["url"]
                self._ready.set()
        self._ready.set()  # exited before it was ready

    def wait_for(self, text: str, timeout_s: float) -> None:
        """Until a line of its output contains ``text``; ``TimeoutError`` after ``timeout_s``."""
        with self._new_line:
            if not self._new_line.wait_for(lambda: text in self.log, timeout_s):
                raise TimeoutError(f"the proxy never said {text!r}:\n{self.log}")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (graceful: requests in flight finish), then wait; SIGKILL if it will not stop."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def __enter__(self) -> ProxyProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
