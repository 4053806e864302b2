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

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.vllm.test_connector import ScrapedDaemon, start_daemon
from tests.integrations.vllm.vllm_driver import prompts
from tests.integrations.vllm.vllm_server import make_model, post, scrape, start_server, total

pytestmark = pytest.mark.slow


@pytest.fixture
def server(vllm_python: str, tmp_path: Path) -> Iterator[tuple[str, ScrapedDaemon]]:
    make_model(vllm_python, tmp_path / "model")
    daemon = start_daemon(tmp_path, tmp_path / "l2", "daemon", ["--metrics-sample-rate", "1"])
    vllm = start_server(vllm_python, tmp_path / "model", tmp_path / "run", tmp_path / "vllm-server.log",
                        "kv_both", {"timeout_s": 30.0})  # fmt: skip
    try:
        vllm.wait_ready(300)
        yield vllm.base, daemon
    finally:
        vllm.stop()
        daemon.stop()
        print(vllm.log.read_text()[-3000:])


def test_vllm_metrics_show_what_the_daemon_did(server: tuple[str, ScrapedDaemon], tmp_path: Path) -> None:
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
    # The daemon's figures follow its event bus: wait until it dispatched all it published.
    deadline = time.monotonic() + 60
    while True:
        ours, theirs = scrape(base + "/metrics"), scrape(daemon.metrics_url)
        loaded = total(ours, "vllm:kvcache_loaded_tokens_total")
        settled = total(ours, "vllm:kvcache_stored_tokens_total") == total(
            theirs, "kvcache_store_stored_tokens_total"
        )
        drained = total(theirs, "kvcache_event_bus_published_events_total") == total(
            theirs, "kvcache_event_bus_dispatched_events_total"
        )
        if (loaded >= 1024 and settled and drained) or time.monotonic() > deadline:
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
