"""The README's first command: ``python -m kvcache.demo`` shows the daemon doing its job."""

from __future__ import annotations

import re
import subprocess
import sys
import time


def test_demo_stores_looks_up_retrieves_and_points_at_metrics() -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvcache.demo"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    elapsed = time.monotonic() - start
    out = proc.stdout
    assert proc.returncode == 0, f"{out}\n{proc.stderr}"
    assert re.search(r"store: .* 36 new chunks of 256 tokens, 28 skipped", out)
    assert re.search(r"lookup: .* 24576/32768 tokens hit \(75%\)", out)
    assert re.search(r"retrieve: 16384/16384 tokens .* byte-exact", out)
    url = re.search(r"metrics:\s+(http://127\.0\.0\.1:\d+/metrics)", out)
    assert url is not None
    assert re.search(r"kvcache_retrieve_retrieved_tokens_total 16384", out)
    assert "daemon exited with status 0" in out
    assert elapsed < 60, f"the demo took {elapsed:.0f} s; the README promises under a minute"
