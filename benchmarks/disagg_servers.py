"""Start and stop the disaggregation benchmark's servers: ``vllm serve`` processes (the
OpenAI-compatible API server, in vLLM's venv) with or without kvcache's connector.

Separate from the benchmark because it is process plumbing (argv, readiness, logs, shutdown,
scraping ``/metrics``), the way ``vllm_engines.py`` is for the vLLM benchmark. Standard
library only: the benchmark's own process need not have vLLM or an HTTP library.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def connector_config(role: str, extra: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvcache's connector in ``role``."""
    return {
        "kv_connector": "KVCacheConnector",
        "kv_connector_module_path": "kvcache.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": dict(extra),
    }


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` child on a free port, its output in
    ``log_path``; ``connector`` None runs vLLM alone. ``wait_ready`` polls ``/health``
    (vLLM offers no other readiness signal), so several servers can start side by side."""

    def __init__(
        self,
        name: str,
        python: str,
        model_dir: Path,
        env: Mapping[str, str],
        log_dir: Path,
        connector: dict[str, Any] | None,
        *,
        block_size: int,
        max_model_len: int,
        kv_cache_mb: int,
    ) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"vllm-{name}.log"
        argv = [
            python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--tokenizer",
            str(model_dir),
            "--served-model-name",
            "bench",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            str(block_size),
            "--max-model-len",
            str(max_model_len),
            "--max-num-batched-tokens",
            str(max_model_len),
            "--seed",
            "0",
            "--kv-cache-memory-bytes",
            str(kv_cache_mb << 20),
            "--enable-prefix-caching",
        ]
        if connector is not None:
            argv += ["--kv-transfer-config", json.dumps(connector)]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=dict(env), cwd="/", start_new_session=True
            )

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server {self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"vLLM server {self.name} not ready in {timeout_s:g} s:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)  # polling: the server offers no readiness event

    def tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def metrics(self) -> dict[str, float]:
        """Every sample of the server's Prometheus page, by series name (labels included)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                series, value = line.rsplit(" ", 1)
                out[series] = float(value)
        return out

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM to the server's process group (API server and engine core), SIGKILL if stuck."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def total(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        v
        for series, v in samples.items()
        if (series == name or series.startswith(name + "{")) and all(w in series for w in want)
    )
