"""kvcache's statistics in a real vLLM server's own ``/metrics``, checked against the daemon's.

A vLLM OpenAI-compatible server (the CPU build, its own venv, engine core in its own process)
runs with ``KVCacheConnector`` and a real daemon. A prompt is served, vLLM's prefix cache is
reset (``/reset_prefix_cache``, served with ``VLLM_SERVER_DEV_MODE=1``), and the same prompt is
served again, now loaded from kvcache. vLLM's ``/metrics`` must then show, under vLLM's
offloading names and kvcache's own, exactly what the daemon's scrape shows for the same
requests: tokens stored and loaded, lookups by tier, and load bytes consistent with the model's
KV size per token.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.vllm.test_connector import Daemon, _free_port, start_daemon
from tests.integrations.vllm.vllm_driver import prompts
from tests.integrations.vllm.vllm_server import post, scrape, total

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow
BLOCK = 32


@pytest.fixture
def server(vllm_python: str, tmp_path: Path) -> Iterator[tuple[str, Daemon]]:
    model = tmp_path / "model"
    subprocess.run(
        [vllm_python, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); from pathlib import Path; "
                            f"from vllm_driver import make_model; make_model(Path({str(model)!r}))"],
        check=True, capture_output=True, timeout=300, cwd="/",
    )  # fmt: skip
    daemon = start_daemon(tmp_path, tmp_path / "l2", "daemon", ["--metrics-sample-rate", "1"])
    port = _free_port()
    connector = {
        "kv_connector": "KVCacheConnector",
        "kv_connector_module_path": "kvcache.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"timeout_s": 30.0},
    }
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--tokenizer", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--enforce-eager", "--block-size", str(BLOCK),
           "--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--seed", "0",
           "--kv-cache-memory-bytes", str(64 << 20), "--enable-prefix-caching",
           "--kv-transfer-config", json.dumps(connector)]  # fmt: skip
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", HF_HUB_OFFLINE="1",
               KVCACHE_RUNTIME_DIR=str(tmp_path / "run"))  # fmt: skip
    log = tmp_path / "vllm-server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd="/",
                                start_new_session=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "vLLM server did not start:\n" + log.read_text()[-6000:]
            try:
                if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)  # polling a server that offers no readiness event
        yield base, daemon
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        daemon.stop()
        print(log.read_text()[-3000:])


def test_vllm_metrics_show_what_the_daemon_did(server: tuple[str, Daemon], tmp_path: Path) -> None:
    base, daemon = server
    prompt = prompts(0, 1024, 1, 40)[0]
    model = str(tmp_path / "model")
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    first = post(base + "/v1/completions", body)
    # Refused ({"success": false}) while the first request's blocks wait for its asynchronous
    # stores (vLLM frees them when the worker reports them done): retry, as vLLM documents.
    deadline = time.monotonic() + 60
    while not post(base + "/reset_prefix_cache").get("success"):
        assert time.monotonic() < deadline, "vLLM never released the first request's blocks"
        time.sleep(0.05)  # the server offers no event for it
    second = post(base + "/v1/completions", body)
    assert first["choices"] == second["choices"]  # type: ignore[index]

    # vLLM records connector stats as engine outputs arrive; wait until the load shows, and
    # the stores: they are asynchronous, settled by the worker after the response was sent.
    deadline = time.monotonic() + 60
    while True:
        ours, theirs = scrape(base + "/metrics"), scrape(daemon.metrics_url)
        loaded = total(ours, "vllm:kvcache_loaded_tokens_total")
        settled = total(ours, "vllm:kvcache_stored_tokens_total") == total(
            theirs, "kvcache_store_stored_tokens_total"
        )
        if (loaded >= 1024 and settled) or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # the scrape is the only way to observe vLLM's logger
    assert loaded == total(theirs, "kvcache_retrieve_retrieved_tokens_total") == 1024
    stored = total(ours, "vllm:kvcache_stored_tokens_total")
    assert stored > 0 and stored == total(theirs, "kvcache_store_stored_tokens_total")
    # Lookups: vLLM asked once per admission, for the whole prompt each time.
    assert total(ours, "vllm:kvcache_lookup_tokens_total") == total(
        theirs, "kvcache_lookup_requested_tokens_total"
    )
    hits = total(ours, "vllm:kvcache_lookup_hit_tokens_total")
    assert hits == total(theirs, "kvcache_lookup_hit_tokens_total") >= 1024
    assert total(ours, "vllm:kvcache_lookup_hit_tokens_total", tier="L1") == hits  # nothing from disk yet
    # vLLM's offloading names, with vLLM's labels, and the daemon's own copy figures: bytes and
    # seconds travel with each reply, so both sides count the same transfer records.
    load_bytes = total(ours, "vllm:kv_offload_load_bytes_total")
    store_bytes = total(ours, "vllm:kv_offload_store_bytes_total")
    assert load_bytes > 0 and load_bytes / loaded == store_bytes / stored
    assert load_bytes == total(theirs, "kvcache_offload_load_bytes_total")
    assert store_bytes == total(theirs, "kvcache_offload_store_bytes_total")
    for op in ("load", "store"):
        seconds = total(ours, f"vllm:kv_offload_{op}_time_total")
        assert seconds == pytest.approx(total(theirs, f"kvcache_offload_{op}_seconds_total"), rel=1e-6)
    assert total(ours, "vllm:kv_offload_load_size_count") >= 1
    assert total(ours, "vllm:kv_offload_load_size_sum") == load_bytes
    assert total(ours, "vllm:kv_offload_load_time_total") > 0
    assert any('model_name="' in s for s in ours if s.startswith("vllm:kv_offload_load_bytes_total"))
    assert total(ours, "vllm:kvcache_load_failures_total") == 0
