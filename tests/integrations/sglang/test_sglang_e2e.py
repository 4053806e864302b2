"""SGLang end to end: real SGLang 0.5.23 servers on CPU with kvcache as their HiCache storage.

Two ``sglang.launch_server`` processes (a tiny random LLaMA written here, no download) load
``KVCacheStorage`` with ``--hicache-storage-backend dynamic`` and share one real daemon:

* server A keeps SGLang's own host pool (the backend stages pages through a sealed buffer);
* server B allocates its host pool in kvcache memfds (``shared_pool.install()``, what
  docs/sglang.md tells an operator to run), so the daemon copies its pages in place.

A answers a prompt and its pages reach the daemon; after ``/flush_cache`` (device and host tiers
emptied) the same prompt is answered from storage with the same tokens; B's first request for
the prompt is served from the pages A stored. The test-only CPU shims (``cishim/``) are on the
servers' ``PYTHONPATH``; the servers start once, together, for the module.

Skips where SGLang cannot be installed (the ``sglang_python`` fixture). About 2 minutes on the 2-core
CI machine (4 when other jobs load it), nearly all of it the two servers starting together.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvcache.server.launch import DaemonProcess
from tests.integrations.sglang.venv import sglang_env

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow

PAGE = 4
PROMPT = " ".join(f"w{i}" for i in range(1, 34))  # BOS + 33 one-token words: 8 whole pages
PAGES = 8
START_S = 420.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 120) -> Any:
        data = json.dumps(body).encode() if body is not None else b""
        req = urllib.request.Request(self.url + path, data=data, headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            text = resp.read().decode()
        return json.loads(text) if body is not None else text

    def flush(self, within_s: float = 60) -> None:
        """``/flush_cache`` until SGLang takes it: it refuses (HTTP 400) until its scheduler
        has gone idle once after the last request, which a loaded machine delays."""
        deadline = time.monotonic() + within_s
        while True:
            try:
                assert "flushed" in self.post("/flush_cache").lower()
                return
            except urllib.error.HTTPError as exc:
                if exc.code != 400 or time.monotonic() > deadline:
                    raise
            time.sleep(0.2)  # SGLang's scheduler has no idle signal to wait on

    def generate(self, prompt: str = PROMPT) -> dict[str, Any]:
        out: dict[str, Any] = self.post("/generate", {"text": prompt, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})  # fmt: skip
        return out

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"SGLang server {self.name} exited {self.proc.returncode}:\n{self.tail()}")
        try:
            with urllib.request.urlopen(self.url + "/model_info", timeout=5):
                return True
        except (urllib.error.URLError, OSError):
            return False

    def registration(self) -> str:
        """The backend's log line saying how the host pool was registered."""
        lines = self.log.read_text(errors="replace").splitlines()
        return next((x for x in lines if "kvcache: " in x and " registered as " in x), "")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def terminate(self) -> None:
        """SIGTERM to the server's process group (its scheduler and detokenizer too)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)

    def wait(self) -> None:
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def daemon() -> Iterator[DaemonProcess]:
    d = DaemonProcess(["--l1-size-gb", "0.25", "--metrics-sample-rate", "1.0"])
    yield d
    d.kill()
    d.remove_runtime_dir()


@pytest.fixture(scope="module")
def model_dir(sglang_python: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sglang_python, str(HERE / "sgl_model.py"), str(out)], check=True, capture_output=True,
                   timeout=300, env=sglang_env(), cwd="/")  # fmt: skip
    return out


def _launch(python: str, name: str, model: Path, endpoint: str, log: Path, **env: str) -> Server:
    port = _free_port()
    extra = {"backend_name": "kvcache", "module_path": "kvcache.integrations.sglang.backend",
             "class_name": "KVCacheStorage", "interface_v1": 1, "endpoint": endpoint,
             "prefetch_threshold": PAGE}  # fmt: skip
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
           "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", "2048",
           "--attention-backend", "torch_native", "--page-size", str(PAGE), "--skip-server-warmup",
           "--enable-hierarchical-cache", "--hicache-ratio", "2", "--hicache-io-backend", "direct",
           "--hicache-mem-layout", "layer_first", "--hicache-storage-backend", "dynamic",
           # wait_complete: a request waits for its storage prefetch. SGLang's default
           # ("timeout") computes the prompt when the prefetch is late, which a loaded CI
           # machine made happen (0 tokens from storage, nothing wrong served).
           "--hicache-storage-prefetch-policy", "wait_complete",
           "--hicache-storage-backend-extra-config", json.dumps(extra)]  # fmt: skip
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd="/", start_new_session=True,
                                env=sglang_env(KVCACHE_SGLANG_CPU_SHIM="1", **env))  # fmt: skip
    return Server(name, f"http://127.0.0.1:{port}", proc, log)


@pytest.fixture(scope="module")
def servers(
    sglang_python: str, model_dir: Path, daemon: DaemonProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("sglang-logs")
    started: dict[str, Server] = {}
    try:
        started["A"] = _launch(sglang_python, "A", model_dir, daemon.endpoint, logs / "a.log")
        started["B"] = _launch(sglang_python, "B", model_dir, daemon.endpoint, logs / "b.log",
                               KVCACHE_SGLANG_SHARED_POOL="1")  # fmt: skip
        deadline = time.monotonic() + START_S
        waiting = set(started)
        while waiting:
            waiting = {n for n in waiting if not started[n].ready()}
            if waiting and time.monotonic() > deadline:
                late = started[min(waiting)]
                raise AssertionError(f"{sorted(waiting)} not ready in {START_S} s:\n{late.tail()}")
            time.sleep(1)  # polling a server's readiness: there is nothing to wait on
        yield started
    finally:
        for s in started.values():
            s.terminate()
        for s in started.values():  # both shut down at once
            s.wait()


def _metric(daemon: DaemonProcess, name: str) -> float:
    """The daemon's counter ``name``, summed over its labels (instances)."""
    with urllib.request.urlopen(daemon.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _await_metric(daemon: DaemonProcess, name: str, at_least: float, server: Server) -> None:
    """Until the daemon counts ``at_least`` (its metrics follow its events: poll, not sleep)."""
    deadline = time.monotonic() + 60
    while _metric(daemon, name) < at_least:
        assert time.monotonic() < deadline, f"{name} never reached {at_least}:\n{server.tail()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def first(servers: dict[str, Server], daemon: DaemonProcess) -> dict[str, Any]:
    """A's answer to the prompt, once its pages are on the daemon (SGLang writes them to
    storage in the background after the request: wait for the daemon's count, not a time)."""
    answer = servers["A"].generate()
    assert answer["meta_info"]["cached_tokens"] == 0, answer
    _await_metric(daemon, "kvcache_store_stored_chunks_total", PAGES, servers["A"])
    return answer


def _from_storage(answer: dict[str, Any]) -> int:
    details = answer["meta_info"].get("cached_tokens_details") or {}
    return int(details.get("storage", 0))


def test_after_flush_the_same_prompt_is_served_from_storage(
    servers: dict[str, Server], first: dict[str, Any], daemon: DaemonProcess
) -> None:
    a = servers["A"]
    a.flush()
    loaded = _metric(daemon, "kvcache_retrieve_retrieved_tokens_total")
    again = a.generate()
    assert _from_storage(again) == PAGES * PAGE, again["meta_info"]
    assert again["meta_info"]["cached_tokens"] >= PAGES * PAGE
    assert again["output_ids"] == first["output_ids"], (first, again)
    assert again["text"] == first["text"]
    # and the daemon says it served them
    _await_metric(daemon, "kvcache_retrieve_retrieved_tokens_total", loaded + PAGES * PAGE, a)


def test_a_second_server_sharing_the_daemon_gets_the_prefix(
    servers: dict[str, Server], first: dict[str, Any], daemon: DaemonProcess
) -> None:
    b = servers["B"]
    answer = b.generate()  # B's first request: nothing in its device or host tiers
    assert _from_storage(answer) == PAGES * PAGE, answer["meta_info"]
    assert answer["output_ids"] == first["output_ids"], (first, answer)
    assert b.registration().endswith("in place"), b.registration()  # the daemon copied into B's pool
    assert "staged by" in servers["A"].registration(), servers["A"].registration()
    assert daemon.proc.poll() is None
