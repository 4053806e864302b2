"""Real ``vllm serve`` (OpenAI-compatible) processes with ``KVCacheConnector``, for the
end-to-end tests that drive vLLM over HTTP (no ``test_`` prefix: helpers, not tests).

Each server runs the CPU build from its own venv with the tiny random model of
``vllm_driver.make_model``, in its own session so that stopping it takes its engine-core
children too. Servers start without waiting for each other (``wait_ready`` afterwards), so
two of them cost about one start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.integrations.vllm.test_connector import _free_port

HERE = Path(__file__).parent
BLOCK = 32


def make_model(vllm_python: str, model: Path) -> None:
    subprocess.run(
        [vllm_python, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); from pathlib import Path; "
                            f"from vllm_driver import make_model; make_model(Path({str(model)!r}))"],
        check=True, capture_output=True, timeout=300, cwd="/",
    )  # fmt: skip


@dataclass
class Server:
    base: str
    proc: subprocess.Popen[bytes]
    log: Path

    def wait_ready(self, timeout_s: float = 600) -> float:
        """Seconds until ``/health`` answered (a server offers no readiness event: polled)."""
        start = time.monotonic()
        while True:
            assert self.proc.poll() is None, self.log.read_text()[-6000:]
            late = time.monotonic() - start > timeout_s
            assert not late, "vLLM did not start:\n" + self.log.read_text()[-6000:]
            try:
                if urllib.request.urlopen(self.base + "/health", timeout=2).status == 200:
                    return time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def start_server(
    vllm_python: str, model: Path, runtime_dir: Path, log: Path, kv_role: str, extra: dict[str, Any]
) -> Server:
    """One server whose connector (``kv_role``, ``kv_connector_extra_config`` = ``extra``)
    talks to the daemon whose runtime directory is ``runtime_dir``."""
    port = _free_port()
    connector = {
        "kv_connector": "KVCacheConnector",
        "kv_connector_module_path": "kvcache.integrations.vllm",
        "kv_role": kv_role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--tokenizer", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
           "--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--seed", "0",
           "--kv-cache-memory-bytes", str(64 << 20), "--enable-prefix-caching",
           "--kv-transfer-config", json.dumps(connector)]  # fmt: skip
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1", KVCACHE_RUNTIME_DIR=str(runtime_dir))
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd="/",
                                start_new_session=True)  # fmt: skip
    return Server(f"http://127.0.0.1:{port}", proc, log)


def post(url: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip().startswith(b"{") else {}


def scrape(url: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, by its full series name (labels included)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v for series, v in samples.items()
        if (series == name or series.startswith(name + "{")) and all(w in series for w in want)
    )  # fmt: skip


def reset_prefix_cache(base: str, timeout_s: float = 60) -> None:
    """vLLM refuses (``success: false``) while a finished request's blocks wait for their
    asynchronous stores; it documents retrying."""
    deadline = time.monotonic() + timeout_s
    while not post(base + "/reset_prefix_cache").get("success"):
        assert time.monotonic() < deadline, "vLLM never released the blocks"
        time.sleep(0.05)  # the server offers no event for it
